"""Run a qconv artifact's int4 Linears through torch's CPU int4 kernel and look its int8 embedding up row by row,
instead of holding them dequantized: batch-1 decode streams every weight once per token, and int4 is a quarter of
bf16's bytes. The kernel's cost grows with rows, so steps with more rows than `max_rows` (prefill, verification,
batched decode) use a dense packed copy of the same weights (thresholds: docs/BENCHMARKS.md). The int8 lm_head stays
dense: torch's int8 kernel is per-channel only.

Exactness: compressed-tensors stores int4 as q in [-8, 7] (and a zero point zp in [-8, 7] per group when asymmetric:
w = (q - zp) * scale); torch's kernel computes (u - 8) * scale + zero with u in [0, 15], so u = q + 8 and zero = 0
give q * scale in fp32, as the dequantized path does. With zero points, zero = -zp * scale rounded to bf16 (the
kernel's zero type): each weight is off by at most |zp * scale| / 512, under the dense bf16 path's own rounding of
(q - zp) * scale."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from qconv.calibrate.sensitivity import turned

INT4_MAX_ROWS = 2  # rows per call up to which the int4 kernel is at least as fast as the dense packed GEMM ...
INT4_MAX_ROWS_LARGE = 4  # ... and for matrices of LARGE_WEIGHTS or more (SmolLM2: gate/up, down; not q/k/v, o)
LARGE_WEIGHTS = 768 * 1024
INT4_GROUPS = (32, 64, 128, 256)  # group sizes torch's CPU int4 kernel is used with here


@dataclass
class IntWeight:
    """Integer weight of one Linear/Embedding: w[n, k] = (q[n, k] - zero[n, k // group]) * scale[n, k // group],
    zero None when symmetric."""

    bits: int
    q: torch.Tensor  # int8 [N, K], signed
    scale: torch.Tensor  # [N, K // group]
    zero: torch.Tensor | None = None  # int8 [N, K // group], compressed-tensors' zero points
    rotation: torch.Tensor | None = None  # [b, b]: the weight computes from x·V, V block-diagonal of this block

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]

    @staticmethod
    def cat(parts: list[IntWeight]) -> IntWeight | None:
        """Concatenate along the output dim (fused q/k/v, gate/up); None when the parts' formats differ."""
        if len({(p.bits, p.group, p.scale.dtype, p.zero is None) for p in parts}) != 1:
            return None
        rot = parts[0].rotation
        if any(
            (p.rotation is None) != (rot is None) or (rot is not None and not torch.equal(p.rotation, rot))
            for p in parts
        ):
            return None  # vLLM gives a fused layer one input rotation; parts rotated apart stay apart
        zero = None if parts[0].zero is None else torch.cat([p.zero for p in parts])  # type: ignore[misc]
        q, scale = torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts])
        return IntWeight(parts[0].bits, q, scale, zero, rot)


def int_kernels_available(device: torch.device, dtype: torch.dtype) -> bool:
    """The CPU int4 kernel exists and the model computes in bf16 (with fp32 activations it is ~50x slower)."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
        and hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")
    )


def int4_supported(w: IntWeight, in_features: int) -> bool:
    """The kernel's layout wants N % 16 == 0; bf16 must hold the scales exactly (else the kernel's weights would
    differ from the checkpoint's)."""
    return (
        w.bits == 4
        and w.group in INT4_GROUPS
        and in_features % w.group == 0
        and w.q.shape[1] == in_features
        and w.q.shape[0] % 16 == 0
        and torch.equal(w.scale.to(torch.bfloat16).float(), w.scale.float())
    )


class Int4Linear(nn.Module):
    """A Linear whose weight lives in torch's CPU int4 layout; steps with many rows go to `dense` (same weights)."""

    def __init__(self, w: IntWeight, dense: nn.Module):
        super().__init__()
        self.out_features, self.in_features = w.q.shape
        self.group = w.group
        self.max_rows = INT4_MAX_ROWS_LARGE if w.q.numel() >= LARGE_WEIGHTS else INT4_MAX_ROWS
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.q.to(torch.int32) + 8, 1)
        s = w.scale.to(torch.bfloat16).t()  # [K // group, N]
        z = torch.zeros_like(s) if w.zero is None else (-w.zero.float() * w.scale.float()).to(torch.bfloat16).t()
        self.scales_zeros = torch.stack([s, z], dim=-1).contiguous()
        self.dense = dense  # its weight has the input rotation folded in (qconv.convert.rotation)
        self.bias = getattr(dense, "bias", None)
        self.rotation = None if w.rotation is None else w.rotation.to(torch.bfloat16)

    def int4_mm(self, x2d: torch.Tensor) -> torch.Tensor:
        """x2d [M, K] bf16 @ W.T through the int4 kernel, any M (no bias)."""
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x2d, self.packed, self.group, self.scales_zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows > self.max_rows or x.dtype != torch.bfloat16:
            return self.dense(x)
        x2d = x.reshape(rows, self.in_features)
        if self.rotation is not None:
            x2d = turned(x2d, self.rotation)  # x·V, the input the stored weight computes from
        y = self.int4_mm(x2d).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Int8Embedding(nn.Module):
    """Embedding lookup from the int8 table: gather the rows, then scale them (no dense copy of the table)."""

    def __init__(self, w: IntWeight, dtype: torch.dtype):
        super().__init__()
        self.q, self.scale, self.group = w.q, w.scale, w.group
        # Transformer.dtype / .device read embed_tokens.weight; this empty tensor answers them.
        self.register_buffer("weight", torch.empty(0, dtype=dtype), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = self.q[tokens]
        w = rows.view(*rows.shape[:-1], -1, self.group).float() * self.scale[tokens].float()[..., None]
        return w.view(rows.shape).to(self.weight.dtype)


def attach_int_kernels(model: nn.Module, weights: dict[str, IntWeight]) -> int:
    """Swap the modules named in `weights` (our module names) for their int versions where supported; returns how
    many were swapped. Linears keep their dense module for many-row steps; the embedding is replaced outright unless
    the lm_head is tied to it (the tied head needs the dense table)."""
    swapped = 0
    for name, w in weights.items():
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        mod = getattr(owner, leaf, None)
        if name == "embed_tokens" and isinstance(mod, nn.Embedding):
            if w.bits == 8 and w.zero is None and getattr(model, "lm_head", None) is not None:
                setattr(owner, leaf, Int8Embedding(w, mod.weight.dtype))
                swapped += 1
        elif mod is not None and hasattr(mod, "in_features") and int4_supported(w, mod.in_features):
            setattr(owner, leaf, Int4Linear(w, mod))
            swapped += 1
    return swapped
