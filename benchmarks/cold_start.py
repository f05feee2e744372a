"""Cold start: seconds from launching `raypaged generate` to its first streamed character.

Assumes the default model's conversion cache is warm (run any raypaged command once first).

    python benchmarks/cold_start.py [--runs 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import table, write  # noqa: E402

RAYPAGED = str(Path(sys.executable).with_name("raypaged"))


def once(extra: list[str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.Popen([RAYPAGED, "generate", "What is the capital of France?", "--chat",
                             "--max-tokens", "8", *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    proc.stdout.read(1)  # the first character of the answer
    first = time.perf_counter() - t0
    proc.wait()
    return first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    once([])  # make sure the conversion cache exists
    rows = []
    for label, extra in (("default KV budget (2 GiB)", []), ("--kv-memory-mb 256", ["--kv-memory-mb", "256"])):
        times = [once(extra) for _ in range(args.runs)]
        rows.append({"command": label, "median_s": statistics.median(times), "min_s": min(times)})
    print(table(rows, ["command", "median_s", "min_s"]))
    print(f"target: < 10 s to the first token: {rows[0]['median_s']:.1f} s "
          f"({'met' if rows[0]['median_s'] < 10 else 'MISSED'})")
    print(f"wrote {write('cold_start', {'args': vars(args), 'rows': rows})}")


if __name__ == "__main__":
    main()
