"""Batch inference on Ray: `raypaged batch in.jsonl out.jsonl`, or `run_batch(...)` in Python.

rows.py (input lines) -> grouping.py (prefix order) -> job.py (bounded, resumable run through
engines.py: the serving fleet and frontend, without HTTP) -> output.py (one line per input);
progress.py (bar, log lines, summary); options.py (batch settings); api.py / cli.py (entry).
Imports are lazy: `raypaged batch --help` starts neither torch nor ray.
"""
from __future__ import annotations

__all__ = ["run_batch", "BatchOptions", "BatchSummary"]


def __getattr__(name: str):
    if name == "run_batch":
        from raypaged.batch.api import run_batch
        return run_batch
    if name == "BatchOptions":
        from raypaged.batch.options import BatchOptions
        return BatchOptions
    if name == "BatchSummary":
        from raypaged.batch.progress import BatchSummary
        return BatchSummary
    raise AttributeError(f"module 'raypaged.batch' has no attribute {name!r}")
