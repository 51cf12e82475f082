"""CPU decode streams every weight once per token, and oneDNN's prepacked (blocked) layout streams bf16 weights
faster than torch's plain bf16 GEMV, so bf16 Linears and the lm_head are repacked once at load. fp32 stays unpacked:
the plain MKL GEMV is as fast there (docs/BENCHMARKS.md)."""

from __future__ import annotations

import torch
from torch import nn


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN's bf16 linear path exists on this CPU (it needs AVX512-BW/VL/DQ or AVX-NE-CONVERT; an AVX2-only CPU
    refuses the reorder)."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


class PackedLinear(nn.Module):
    """nn.Linear with its weight held only in oneDNN's blocked layout (inference only)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> nn.Module:
    """Swap every nn.Linear (recursively) for a PackedLinear; returns the model."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, PackedLinear(child.weight, child.bias))
        else:
            pack_linears(child)
    return model
