"""What Ray Data's own machinery gives a batch job, checked: exactly once after an engine actor
dies, after a failed run re-run, and with Ray Data's checkpointing (CheckpointConfig, id column).

The pipeline is benchmarks/ray_data_baseline.py's (read_json -> map_batches on an actor pool ->
write_json) with a stand-in engine that sleeps instead of generating: these are properties of
Ray Data, not of an engine, and the check then takes seconds, not minutes.

    run                          what happens
    engine actor killed          one actor exits (os._exit) in its first batch; Ray restarts it
    failed run, re-run           the first run fails at row r200 (an exception), then the same
                                 job runs again into the same output folder
    same, with checkpointing     DataContext.checkpoint_config = CheckpointConfig("custom_id", ...)

Counts: rows written, duplicate custom_ids, missing custom_ids, output files. No plot: the
result is a handful of counts (table + JSON in benchmarks/results/).

    pip install -e '.[bench]' && python benchmarks/ray_data_resume.py [--rows 256]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import table, write  # noqa: E402


class StandInEngine:
    """Answers a batch after a pause; can fail once at a chosen row, or die in its first batch."""

    def __init__(self, fail_at: str | None, die_marker: str | None):
        self.fail_at, self.die_marker = fail_at, die_marker

    def __call__(self, batch: dict) -> dict:
        if self.die_marker and not os.path.exists(self.die_marker):
            Path(self.die_marker).touch()  # only the first actor to get here dies, once
            os._exit(1)
        if self.fail_at is not None and self.fail_at in set(batch["custom_id"]):
            raise RuntimeError(f"job interrupted at {self.fail_at}")
        time.sleep(0.2)
        return {"custom_id": batch["custom_id"], "text": [f"answer {p}" for p in batch["prompt"]]}


def run(inp: Path, out: Path, rows: int, batch_size: int, fail_at=None, die_marker=None) -> bool:
    import ray.data
    from ray.data import ActorPoolStrategy

    ds = ray.data.read_json(str(inp), num_cpus=0, override_num_blocks=rows // batch_size)
    ds = ds.map_batches(StandInEngine, fn_constructor_kwargs={"fail_at": fail_at,
                                                              "die_marker": die_marker},
                        compute=ActorPoolStrategy(size=2), batch_size=batch_size, num_cpus=0.5)
    try:
        ds.write_json(str(out))
        return True
    except Exception as exc:  # noqa: BLE001 - the failed first run is the point
        print(f"run failed as planned: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
        return False


def count(out: Path, rows: int, name: str) -> dict:
    files = sorted(out.glob("*.json"))
    ids = Counter(json.loads(line)["custom_id"] for f in files for line in f.open())
    return {"run": name, "rows_written": sum(ids.values()),
            "duplicates": sum(n - 1 for n in ids.values() if n > 1),
            "missing": sum(f"r{i}" not in ids for i in range(rows)), "output_files": len(files)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=32)
    args = ap.parse_args()

    import ray
    from ray.data import DataContext
    from ray.data.checkpoint import CheckpointConfig

    ray.init(address="local", num_cpus=2, include_dashboard=False,
             _node_ip_address="127.0.0.1", log_to_driver=False)
    ctx = DataContext.get_current()
    ctx.enable_progress_bars = False
    results = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            inp = tmp / "in.jsonl"
            inp.write_text("".join(json.dumps({"custom_id": f"r{i}", "prompt": f"question {i}"})
                                   + "\n" for i in range(args.rows)))
            run(inp, tmp / "killed", args.rows, args.batch_size, die_marker=str(tmp / "died"))
            results.append(count(tmp / "killed", args.rows, "engine actor killed"))
            for name, checkpoint in (("failed run, re-run", None),
                                     ("same, with checkpointing", tmp / "checkpoint")):
                out = tmp / name.replace(" ", "_").replace(",", "")
                ctx.checkpoint_config = (CheckpointConfig(id_column="custom_id",
                                                          checkpoint_path=str(checkpoint))
                                         if checkpoint else None)
                run(inp, out, args.rows, args.batch_size, fail_at="r200")
                results.append(count(out, args.rows, name + " (after the failed run)"))
                run(inp, out, args.rows, args.batch_size)
                results.append(count(out, args.rows, name))
            ctx.checkpoint_config = None
    finally:
        ray.shutdown()
    print(f"{args.rows} rows, batches of {args.batch_size}, 2 actors (Ray {ray.__version__})")
    print(table(results, ["run", "rows_written", "duplicates", "missing", "output_files"]))
    print(f"wrote {write('ray_data_resume', {'args': vars(args), 'ray': ray.__version__, 'rows': results})}")


if __name__ == "__main__":
    main()
