"""Batch inference on Ray: `raypaged batch in.jsonl out.jsonl`, or `run_batch(...)` in Python.

rows.py (input lines, then prefix order) -> job.py (bounded, resumable run through
engines.py: the serving fleet and frontend, without HTTP) -> output.py (one line per input);
progress.py (bar, log lines, summary); options.py (batch settings); entry: job.py's run_batch
(Python) and cli.py.
Imports are lazy: `raypaged batch --help` starts neither torch nor ray.
"""
from __future__ import annotations

_LAZY = {"run_batch": "raypaged.batch.job", "BatchOptions": "raypaged.batch.options",
         "BatchSummary": "raypaged.batch.progress",
         "OutputWriteFailed": "raypaged.batch.output"}  # name -> its module, imported on first use
__all__ = list(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'raypaged.batch' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(_LAZY[name]), name)
