"""CPU decode is bound by streaming the weights once per token. For bf16, oneDNN's prepacked (blocked) weight layout
streams them markedly faster than torch's plain bf16 GEMV (measured on this CPU for SmolLM2's shapes, batch 1:
1.3-1.5x per matmul), so bf16 Linears and the lm_head are repacked once at load. For fp32 the plain MKL GEMV was
as fast or faster for every shape we measured, so fp32 stays unpacked."""

from __future__ import annotations

import torch
from torch import nn

def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


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

