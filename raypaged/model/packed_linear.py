"""Linear layers with weights reordered once into oneDNN's blocked layout (CPU, bf16 and fp32).

An eager bf16 `F.linear` on a CPU goes through oneDNN with the weight in torch's plain [out, in]
layout, and oneDNN reorders it into its blocked layout on every call; for decode-sized inputs
(1-16 rows) that reorder costs about as much as the product itself. Reordering once at load
time (what inductor's freezing pass does) runs the same kernel: bf16 outputs are bit-identical
to `F.linear`. An eager fp32 `F.linear` runs through MKL instead, slower than oneDNN's prepacked
fp32 kernel on this project's CPUs (benchmarks/forward_step.py); packed fp32 sums in another
order, so results move by a few fp32 ulps (~1e-6 relative) and the greedy tokens of the Hugging
Face equality tests (tests/engine/test_matches_hf.py, fp32) stay the same.
Switch: `packed_linears` in EngineArgs.
"""
from __future__ import annotations

import torch
from torch import nn


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


def pack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear in `model` by a PackedLinear, in place, and give a model with tied
    embeddings a packed copy of the embedding as its lm_head for compute_logits (more weight
    bytes, a faster decode step). Call after the weights are loaded; returns how many it packed."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child.weight, child.bias))
    if getattr(model, "lm_head", False) is None:  # tied: logits from embed_tokens.weight
        model.lm_head = PackedLinear(model.embed_tokens.weight)
        return len(targets) + 1
    return len(targets)
