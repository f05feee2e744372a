"""The Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2) over flattened tokens and a paged KV cache.

There is no batch dimension: a step's T tokens from all sequences are one [T, hidden] matrix, so
every linear layer is one GEMM for the whole batch. q/k/v are fused into one projection and
gate/up into another at load time (fewer, bigger GEMMs run faster, on CPU especially).

Per layer:  x -> RMSNorm -> qkv_proj -> rope(q, k) -> backend.write_kv(k, v)
              -> backend.attend(q) -> o_proj -> +x -> RMSNorm -> gate_up -> silu(gate)*up -> down -> +
Each residual add is done by the RMSNorm that follows it (`RMSNorm.add_norm`): the MLP's by the next
layer's input norm (or the final norm), so a C++ kernel can do both in one call.

The modules below hold the weights under Hugging Face's names; `LlamaModel.forward` runs every
layer in one loop over plain references to their parts (`LayerParts`), not through nested module
calls: on a CPU the frames and `nn.Module.__getattr__` lookups of ~200 module calls per step were
~4% of a batch-1 decode step (`benchmarks/layer_loop.py`).
"""
from __future__ import annotations

import math
from typing import Callable, Iterable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from raypaged.model.attention.base import AttentionBackend, AttentionMetadata, LayerKVCache
from raypaged.model.model_config import ModelConfig, RopeScaling


# Rotary position embeddings (RoPE), in the "rotate half" layout Hugging Face checkpoints use.
#
# A head vector x of size D is split into halves x1 = x[:D/2], x2 = x[D/2:]; pair i (x1[i], x2[i])
# is rotated by angle position * inv_freq[i]:
#     out = [x1*cos - x2*sin, x2*cos + x1*sin]
# cos/sin are computed once per forward from the step's positions (T x D/2 values, cheap) and
# shared by every layer, so there is no table sized by max_position_embeddings to keep around.


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """[head_dim / 2] float32 angular frequencies, computed exactly as transformers does
    (same op order, so fp32 results match bit for bit)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)  # [D/2]
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: wavelengths longer than the original context / low_freq_factor are slowed by
    # `factor`; shorter than context / high_freq_factor are kept; in between, blend smoothly.
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Holds inv_freq (a plain tensor, not a module buffer: the model is built on the meta device
    and materialised with to_empty(), which would leave a buffer uninitialised)."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None) -> None:
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling)  # [D/2] float32
        self.rotate = apply_rotary  # or a kernel giving the same result (use_layer_kernels)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> cos, sin each [T, 1, D/2] in `dtype` (broadcast over heads)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)  # moved once, then reused
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2] float32
        return angles.cos().to(dtype)[:, None, :], angles.sin().to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, N, D] (may be a strided view), cos/sin [T, 1, D/2] -> rotated [T, N, D], contiguous."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]  # [T, N, D/2] each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.kernel = None  # (x, weight, eps) -> the same result in one call (use_layer_kernels)
        self.add_kernel = None  # (x, delta, weight, eps) -> add_norm's result in one call

    def add_norm(self, x: torch.Tensor,
                 delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, RMSNorm(x + delta)): the residual add before the norm; delta None: (x,
        RMSNorm(x))."""
        if delta is None:
            return x, self(x)
        if self.add_kernel is not None:
            return self.add_kernel(x, delta, self.weight, self.eps)
        x = x + delta
        return x, self(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x, self.weight, self.eps)
        # Normalise in fp32 and scale in the model dtype, as transformers does.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    """The attention's weights: q/k/v fused in one projection, and the output projection."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        qkv_out = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, qkv_out, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size,
                                bias=config.o_proj_bias)


class MLP(nn.Module):
    """The MLP's weights: gate/up fused in one projection, and the down projection."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)


class LayerParts(NamedTuple):
    """A decoder layer's steps as bound methods, what LlamaModel.forward's loop calls."""
    input_norm: Callable   # (x, delta) -> (x + delta, RMSNorm(x + delta)): RMSNorm.add_norm
    qkv_proj: Callable
    o_proj: Callable
    post_attention_norm: Callable
    gate_up_proj: Callable
    down_proj: Callable


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def parts(self) -> LayerParts:
        a, m = self.self_attn, self.mlp
        return LayerParts(self.input_layernorm.add_norm, a.qkv_proj.forward, a.o_proj.forward,
                          self.post_attention_layernorm.add_norm, m.gate_up_proj.forward,
                          m.down_proj.forward)


class LlamaModel(nn.Module):
    """Build with real weights through `raypaged.model.loader.load_model`; constructing it directly
    gives randomly initialised parameters (or, under `torch.device("meta")`, none at all)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.backend = backend
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Tied models reuse embed_tokens.weight in compute_logits instead of sharing a Parameter
        # object, which module.to_empty() would silently untie.
        self.lm_head = (None if config.tie_word_embeddings
                        else nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.layer_parts: list[LayerParts] | None = None  # built on first use; pack_linears clears

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[LayerKVCache], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] int64 -> final-normed hidden states [T, hidden]."""
        c, backend, rotate = self.config, self.backend, self.rotary.rotate
        H, Hkv, D, inter = c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
        scale = D ** -0.5
        if self.layer_parts is None:
            self.layer_parts = [layer.parts() for layer in self.layers]
        x, delta = self.embed_tokens(input_ids), None            # [T, hidden]
        T = x.shape[0]
        cos, sin = self.rotary.cos_sin(positions, x.dtype)       # [T, 1, D/2] each
        for (input_norm, qkv_proj, o_proj, post_attention_norm, gate_up_proj,
             down_proj), cache in zip(self.layer_parts, kv_caches, strict=True):
            x, h = input_norm(x, delta)   # the layer's input x (+ the last MLP's output), normed
            qkv = qkv_proj(h)                                    # [T, (H + 2*Hkv) * D]
            # q and k sit side by side in qkv: rotate them in one call
            qk = rotate(qkv[:, :(H + Hkv) * D].view(T, H + Hkv, D), cos, sin)  # [T, H+Hkv, D]
            backend.write_kv(qk[:, H:], qkv[:, (H + Hkv) * D:].view(T, Hkv, D), cache, meta)
            o = backend.attend(qk[:, :H], cache, meta, scale)   # [T, H, D]
            x, h = post_attention_norm(x, o_proj(o.reshape(T, H * D)))  # + attention, normed
            gate, up = gate_up_proj(h).split(inter, dim=-1)     # [T, I] each
            delta = down_proj(F.silu(gate) * up)  # [T, hidden], added by the next norm
        return self.norm.add_norm(x, delta)[1]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] (only the rows that sample) -> logits [N, vocab] float32."""
        if self.lm_head is None:
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()  # an nn.Linear or, packed, a PackedLinear

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into our (fused) parameters; every parameter must be
        written exactly once, and an unknown tensor name is an error, not a silent skip."""
        slots = _checkpoint_slots(self)
        written: set[tuple[str, str | None]] = set()
        for hf_name, tensor in weights:
            target = _our_name(hf_name, self.config)
            if target is None:
                continue
            if target not in slots:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in "
                                 f"{self.config.architecture} as configured")
            if target in written:
                raise ValueError(f"checkpoint tensor {hf_name!r} appears twice")
            dest = slots[target]
            if dest.shape != tensor.shape:
                raise ValueError(f"{hf_name}: checkpoint shape {tuple(tensor.shape)} != expected "
                                 f"{tuple(dest.shape)}")
            dest.copy_(tensor)
            written.add(target)
        missing = sorted(f"{n} ({p})" if p else n for n, p in slots.keys() - written)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")


# Our fused parameter -> the Hugging Face projections stacked in it, in order along dim 0.
_FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_PART_TO_FUSED = {part: fused for fused, parts in _FUSED_PARTS.items() for part in parts}


def _our_name(hf_name: str, config: ModelConfig) -> tuple[str, str | None] | None:
    """'model.layers.3.self_attn.k_proj.bias' -> ('layers.3.self_attn.qkv_proj.bias', 'k_proj');
    None for tensors we deliberately ignore."""
    if hf_name.endswith("rotary_emb.inv_freq"):
        return None  # old checkpoints store it; we compute it
    if hf_name == "lm_head.weight":
        # Some tied checkpoints still carry a copy of the embedding; it is the same matrix.
        return None if config.tie_word_embeddings else ("lm_head.weight", None)
    name = hf_name.removeprefix("model.")
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _PART_TO_FUSED:
        part = parts[-2]
        parts[-2] = _PART_TO_FUSED[part]
        return ".".join(parts), part
    return name, None


def _checkpoint_slots(model: LlamaModel) -> dict[tuple[str, str | None], torch.Tensor]:
    """Every (parameter, part) load_weights must fill -> the rows it fills: a fused parameter's
    parts (q/k/v rows of qkv_proj, gate/up rows of gate_up_proj), or a whole plain parameter."""
    c = model.config
    q, kv, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    rows = {"q_proj": (0, q), "k_proj": (q, kv), "v_proj": (q + kv, kv),
            "gate_proj": (0, inter), "up_proj": (inter, inter)}
    slots = {}
    for name, param in model.named_parameters():
        module = name.split(".")[-2] if "." in name else ""
        for part in _FUSED_PARTS.get(module, (None,)):
            start, n = rows.get(part, (0, len(param)))
            slots[name, part] = param.data[start:start + n]
    return slots


# Linear layers with weights reordered once into oneDNN's blocked layout (CPU, bf16 and fp32).
#
# An eager bf16 `F.linear` on a CPU goes through oneDNN with the weight in torch's plain [out, in]
# layout, and oneDNN reorders it into its blocked layout on every call; for decode-sized inputs
# (1-16 rows) that reorder costs about as much as the product itself. Reordering once at load
# time (what inductor's freezing pass does) runs the same kernel: bf16 outputs are bit-identical
# to `F.linear`. An eager fp32 `F.linear` runs through MKL instead, slower than oneDNN's prepacked
# fp32 kernel on this project's CPUs (benchmarks/forward_step.py); packed fp32 sums in another
# order, so results move by a few fp32 ulps (~1e-6 relative) and the greedy tokens of the Hugging
# Face equality tests (tests/engine/test_matches_hf.py, fp32) stay the same.
# Switch: `packed_linears` in EngineArgs.


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    return (device.type == "cpu" and dtype in (torch.bfloat16, torch.float32)
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class PackedLinear(nn.Module):
    """nn.Linear's forward over a prepacked (opaque, read-only) weight; the plain weight is freed."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """weight [out_features, in_features], plain; bias [out_features] or None."""
        super().__init__()
        # a buffer, not a Parameter: it is an opaque oneDNN tensor, never loaded or trained
        self.register_buffer("packed_weight",
                             torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None),
                             persistent=False)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in_features] -> [T, out_features]"""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def use_layer_kernels(model: LlamaModel, rms_norm, add_rms_norm, rotary) -> None:
    """Run every RMSNorm (alone and after its residual add) and rotary embedding of `model` by
    these kernels (the C++ ones of raypaged.kernels.cpu_paged_decode on a bf16 CPU model: same
    results, one call each); (None, None, apply_rotary): torch's ops."""
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.kernel, module.add_kernel = rms_norm, add_rms_norm
    model.rotary.rotate = rotary


def pack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear in `model` by a PackedLinear, in place, and give a model with tied
    embeddings a packed copy of the embedding as its lm_head for compute_logits (more weight
    bytes, a faster decode step). Call after the weights are loaded; returns how many it packed."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child.weight, child.bias))
    if isinstance(model, LlamaModel):
        model.layer_parts = None  # they call the linears just replaced
    if getattr(model, "lm_head", False) is None:  # tied: logits from embed_tokens.weight
        model.lm_head = PackedLinear(model.embed_tokens.weight)
        return len(targets) + 1
    return len(targets)
