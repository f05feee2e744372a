"""Import the Triton kernels without installing raypaged.

A bare GPU box has torch and triton but neither ray nor the raypaged install, so
`raypaged.kernels` (an install-time mapping of kernels/) does not exist there. kernels/ imports
only torch and triton and never names its own package, so it loads by path as a standalone
package. The name is private, so it never shadows (or is shadowed by) an installed
raypaged.kernels, and it works the same with or without the install:

    from benchmarks._kernels import kernel_module      # with the checkout on sys.path
    paged_decode = kernel_module("paged_decode").paged_decode
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

KERNELS_DIR = Path(__file__).resolve().parents[1] / "kernels"
PACKAGE = "_raypaged_kernels"


def kernel_module(name: str) -> ModuleType:
    """kernels/<name>.py, imported as _raypaged_kernels.<name>."""
    if PACKAGE not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            PACKAGE, KERNELS_DIR / "__init__.py", submodule_search_locations=[str(KERNELS_DIR)])
        package = importlib.util.module_from_spec(spec)
        sys.modules[PACKAGE] = package
        spec.loader.exec_module(package)
    return importlib.import_module(f"{PACKAGE}.{name}")
