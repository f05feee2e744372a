"""Linear layers with weights reordered once into oneDNN's blocked layout (CPU, bf16).

An eager bf16 `F.linear` on a CPU goes through oneDNN with the weight in torch's plain [out, in]
layout, and oneDNN reorders it into its blocked layout on every call. For decode-sized inputs
(1-16 rows) that reorder costs about as much as the product itself. Reordering once at load
time (what inductor's freezing pass does) gives the same kernel the same bits:

    576 -> 3072, bf16, 1 thread:   1 row  113 us -> 59 us   16 rows  207 us -> 143 us
    (benchmarks/forward_step.py measures the whole forward)

Outputs are bit-identical to `F.linear` (the same oneDNN kernel runs; only the reorder moves).
fp32 linears run through MKL, not oneDNN, and are left alone, so fp32 tokens stay those of HF.
Switch: `packed_linears` in EngineArgs.
"""
from __future__ import annotations

import torch
from torch import nn


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    return (device.type == "cpu" and dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class PackedLinear(nn.Module):
    """nn.Linear's forward over a prepacked (opaque, read-only) weight; the plain weight is freed."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # a buffer, not a Parameter: it is an opaque oneDNN tensor, never loaded or trained
        self.register_buffer("packed_weight",
                             torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None),
                             persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in_features] -> [T, out_features]"""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear in `model` by a PackedLinear, in place; returns how many.
    Call after the weights are loaded."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)
