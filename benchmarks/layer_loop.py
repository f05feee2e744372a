"""LlamaModel.forward's one loop over each layer's parts against the nested module calls it
replaced (each layer, its attention, its MLP and its four linears called as nn.Modules, as the
model ran before), offline, in one process: the same bf16 engine switched between the two
between runs, interleaved --repeats times (benchmarks/decode_ab.py measures and checks tokens).

    python benchmarks/layer_loop.py [--batches 1,4,16] [--num-threads 1,2] [--repeats 5]
        [--input-len 256] [--output-len 64] [--name layer_loop]   # table, JSON, PNG
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import decode_ab  # noqa: E402


class NestedAttention(nn.Module):
    """The attention as a module of its own, over the model's own projections."""

    def __init__(self, attn: nn.Module, config, rotary) -> None:
        super().__init__()
        self.qkv_proj, self.o_proj, self.rotary = attn.qkv_proj, attn.o_proj, rotary
        self.num_heads, self.num_kv_heads, self.head_dim = (config.num_heads, config.num_kv_heads,
                                                            config.head_dim)
        self.scale = config.head_dim ** -0.5

    def forward(self, x, cos, sin, backend, cache, meta):
        T = x.shape[0]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        qk = self.rotary.rotate(qkv[:, :(H + Hkv) * D].view(T, H + Hkv, D), cos, sin)
        q, k = qk[:, :H], qk[:, H:]
        v = qkv[:, (H + Hkv) * D:].view(T, Hkv, D)
        backend.write_kv(k, v, cache, meta)
        o = backend.attend(q, cache, meta, self.scale)
        return self.o_proj(o.reshape(T, H * D))


class NestedMLP(nn.Module):
    def __init__(self, mlp: nn.Module, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj = mlp.gate_up_proj, mlp.down_proj
        self.intermediate_size = intermediate_size

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class NestedLayer(nn.Module):
    def __init__(self, layer: nn.Module, config, rotary) -> None:
        super().__init__()
        self.input_layernorm = layer.input_layernorm
        self.self_attn = NestedAttention(layer.self_attn, config, rotary)
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.mlp = NestedMLP(layer.mlp, config.intermediate_size)

    def forward(self, x, delta, cos, sin, backend, cache, meta):
        x, h = self.input_layernorm.add_norm(x, delta)
        attn = self.self_attn(h, cos, sin, backend, cache, meta)
        x, h = self.post_attention_layernorm.add_norm(x, attn)
        return x, self.mlp(h)


def nested_forward(model):
    """A forward for `model` through NestedLayers (built over its modules as they are now)."""
    layers = nn.ModuleList(NestedLayer(layer, model.config, model.rotary) for layer in model.layers)

    @torch.inference_mode()
    def forward(input_ids, positions, kv_caches, meta):
        x, delta = model.embed_tokens(input_ids), None
        cos, sin = model.rotary.cos_sin(positions, x.dtype)
        for layer, cache in zip(layers, kv_caches, strict=True):
            x, delta = layer(x, delta, cos, sin, model.backend, cache, meta)
        return model.norm.add_norm(x, delta)[1]
    return forward


def measure(threads: int, batches: list[int], repeats: int, input_len: int,
            output_len: int) -> list[dict]:
    from raypaged import LLM

    llm = LLM(dtype="bfloat16", enable_prefix_caching=False, num_threads=threads)
    model = llm.engine.runner.model
    nested = nested_forward(model)

    def use_loop() -> None:
        model.__dict__.pop("forward", None)  # the class's forward: the one loop

    def use_modules() -> None:
        model.forward = nested  # nn.Module.__call__ calls the instance's forward

    rows = decode_ab.interleaved(llm, {"loop": use_loop, "modules": use_modules}, batches,
                                 repeats, input_len, output_len)
    return [{"threads": threads, **row,
             "loop_over_modules": row["loop_ms_per_step"] / row["modules_ms_per_step"]}
            for row in rows]


if __name__ == "__main__":
    decode_ab.main(__doc__, "layer_loop", measure,
                   [("modules_ms_per_step", "nested module calls"),
                    ("loop_ms_per_step", "one loop over layer parts")],
                   "bf16 decode step: layer loop vs nested modules (lower is better)")
