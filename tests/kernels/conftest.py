"""Kernel tests run the Triton kernels on CPU tensors through the Triton interpreter.

TRITON_INTERPRET must be set before a kernel module is imported: @triton.jit decides between the
compiler and the interpreter when it decorates. If something imported raypaged's kernel modules
earlier in this process (without the interpreter), they are dropped here so the test modules
import them again, interpreted. CUDA runs of the same checks live in tests/gpu/.
"""
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

for _name in [m for m in sys.modules
              if m.startswith("raypaged.kernels") or m == "raypaged.model.attention.triton_backend"]:
    del sys.modules[_name]

try:
    import triton  # noqa: F401
except ImportError:  # a CPU install without triton: nothing here can run
    collect_ignore_glob = ["test_*.py"]
