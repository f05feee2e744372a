"""GPU only: decode steps/s of the default model's shapes with CUDA graphs on vs off.

Random weights with SmolLM2-135M's config (weights cannot travel to the GPU box); batch 1, 8, 32
sequences decoding at ~512 tokens of context. Writes benchmarks/results/cuda_graphs_<device>.json.

    PYTHONPATH=. python3 benchmarks/cuda_graph_bench.py [--steps 200]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.random_model import random_model  # noqa: E402
from benchmarks.report import pyplot, plot_path, table, write  # noqa: E402
from raypaged.core.sampling_params import SamplingParams  # noqa: E402
from raypaged.config import EngineArgs  # noqa: E402


def steps_per_s(batch: int, eager: bool, steps: int, config: str) -> float:
    args = EngineArgs(kv_memory_mb=4096, max_model_len=2048, max_num_seqs=max(batch, 1),
                      attention_backend="triton", enforce_eager=eager, dtype="bfloat16",
                      device="cuda")
    model, setup = random_model(config, args)
    core, _, runner = setup.build_core(model)
    for i in range(batch):
        core.add_request(f"r{i}", list(range(100 + i, 612 + i)),
                         SamplingParams(temperature=0, max_tokens=steps + 20, ignore_eos=True))
    for _ in range(10):  # prefill + warm-up decode steps
        core.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        core.step()  # includes the host sync of reading sampled tokens, as in serving
    torch.cuda.synchronize()
    return steps / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--config", default="smollm2-135m")
    args = ap.parse_args()
    device = torch.cuda.get_device_name().replace(" ", "_")
    rows = []
    for batch in (1, 8, 32):
        eager = steps_per_s(batch, True, args.steps, args.config)
        graphs = steps_per_s(batch, False, args.steps, args.config)
        rows.append({"batch": batch, "eager_steps_s": eager, "graph_steps_s": graphs,
                     "speedup": graphs / eager})
    print(f"{args.config}, random weights, bf16, {torch.cuda.get_device_name()}")
    print(table(rows, ["batch", "eager_steps_s", "graph_steps_s", "speedup"]))
    small = [r["speedup"] for r in rows if r["batch"] <= 8]
    print(f"target: graphs >= 1.5x eager at batch 1-8: {min(small):.2f}x ({'met' if min(small) >= 1.5 else 'MISSED'})")
    print(f"wrote {write(f'cuda_graphs_{device}', {'args': vars(args), 'device': torch.cuda.get_device_name(), 'rows': rows})}")
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(5, 3.5))
    xs = [str(r["batch"]) for r in rows]
    ax.plot(xs, [r["eager_steps_s"] for r in rows], marker="o", label="eager")
    ax.plot(xs, [r["graph_steps_s"] for r in rows], marker="o", label="CUDA graphs")
    ax.set_xlabel("batch")
    ax.set_ylabel("decode steps / s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(plot_path(f"cuda_graphs_{device}"), dpi=80)


if __name__ == "__main__":
    main()
