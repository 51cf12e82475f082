"""compressed-tensors `pack-quantized` layout, read in plain torch: unsigned codes packed little-end-first into
int32 along the input dimension, stored with an offset of 2^(bits-1) for symmetric schemes."""

from __future__ import annotations

import torch


def unpack_int32(packed: torch.Tensor, bits: int, width: int) -> torch.Tensor:
    """[..., n] int32 -> [..., width] unsigned codes (int32)."""
    per = 32 // bits
    shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * bits
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.flatten(-2)[..., :width]


def dequantize_rows(
    packed: torch.Tensor,
    scale: torch.Tensor,
    bits: int,
    width: int,
    dtype: torch.dtype,
    zero_point: torch.Tensor | None = None,
) -> torch.Tensor:
    """Group (or channel: one scale column) dequantization of packed rows: (code - 2^(bits-1)) * scale when
    symmetric; with compressed-tensors' zero points (int32 words packed along the output dim, [rows*bits/32,
    groups]), (code - 2^(bits-1) - zero_point) * scale: the stored zero point is signed, the codes offset."""
    q = unpack_int32(packed, bits, width) - (1 << (bits - 1))
    if zero_point is not None:
        zp = unpack_int32(zero_point.t().contiguous(), bits, packed.shape[0]).t()  # [rows, groups], unsigned
        zp = zp - (1 << (bits - 1))
        q = q.view(*q.shape[:-1], zp.shape[-1], -1) - zp.unsqueeze(-1)
        q = q.view(*q.shape[:-2], width)
    q = q.to(dtype)
    groups = scale.shape[-1]
    q = q.view(*q.shape[:-1], groups, width // groups)
    return (q * scale.to(dtype).unsqueeze(-1)).view(*q.shape[:-2], width)
