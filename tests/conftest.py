"""Fixtures shared by every test folder."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in its interpreter; the variable must be set before triton is
# first imported anywhere in the session, whichever test folder happens to import it first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_sessionstart(session) -> None:
    """Build the CPU decode attention once, before any test: engines built inside Ray workers
    would otherwise each wait, under a test's timeout, on the first (~40 s) compile. A machine
    that cannot build it gets the tests' own clear failures instead. Not on a GPU machine: its
    engines run the Triton kernels, and `make gpu-check` has minutes, not one to spare."""
    if torch.cuda.is_available():
        return
    from raypaged.kernels import cpu_paged_decode

    try:
        cpu_paged_decode.load()
    except RuntimeError:
        pass


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model (SmolLM2-135M-Instruct) as a Hugging Face folder, from the normal cache
    ($RAYPAGED_CACHE or ~/.cache/raypaged): converted on the first run ever (~15 s), then reused."""
    from raypaged.model.default_model import default_model_dir as convert_or_find

    return convert_or_find()
