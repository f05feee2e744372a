"""Loading the C++ decode attention survives a process killed while it held torch's build lock."""
from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from pathlib import Path

from raypaged.kernels import cpu_paged_decode

LOAD = "from raypaged.kernels import cpu_paged_decode; cpu_paged_decode.load(); print('loaded')"


def test_a_lock_left_by_a_killed_loader_does_not_block_the_next_load():
    module = cpu_paged_decode.load()  # built (or found) here first
    build_dir = Path(module.__file__).parent
    stale = build_dir / "lock"
    stale.touch()  # what torch leaves when its holder is SIGKILLed mid-load
    try:
        done = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True,
                              timeout=600)  # a rebuild on a busy machine can take minutes
    finally:
        stale.unlink(missing_ok=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "loaded"


def test_a_load_that_waits_for_another_process_says_so_and_then_loads(tmp_path):
    """A worker whose first load waits minutes for another process's build says what it waits
    for (it sat silent, `starting`), and loads once the other is done."""
    module = cpu_paged_decode.load()
    flock = Path(module.__file__).parent / "raypaged.flock"
    with cpu_paged_decode.exclusive_flock(flock):  # another process building, as it were
        waiter = subprocess.Popen([sys.executable, "-c", LOAD], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        said = ""
        while "waiting for another process" not in said and time.monotonic() < deadline:
            if select.select([waiter.stderr], [], [], deadline - time.monotonic())[0]:
                said += os.read(waiter.stderr.fileno(), 4096).decode()
        assert waiter.poll() is None  # still waiting while the lock is held
    out, err = waiter.communicate(timeout=600)
    assert "building or loading the C++ attention kernels" in said, said + err
    assert waiter.returncode == 0 and out.strip() == "loaded", err
