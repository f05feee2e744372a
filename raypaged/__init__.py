"""raypaged: LLM serving on Ray with paged attention. `from raypaged import LLM, SamplingParams`.

Imports are lazy so `import raypaged.core` (or raypaged.kernels) pulls in neither torch nor ray.
"""
from __future__ import annotations

import os as _os

__version__ = "0.1.0"

# Installed, setuptools maps kernels/ to raypaged.kernels. In a bare source checkout
# (PYTHONPATH=., as on a GPU box without our install) make the same import work.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "kernels", "__init__.py")) and _root not in __path__:
    __path__.append(_root)
__all__ = ["LLM", "SamplingParams", "EngineArgs", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    if name == "LLM":
        from raypaged.llm import LLM
        return LLM
    if name == "SamplingParams":
        from raypaged.core.sampling_params import SamplingParams
        return SamplingParams
    if name == "EngineArgs":
        from raypaged.engine import EngineArgs
        return EngineArgs
    if name in ("RequestOutput", "CompletionOutput"):
        from raypaged import outputs
        return getattr(outputs, name)
    raise AttributeError(f"module 'raypaged' has no attribute {name!r}")
