"""Engine.from_args runs a CPU bf16 model's RMSNorms (with their residual adds), rotary embeddings
and KV writes by the C++ kernels (--cpu-layer-kernels), and they change no generated token; fp32
models keep torch's ops."""
from __future__ import annotations

from engine_prompts import PROMPTS
from raypaged.kernels import cpu_paged_decode


def greedy(model_dir, dtype: str, kernels: bool):
    from raypaged import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype=dtype, kv_memory_mb=64, max_model_len=256,
              cpu_layer_kernels=kernels)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)
    model = llm.engine.runner.model
    norms = [m for m in model.modules() if hasattr(m, "add_kernel")]
    using = (sum(m.kernel is cpu_paged_decode.rms_norm_bf16 for m in norms),
             sum(m.add_kernel is cpu_paged_decode.add_rms_norm_bf16 for m in norms),
             model.rotary.rotate is cpu_paged_decode.rotary_bf16,
             model.backend.store_kernel is cpu_paged_decode.store_kv)
    return [o.outputs[0].token_ids for o in outs], using


def test_bf16_engine_uses_the_kernels_and_generates_the_same_tokens(default_model_dir):
    plain, none = greedy(default_model_dir, "bfloat16", kernels=False)
    fused, used = greedy(default_model_dir, "bfloat16", kernels=True)
    assert none == (0, 0, False, False)
    assert used == (30 * 2 + 1, 30 * 2 + 1, True, True)  # two norms a layer and the final one
    assert fused == plain


def test_fp32_engine_keeps_torchs_ops(default_model_dir):
    _, used = greedy(default_model_dir, "float32", kernels=True)
    assert used == (0, 0, False, False)
