"""Host cost of one engine step around a stand-in model: where the time between device steps goes.

The real engine (scheduler, block pool, runner, sampler, detokenizer, stats) built by
`ModelSetup.build_core`, around a stand-in model whose forward costs a fixed device time (a sleep, or an
instant return) and returns logits of Llama 3's vocabulary (128,256; random over the default
tokenizer's ids, -inf beyond, so detokenization is real). Decode steps at 1 / 64 / 256 running
sequences with 1k-token contexts and 200k cached blocks in the pool. Per step:

    schedule   Scheduler.schedule
    prepare    the runner's input preparation (token ids, positions, block tables, slots)
    sample     the sampler (device work: on this CPU-only machine it runs on the CPU)
    update     applying the sampled tokens in core (Scheduler.update)
    detok      incremental detokenization and stop-string checks
    output     the rest of building the step's outputs (OutputProcessor.process less detok)
    stats      engine.stats(), which the serving loop publishes after every step
    other      the rest of the host's work (the runner's bookkeeping around the model and sampler)
    host       everything but the model and the sampler: the figure the targets bound
               (wall - device - sample: the host time the device path waited for)
    wall       the whole step, as a caller of Engine.step() + stats() sees it
    wall-sample  wall less the sampler: the step as a GPU would see it, where the sampler is
               device work of ~1 ms, not the seconds it takes on this CPU

Each configuration runs twice: `inline` (Engine.step detokenizes before returning, as the
offline LLM does) and `thread` (the serving default, --output-thread: the step hands the token
ids to the output stage's thread, so detok and output run beside the next step, not in it).

Each runs with overlapped scheduling off and on (--async-scheduling): with it, the model and
the sampler run on the engine's step executor thread while the step thread schedules the next
step and applies the last one, so schedule / update / detok / output / stats overlap the device
and only the runner's own preparation stays between two device steps.

Targets (issue 14): host <= 1 ms at 64 sequences and <= 3 ms at 256; with a 10 ms device step,
wall <= 1.1 x 10 ms at 256; stats cost independent of the number of cached blocks.

    python benchmarks/host_overhead.py [--steps 20] [--device-ms 0,10] [--threads 1]
                                       [--stage inline,thread] [--overlap off,on]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.report import plot_path, pyplot, table, write  # noqa: E402
from raypaged.core.block_hash import hash_block  # noqa: E402
from raypaged.core.sampling_params import SamplingParams  # noqa: E402
from raypaged.output_processor import IncrementalDetokenizer  # noqa: E402
from raypaged.engine import Engine, EngineArgs  # noqa: E402
from raypaged.model.setup import ModelSetup  # noqa: E402
from raypaged.model.model_config import ModelConfig  # noqa: E402

CONFIGS = Path(__file__).resolve().parent / "configs"
VOCAB = 128_256
BLOCK = 16
CONTEXT = 1024
CACHED_BLOCKS = 200_000

# (phase, start, end) of every timed call, on whichever thread made it
SPANS: list[tuple[str, float, float]] = []


def timed(fn, phase: str):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SPANS.append((phase, t0, time.perf_counter()))  # list.append is atomic
    return wrapper


def phase_seconds(start: float, end: float, whole: tuple[str, ...]) -> dict[str, float]:
    """Seconds per phase inside the window [start, end]. Overlapped, the step executor is
    already inside a step when the window opens and inside the next when it closes: only the
    part of those calls within the window counts (counting them whole, or not at all, moves a
    whole sampler call into or out of `host`). `whole`: phases counted whole however late they
    end (the output stage's detokenization of the window's steps, finished by the drain)."""
    out: dict[str, float] = defaultdict(float)
    for phase, t0, t1 in SPANS:
        if phase in whole:
            out[phase] += t1 - t0 if t0 >= start else 0.0
        else:
            out[phase] += max(0.0, min(t1, end) - max(t0, start))
    return out


class TimedSampler:
    def __init__(self, sampler) -> None:
        self.sampler = sampler

    def __call__(self, *args, **kwargs):
        return timed(self.sampler, "sample")(*args, **kwargs)


class _Backend:
    name = "torch"


class StandInModel(torch.nn.Module):
    """Costs `device_ms` per forward and returns fixed logits [S, 128256] for S sampled rows."""

    def __init__(self, max_rows: int, tokenizer_vocab: int, device_ms: float) -> None:
        super().__init__()
        self.backend = _Backend()
        self.weight = torch.nn.Parameter(torch.zeros(1))  # the engine reads the model's dtype here
        gen = torch.Generator().manual_seed(0)
        self.logits = torch.full((max_rows, VOCAB), float("-inf"))
        self.logits[:, :tokenizer_vocab] = torch.randn(max_rows, tokenizer_vocab, generator=gen)
        self.device_ms = device_ms
        self.vocab = VOCAB  # 1 while setting up: the unmeasured prefill steps sample for free

    def forward(self, input_ids, positions, kv_caches, meta):
        if self.device_ms:
            time.sleep(self.device_ms / 1000)
        return torch.zeros(input_ids.shape[0], 1)  # [T, hidden=1]

    def compute_logits(self, hidden):
        return self.logits[:hidden.shape[0], :self.vocab]  # [S, vocab]


def stand_in_config() -> ModelConfig:
    cfg = json.loads((CONFIGS / "llama-3-8b.json").read_text())
    # one layer, one KV head of width 1: the pool holds 200k+ blocks in a few MiB
    cfg.update(num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=1)
    return ModelConfig.from_dict(cfg)


def build(running: int, steps: int, tokenizer, device_ms: float, overlap: bool) -> Engine:
    mcfg = stand_in_config()
    # early finishers decode while the rest prefill (under 2048 tokens a step): room for that
    max_len = 2 * CONTEXT + steps
    num_blocks = CACHED_BLOCKS + running * -(-max_len // BLOCK) + 16
    args = EngineArgs(block_size=BLOCK, kv_context_len=num_blocks * BLOCK, max_model_len=max_len,
                      max_num_seqs=running, max_num_batched_tokens=2048, device="cpu",
                      async_scheduling=overlap)
    model = StandInModel(running, len(tokenizer), device_ms)
    core, plan, runner = ModelSetup.decide(args, mcfg).build_core(model)
    assert plan.num_blocks >= num_blocks, plan
    pool = core.scheduler.kv.pool
    # 200k cached prefixes from earlier requests, evictable, behind the empty blocks in LRU order
    held = pool.allocate(CACHED_BLOCKS)
    for i, block in enumerate(held):
        pool.register(block, hash_block(None, [i]))
    pool.free(held)
    assert pool.count_by_state()[1] == CACHED_BLOCKS
    return Engine(core, tokenizer, plan, "stand-in", mcfg.eos_token_ids, runner)


def measure(running: int, steps: int, device_ms: float, tokenizer, stage: str, overlap: str) -> dict:
    engine = build(running, steps, tokenizer, device_ms, overlap == "on")
    model = engine.runner.model
    vocab = len(tokenizer)
    staged: list = []  # outputs the stage thread produced
    if stage == "thread":
        engine.start_output_stage(staged.extend)
    params = SamplingParams(max_tokens=None, ignore_eos=True)  # the API default: temperature 1
    for i in range(running):
        prompt = [(i * 7919 + j * 31) % vocab for j in range(CONTEXT)]
        engine.add_request(f"r{i}", prompt, params)
    model.device_ms, model.vocab = 0, 1
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.core.scheduler.requests.values()):
        engine.step()  # prefill everyone at no device cost: the measured steps are pure decode
    model.device_ms, model.vocab = device_ms, VOCAB
    # timed from here on: the step running when the window opens is timed too (see phase_seconds)
    sched, runner = engine.core.scheduler, engine.runner
    sched.schedule = timed(sched.schedule, "schedule")
    sched.update = timed(sched.update, "update")
    runner.buffers.prepare = timed(runner.buffers.prepare, "prepare")
    runner.sampler = TimedSampler(runner.sampler)
    model.forward = timed(model.forward, "device")
    engine.outputs.process = timed(engine.outputs.process, "outputs")  # includes detok
    add = IncrementalDetokenizer.add
    IncrementalDetokenizer.add = timed(add, "detok")
    stats = timed(engine.stats, "stats")
    SPANS.clear()
    walls = []
    try:
        # one unmeasured decode step: overlapped, the last prefill is applied and a full decode
        # step is running when the measurement starts (the steady state)
        engine.step()
        if engine.stage is not None:
            assert engine.stage.drain(timeout=600)
            staged.clear()
        start = time.perf_counter()
        for _ in range(steps):
            t0 = time.perf_counter()
            outs = engine.step()
            stats()
            walls.append(time.perf_counter() - t0)
            assert len(outs) == (running if stage == "inline" else 0)
        end = time.perf_counter()
        if engine.stage is not None:
            assert engine.stage.drain(timeout=600)
            outs = staged
        assert len(outs) == running * (steps if stage == "thread" else 1), \
            "every sequence decodes every measured step"
    finally:
        IncrementalDetokenizer.add = add
        engine.stop_output_stage()
        if engine.core.executor is not None:
            # the step still queued runs to its end here, not beside the next configuration
            engine.core.executor.shutdown()
    ms = defaultdict(float, {k: v * 1000 / steps for k, v in
                             phase_seconds(start, end, whole=("detok", "outputs")).items()})
    wall = statistics.fmean(walls) * 1000
    row = {"running": running, "device_ms": device_ms, "stage": stage, "overlap": overlap,
           "schedule": ms["schedule"], "prepare": ms["prepare"], "sample": ms["sample"],
           "update": ms["update"], "detok": ms["detok"], "output": ms["outputs"] - ms["detok"],
           "stats": ms["stats"]}
    row["host"] = wall - ms["device"] - ms["sample"]
    row["wall"] = wall
    row["wall-sample"] = wall - ms["sample"]
    # the phases on the step thread; with the stage, detok and output run on its thread
    # (overlapped, schedule/update/outputs/stats run beside the device: "other" goes negative)
    on_step = ["schedule", "prepare", "update", "stats"] + (["detok", "output"] if stage == "inline" else [])
    row["other"] = row["host"] - sum(row[p] for p in on_step)
    row["wall_p99"] = sorted(walls)[min(len(walls) - 1, int(len(walls) * 0.99))] * 1000
    return row


def stats_cost(cached: int, calls: int = 2000) -> float:
    """engine.stats()'s block counting alone, in microseconds, with `cached` cached blocks."""
    from raypaged.core.block_pool import BlockPool
    pool = BlockPool(cached + 1024)
    held = pool.allocate(cached)
    for i, block in enumerate(held):
        pool.register(block, hash_block(None, [i]))
    pool.free(held)
    t0 = time.perf_counter()
    for _ in range(calls):
        pool.count_by_state()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--running", default="1,64,256")
    ap.add_argument("--device-ms", default="0,10", help="stand-in device time per forward, ms")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (the sampler's)")
    ap.add_argument("--stage", default="inline,thread",
                    help="where outputs are detokenized: inline (in the step), thread (the stage)")
    ap.add_argument("--overlap", default="off,on", help="overlapped scheduling (async_scheduling)")
    ap.add_argument("--name", default="host_overhead", help="results file name (before/after runs)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from raypaged.model.default_model import default_model_dir
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    rows = [measure(n, args.steps, float(d), tokenizer, stage, overlap)
            for d in args.device_ms.split(",") for n in map(int, args.running.split(","))
            for stage in args.stage.split(",") for overlap in args.overlap.split(",")]
    cols = ["running", "device_ms", "stage", "overlap", "schedule", "prepare", "sample", "update",
            "detok", "output", "stats", "other", "host", "wall", "wall-sample", "wall_p99"]
    print("ms per decode step (sample = device work, on the CPU here; host = wall - device - sample;"
          " stage=thread: detok and output ran on the output stage's thread, off the step)")
    print(table(rows, cols))
    stats_us = {n: stats_cost(n) for n in (0, CACHED_BLOCKS)}
    print(f"count_by_state: {stats_us[0]:.2f} us with 0 cached blocks, "
          f"{stats_us[CACHED_BLOCKS]:.2f} us with {CACHED_BLOCKS:,}")
    verdicts = []
    for n, limit in ((64, 1.0), (256, 3.0)):
        for r in rows:
            if r["running"] == n:
                verdicts.append(f"host <= {limit} ms at {n} seqs, device {r['device_ms']:g} ms, "
                                f"{r['stage']}, overlap {r['overlap']}: "
                                f"{r['host']:.2f} ms ({'met' if r['host'] <= limit else 'MISSED'})")
    for r in rows:
        if r["running"] == 256 and r["device_ms"] == 10:
            verdicts.append(f"wall <= 11 ms at 256 seqs with a 10 ms device step, {r['stage']}, "
                            f"overlap {r['overlap']}: {r['wall']:.2f} ms "
                            f"({'met' if r['wall'] <= 11 else 'MISSED'}; sampling alone is "
                            f"{r['sample']:.1f} ms on this CPU; wall less sampling "
                            f"{r['wall-sample']:.2f} ms: "
                            f"{'met' if r['wall-sample'] <= 11 else 'MISSED'})")
    print("\n".join(verdicts))
    payload = {"args": vars(args), "vocab": VOCAB, "context": CONTEXT, "cached_blocks": CACHED_BLOCKS,
               "rows": rows, "count_by_state_us": stats_us, "verdicts": verdicts}
    print(f"wrote {write(args.name, payload)}")
    plt = pyplot()
    if plt is None:
        return
    # host time the device path waited for, overlap off vs on, per configuration
    keys = sorted({(r["device_ms"], r["running"], r["stage"]) for r in rows})
    fig, ax = plt.subplots(figsize=(11, 4))
    width = 0.4
    for k, overlap in enumerate(("off", "on")):
        by = {(r["device_ms"], r["running"], r["stage"]): r["host"] for r in rows
              if r["overlap"] == overlap}
        xs = [i + (k - 0.5) * width for i in range(len(keys))]
        ax.bar(xs, [max(by.get(key, 0.0), 0.01) for key in keys], width, label=f"overlap {overlap}")
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels([f"{n} seqs, {d:g} ms\n{st}" for d, n, st in keys], fontsize=7)
    ax.set_yscale("log")
    ax.axhline(1.0, color="grey", lw=0.5, ls="--")
    ax.set_ylabel("host ms / step not hidden (log)")
    ax.set_title("host time per decode step the device path waits for (wall - device - sample)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(plot_path(args.name), dpi=80)
    print(f"wrote {plot_path(args.name)}")


if __name__ == "__main__":
    main()
