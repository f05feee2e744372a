"""Fixtures shared by every test folder."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model (SmolLM2-135M-Instruct) as a Hugging Face folder, from the normal cache
    ($RAYPAGED_CACHE or ~/.cache/raypaged): converted on the first run ever (~15 s), then reused."""
    from raypaged.model.default_model import default_model_dir as convert_or_find

    return convert_or_find()
