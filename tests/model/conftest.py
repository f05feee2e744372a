"""Fixtures for model tests."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from raypaged.model.default_model import default_model_dir


@dataclass(frozen=True)
class Conversion:
    cache_root: Path
    model_dir: Path
    seconds: float


@pytest.fixture(scope="session")
def fresh_conversion(tmp_path_factory) -> Conversion:
    """The default model converted once per test session into an empty temporary cache."""
    root = tmp_path_factory.mktemp("raypaged_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAYPAGED_CACHE", str(root))
        start = time.perf_counter()
        model_dir = default_model_dir()
        seconds = time.perf_counter() - start
    return Conversion(root, model_dir, seconds)
