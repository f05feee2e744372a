"""GPU only: engine decode throughput with CUDA graphs on and off (and with overlapped
scheduling), against the memory roofline.

Random weights with real shapes (weights cannot travel to the GPU box): Llama-3-8B at batch 1, 8,
64, 256 and the default model (SmolLM2-135M) at batch 1, 8, 32, every sequence decoding after a
--context-token prompt. One model per config; each (batch, mode) gets its own engine (KV cache,
graphs) over it. Modes: eager; graphs; graphs + async_scheduling (the next step is scheduled
while the GPU runs this one). Timed: --steps whole engine steps (scheduler, inputs, forward,
sampling, the host sync that reads the sampled tokens), after prefill and 5 warm-up steps.

  profile   at batch 1 with graphs, another --steps steps under cProfile: where the host's time per
            step goes (the H200 showed ~2.5 ms of it beyond the GPU's work), top functions by
            own time, in the JSON and printed

  roofline  bytes one decode step must read (every weight but the input embedding, which is
            gathered by row, plus the K/V of every sequence at its mean context over the timed
            steps) / measured device-to-device copy bandwidth: the fastest a step can be

    PYTHONPATH=. python3 benchmarks/cuda_graph_bench.py [--steps 100] [--configs llama-3-8b]

Writes benchmarks/results/engine_decode_<device>.json (+ .png).
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.random_model import random_model  # noqa: E402
from benchmarks.report import pyplot, plot_path, table, write  # noqa: E402
from raypaged.config import EngineArgs  # noqa: E402
from raypaged.core.sampling_params import SamplingParams  # noqa: E402
from raypaged.model.setup import ModelSetup  # noqa: E402

BATCHES = {"llama-3-8b": (1, 8, 64, 256), "smollm2-135m": (1, 8, 32)}
TARGETS = {"graphs_vs_eager_min_batch_1_8": 1.5, "batch1_roofline_fraction_min": 0.70}
MODES = {"eager": dict(enforce_eager=True), "graphs": dict(enforce_eager=False),
         "graphs+async": dict(enforce_eager=False, async_scheduling=True)}


def copy_bandwidth() -> float:
    """(read + write) bytes / s of a 1 GiB device-to-device copy, median of 10."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * (1 << 30) / sorted(times[3:])[5]


def max_len(context: int, steps: int) -> int:
    """Prompt, prefill's token, 5 warm-ups, the timed steps and as many profiled, with room."""
    return context + 2 * steps + 32


def weight_bytes_per_step(model) -> int:
    """Every parameter a decode step reads in full: all but a separate input embedding."""
    tied = model.lm_head is None
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters()
               if tied or "embed_tokens" not in name)


def measure(model, config: str, batch: int, mode: str, steps: int, context: int) -> dict:
    args = EngineArgs(kv_memory_mb=None, kv_context_len=batch * max_len(context, steps),
                      max_model_len=max_len(context, steps), max_num_seqs=batch,
                      attention_backend="triton", dtype="bfloat16", device="cuda", **MODES[mode])
    setup = ModelSetup.decide(args, model.config)
    core, _, runner = setup.build_core(model)
    for i in range(batch):
        core.add_request(f"r{i}", [100 + (i * 7919 + j) % 30000 for j in range(context)],
                         SamplingParams(temperature=0, max_tokens=2 * steps + 16, ignore_eos=True))
    started: set[str] = set()
    while len(started) < batch:  # prefill, however many steps it takes
        started.update(d.request_id for d in core.step() if d.new_token_ids)
    for _ in range(5):
        core.step()
    torch.cuda.synchronize()
    graph_steps = runner.num_graph_steps
    t0 = time.perf_counter()
    for _ in range(steps):
        core.step()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    replayed = runner.num_graph_steps - graph_steps
    # the timed steps read context + 6 ... context + 5 + steps positions (prefill, 5 warm-ups)
    kv_bytes = batch * (context + 6 + steps // 2) * setup.kv_shape.bytes_per_token
    row = {"config": config, "batch": batch, "mode": mode, "steps": steps,
           "graph_steps": replayed, "ms_per_step": elapsed / steps * 1e3,
           "tokens_s": batch * steps / elapsed, "kv_bytes_per_step": kv_bytes}
    if mode == "graphs" and batch == 1:  # steps more: max_tokens leaves room for them
        row["host_profile"] = host_profile(core, steps)
    if core.executor is not None:
        core.executor.shutdown()
    del core, runner
    gc.collect()
    torch.cuda.empty_cache()
    return row


def host_profile(core, steps: int, top: int = 15) -> list[dict]:
    """The functions with the most own time over `steps` more steps, per step."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        core.step()
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (calls, ncalls, own, cumulative, _)
    rows = [{"function": f"{Path(f).name}:{line} {name}", "calls_per_step": n / steps,
             "own_us_per_step": own / steps * 1e6, "cum_us_per_step": cum / steps * 1e6}
            for (f, line, name), (_, n, own, cum, _) in stats.items()]
    return sorted(rows, key=lambda r: -r["own_us_per_step"])[:top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--context", type=int, default=512, help="prompt tokens per sequence")
    ap.add_argument("--configs", nargs="+", default=list(BATCHES), choices=list(BATCHES))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("cuda_graph_bench needs a CUDA GPU")
    device = torch.cuda.get_device_name()
    bw = copy_bandwidth()
    print(f"{device}: copy bandwidth {bw / 1e9:,.0f} GB/s; {args.steps} steps after a "
          f"{args.context}-token prompt, bf16, random weights")
    rows = []
    for config in args.configs:
        model_args = EngineArgs(max_model_len=max_len(args.context, args.steps), dtype="bfloat16",
                                max_num_seqs=max(BATCHES[config]), attention_backend="triton",
                                device="cuda")
        model, _ = random_model(config, model_args)
        weights = weight_bytes_per_step(model)
        for batch in BATCHES[config]:
            runs = [measure(model, config, batch, mode, args.steps, args.context) for mode in MODES]
            for r in runs:
                roof_ms = (weights + r["kv_bytes_per_step"]) / bw * 1e3
                r.update(weight_bytes=weights, roofline_ms=roof_ms,
                         roofline_fraction=roof_ms / r["ms_per_step"],
                         vs_eager=r["tokens_s"] / runs[0]["tokens_s"])
            rows += runs
            print(table(runs, ["config", "batch", "mode", "graph_steps", "ms_per_step", "tokens_s",
                               "roofline_ms", "roofline_fraction", "vs_eager"]), flush=True)
            for r in runs:
                if "host_profile" in r:
                    print(f"host time per step, {config} batch 1 with graphs (cProfile, own time):")
                    print(table(r["host_profile"], ["function", "calls_per_step",
                                                    "own_us_per_step", "cum_us_per_step"]))
        del model
        gc.collect()
        torch.cuda.empty_cache()
    checks = []
    for r in rows:
        case = f"{r['config']} b{r['batch']} {r['mode']}"
        if r["mode"] == "graphs" and r["batch"] <= 8:
            checks.append({"target": f"graphs >= {TARGETS['graphs_vs_eager_min_batch_1_8']}x eager",
                           "case": case, "value": r["vs_eager"],
                           "pass": r["vs_eager"] >= TARGETS["graphs_vs_eager_min_batch_1_8"]})
        if r["mode"] != "eager" and r["batch"] == 1:
            checks.append({"target": f"b1 >= {TARGETS['batch1_roofline_fraction_min']:.0%} roofline",
                           "case": case, "value": r["roofline_fraction"],
                           "pass": r["roofline_fraction"] >= TARGETS["batch1_roofline_fraction_min"]})
    print()
    print(table(rows, ["config", "batch", "mode", "ms_per_step", "tokens_s", "roofline_fraction",
                       "vs_eager"]))
    print()
    print(table(checks, ["target", "case", "value", "pass"]))
    name = "engine_decode_" + re.sub(r"[^a-z0-9]+", "_", device.lower()).strip("_")
    print(f"wrote {write(name, {'args': vars(args), 'device': device, 'torch': torch.__version__, 'copy_bandwidth_bytes_per_s': bw, 'targets': TARGETS, 'rows': rows, 'checks': checks})}")
    plot(name, rows)


def plot(name: str, rows: list[dict]) -> None:
    plt = pyplot()
    if plt is None:
        return
    configs = sorted({r["config"] for r in rows})
    fig, axes = plt.subplots(1, len(configs), figsize=(5.5 * len(configs), 4), squeeze=False)
    for ax, config in zip(axes[0], configs):
        for mode in MODES:
            rs = [r for r in rows if r["config"] == config and r["mode"] == mode]
            ax.plot([str(r["batch"]) for r in rs], [r["tokens_s"] for r in rs], marker="o",
                    label=mode)
        rs = [r for r in rows if r["config"] == config and r["mode"] == "graphs"]
        ax.plot([str(r["batch"]) for r in rs], [r["batch"] / r["roofline_ms"] * 1e3 for r in rs],
                ls="--", color="gray", label="roofline")
        ax.set_yscale("log")
        ax.set_xlabel("batch")
        ax.set_ylabel("decode tokens / s")
        ax.set_title(f"{config}, bf16, random weights")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = plot_path(name)
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
