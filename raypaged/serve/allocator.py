"""The worker processes' C allocator: tcmalloc through LD_PRELOAD by default, glibc's otherwise.

Under steady serving load a CPU worker's tensors change shape every step, and oneDNN's kernel
cache (bounded by onednn_cache_capacity) evicts and refills; glibc malloc keeps the freed chunks
in its per-thread arenas and rarely returns them, so RSS climbs although the heap in use is flat
(benchmarks/memory_probe.py); tcmalloc reuses them, and RSS stays flat.

The library comes from Debian's libtcmalloc-minimal4 (`make tcmalloc`, which `make` runs). A
worker started where it is missing falls back to glibc with one warning naming the fix;
`--worker-allocator system` chooses glibc on purpose.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

TCMALLOC_SONAME = "libtcmalloc_minimal.so.4"
LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64",
                "/usr/lib", "/usr/local/lib")


def find_tcmalloc(dirs: tuple[str, ...] = LIBRARY_DIRS) -> str | None:
    paths = (Path(d) / TCMALLOC_SONAME for d in dirs)
    return next((str(p) for p in paths if p.is_file()), None)


def worker_env_vars(allocator: str, dirs: tuple[str, ...] = LIBRARY_DIRS) -> dict[str, str]:
    """Environment variables for a worker's runtime_env: LD_PRELOAD of tcmalloc, or nothing
    (`allocator` is ServeOptions.worker_allocator: "tcmalloc" or "system")."""
    if allocator == "system":
        return {}
    path = find_tcmalloc(dirs)
    if path is None:
        log.warning("%s not found in %s: workers use glibc malloc, whose arenas fragment under "
                    "load (RSS grows). Install it with `apt-get install libtcmalloc-minimal4` "
                    "(or `make tcmalloc`), or pass --worker-allocator system to silence this.",
                    TCMALLOC_SONAME, ", ".join(dirs))
        return {}
    return {"LD_PRELOAD": " ".join(filter(None, (path, os.environ.get("LD_PRELOAD"))))}
