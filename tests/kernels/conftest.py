"""Kernel tests run the Triton kernels on CPU tensors through the Triton interpreter.

TRITON_INTERPRET must be set before triton is imported: @triton.jit (triton's own helpers such
as tl.cdiv included) picks the compiler or the interpreter when it decorates. Nothing collected
before this folder imports triton on a CPU machine; on a GPU machine tests/gpu may have (it runs
the same checks compiled), and then these tests skip. Run `pytest tests/kernels` on its own, or
export TRITON_INTERPRET=1, to run them there.
"""
import os
import sys

import pytest

_imported_compiled = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ["TRITON_INTERPRET"] = "1"

try:
    import torch
    import triton  # noqa: F401
except ImportError:  # a CPU install without triton: nothing here can run
    collect_ignore_glob = ["test_*.py"]
else:
    if _imported_compiled:
        message = ("triton was imported (compiled mode) before tests/kernels/conftest.py could set "
                   "TRITON_INTERPRET=1; run `pytest tests/kernels` separately or export it")
        if not torch.cuda.is_available():
            raise pytest.UsageError(message)  # on CPU nothing else covers the kernels: fail loudly
        collect_ignore_glob = ["test_*.py"]
        print(f"tests/kernels skipped: {message}", file=sys.stderr)
