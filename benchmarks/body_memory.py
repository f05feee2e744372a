"""Peak memory and time of checking one request body (serve/json_body.py), by body shape.

    python benchmarks/body_memory.py [--mib 8] [--before REV]

Each body is the largest a router accepts by default (8 MiB) and as cheap to send as a client can
make it: a list of one kind of JSON value under "prompt". Peak memory is tracemalloc's peak over
parse + check (the parsed value included); time is measured in a second run without tracing.
`--before REV` measures json_body.py as it was at REV too (e.g. 2470a30, before the walk
stopped pushing a tuple per element).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
import tracemalloc
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import table, write  # noqa: E402
from raypaged.serve import json_body  # noqa: E402

MiB = 1 << 20
SHAPES = {"ints": b"1,", "floats": b"1.5,", "empty lists": b"[],", "short strings": b'"ab",'}


def body(unit: bytes, size: int) -> bytes:
    n = (size - 20) // len(unit)
    return b'{"prompt":[' + unit * (n - 1) + unit[:-1] + b']}'


def measure(parse, data: bytes) -> tuple[float, float]:
    """(peak bytes / body bytes, seconds)."""
    tracemalloc.start()
    value = parse(data)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del value
    t = time.perf_counter()
    parse(data)
    return peak / len(data), time.perf_counter() - t


def module_at(rev: str):
    src = subprocess.run(["git", "show", f"{rev}:raypaged/serve/json_body.py"], check=True,
                         capture_output=True, text=True).stdout
    mod = types.ModuleType(f"json_body_{rev}")
    exec(compile(src, f"json_body@{rev}", "exec"), mod.__dict__)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=float, default=8.0)
    ap.add_argument("--before", default=None, help="a git revision to compare with")
    args = ap.parse_args()
    size = int(args.mib * MiB)
    before = module_at(args.before) if args.before else None
    rows = []
    for name, unit in SHAPES.items():
        data = body(unit, size)
        row = {"shape": name, "body_mib": round(len(data) / MiB, 2)}
        row["peak_x"], row["seconds"] = measure(json_body.parse_json_body, data)
        row["peak_mib"] = row["peak_x"] * len(data) / MiB
        if before is not None:
            row["before_peak_x"], row["before_seconds"] = measure(before.parse_json_body, data)
            row["before_peak_mib"] = row["before_peak_x"] * len(data) / MiB
        rows.append(row)
        print(f"{name}: {row}", file=sys.stderr)
    cols = ["shape", "body_mib", "peak_mib", "peak_x", "seconds"]
    if before is not None:
        cols += ["before_peak_mib", "before_peak_x", "before_seconds"]
    print(table(rows, cols))
    path = write("body_memory", {"command": " ".join(["python", *sys.argv]),
                                 "before": args.before, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
