"""The oneDNN kernel-cache bound: set before the first matmul (Engine.from_args sets it before the
model loads), refused when it would crash."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from raypaged.model.setup import CACHE_ENV_VARS, bound_kernel_caches


def test_the_bound_is_exported_to_both_libraries(monkeypatch):
    for name in CACHE_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    bound_kernel_caches(96)
    assert [os.environ[name] for name in CACHE_ENV_VARS] == ["96", "96"]


def test_an_explicit_environment_setting_wins(monkeypatch):
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "512")
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    bound_kernel_caches(96)
    assert (os.environ["LRU_CACHE_CAPACITY"], os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]) == (
        "512", "96")


def test_capacity_zero_is_refused_with_the_fix():
    # ideep's LRU cache segfaults at capacity 0: refuse it before it reaches the library
    with pytest.raises(ValueError, match=r"onednn_cache_capacity must be >= 1, got 0: use 1"):
        bound_kernel_caches(0)


def test_engine_from_args_bounds_the_caches_before_the_model_runs(monkeypatch, tmp_path):
    # The libraries read the capacity at their first primitive: the bound must be in the
    # environment by the time the model is loaded (its first forward can follow at once).
    import raypaged.model.loader as loader
    from raypaged.config import EngineArgs
    from raypaged.engine import Engine

    for name in CACHE_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    seen = {}

    class Loaded(Exception):
        pass

    def load_model(*_args, **_kw):
        seen.update({name: os.environ.get(name) for name in CACHE_ENV_VARS})
        raise Loaded

    monkeypatch.setattr(loader, "load_model", load_model)
    configs = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"
    shutil.copy(configs / "smollm2-135m.json", tmp_path / "config.json")  # read before loading
    with pytest.raises(Loaded):
        Engine.from_args(EngineArgs(model=str(tmp_path), onednn_cache_capacity=48))
    assert seen == {"LRU_CACHE_CAPACITY": "48", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "48"}
