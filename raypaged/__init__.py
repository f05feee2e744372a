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
    checkout (PYTHONPATH=., or an editable install) kernels/ sits beside raypaged/: resolve
    exactly that one name there (benchmarks/ and tests/ are not subpackages)."""

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

# name -> the module it lives in, imported on first use (as vLLM's MODULE_ATTRS)
_LAZY = {"LLM": "raypaged.llm", "SamplingParams": "raypaged.core.sampling_params",
         "EngineArgs": "raypaged.config", "RequestOutput": "raypaged.outputs",
         "CompletionOutput": "raypaged.outputs", "run_batch": "raypaged.batch.job"}
__all__ = list(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'raypaged' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(_LAZY[name]), name)
