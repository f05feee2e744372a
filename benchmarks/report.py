"""Shared output for benchmarks: a printed table, a JSON file and a PNG plot in benchmarks/results/."""
from __future__ import annotations

import json
import platform
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def table(rows: list[dict], columns: list[str]) -> str:
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths))  # noqa: E731
    return "\n".join([line(columns), line(["-" * w for w in widths]), *map(line, cells)])


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) < 1000 else f"{v:,.0f}"
    return "" if v is None else str(v)


def write(name: str, payload: dict, indent: int | None = 2) -> Path:
    """benchmarks/results/NAME.json; indent=None for reports of hundreds of rows (size)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "machine": platform.machine(), "processor": platform.processor(),
               "python": platform.python_version(), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
               **payload}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=indent))
    return path


def plot_path(name: str) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    return RESULTS / f"{name}.png"


def pyplot():
    """matplotlib.pyplot with a file-only backend, or None (with a note) when not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not importable: no PNG written")
        return None
    return plt


def bars_by_concurrency(ax, rows: list[dict], group: str, metric: str, title: str) -> None:
    """One bar per `group` value at each concurrency: rows carry `concurrency`, `group`, `metric`."""
    groups = list(dict.fromkeys(r[group] for r in rows))
    concs = sorted({r["concurrency"] for r in rows})
    width = 0.8 / len(groups)
    for k, g in enumerate(groups):
        vals = {r["concurrency"]: r[metric] for r in rows if r[group] == g}
        ax.bar([i + k * width for i in range(len(concs))], [vals.get(c, 0) for c in concs],
               width, label=g)
    ax.set_xticks([i + width * (len(groups) - 1) / 2 for i in range(len(concs))],
                  [f"c={c}" for c in concs])
    ax.set_title(title)
