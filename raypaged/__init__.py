"""raypaged: LLM serving on Ray with paged attention. `from raypaged import LLM, SamplingParams`.

Imports are lazy so `import raypaged.core` (or raypaged.kernels) pulls in neither torch nor ray.
"""
from __future__ import annotations

import importlib.util as _importlib_util
import os as _os
import sys as _sys

__version__ = "0.1.0"


class _KernelsFromCheckout:
    """A regular install maps kernels/ to raypaged.kernels (pyproject's package-dir). In a source
    checkout (PYTHONPATH=., as on a GPU box without our install, or an editable install)
    kernels/ sits beside raypaged/: resolve exactly that one name there, and nothing else
    (benchmarks/ and tests/ are not subpackages)."""

    directory = _os.path.join(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))),
                              "kernels")

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != "raypaged.kernels":
            return None
        return _importlib_util.spec_from_file_location(
            name, _os.path.join(cls.directory, "__init__.py"),
            submodule_search_locations=[cls.directory])


if _os.path.isfile(_os.path.join(_KernelsFromCheckout.directory, "__init__.py")):
    # First: the kernels beside this very raypaged/, even where an editable install of another
    # checkout is on the path too.
    _sys.meta_path.insert(0, _KernelsFromCheckout)
__all__ = ["LLM", "SamplingParams", "EngineArgs", "RequestOutput", "CompletionOutput", "run_batch"]


def __getattr__(name: str):
    if name == "LLM":
        from raypaged.llm import LLM
        return LLM
    if name == "SamplingParams":
        from raypaged.core.sampling_params import SamplingParams
        return SamplingParams
    if name == "EngineArgs":
        from raypaged.config import EngineArgs
        return EngineArgs
    if name == "run_batch":
        from raypaged.batch.api import run_batch
        return run_batch
    if name in ("RequestOutput", "CompletionOutput"):
        from raypaged import outputs
        return getattr(outputs, name)
    raise AttributeError(f"module 'raypaged' has no attribute {name!r}")
