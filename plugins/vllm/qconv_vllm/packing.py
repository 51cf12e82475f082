"""Every bit layout qconv and the plugin read or write, in plain torch (defined here only; qconv imports it):
- KV records: low-bit codes packed little-end-first into uint8, fp16 fields as raw bytes, fixed field layouts
  padded to 8 bytes so records stay aligned when stored back to back;
- weights: int32 words holding 32/bits codes little-end-first (compressed-tensors `pack-quantized`, GPTQ and AWQ
  checkpoints), stored with an offset of 2^(bits-1) for symmetric schemes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP16_MAX = 65504.0


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes in [0, 2^bits) over the last dim -> bytes; code j of each byte sits at bit offset bits*j."""
    per = 8 // bits
    c = codes.to(torch.uint8).unflatten(-1, (codes.shape[-1] // per, per))
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    return (c << shifts).sum(-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of pack_bits: bytes -> uint8 codes, last dim grows by 8/bits."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).flatten(-2)


def fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    """Float tensor [..., n] -> its fp16 bytes [..., 2n] (saturated to the fp16 range instead of inf)."""
    return x.clamp(-FP16_MAX, FP16_MAX).to(torch.float16).contiguous().view(torch.uint8)


def bytes_fp16(b: torch.Tensor) -> torch.Tensor:
    """fp16 bytes [..., 2n] -> float32 [..., n]."""
    return b.contiguous().view(torch.float16).float()


@dataclass(frozen=True)
class RecordLayout:
    """Storage order and sizes of a record's fields; `size` includes the padding to `align` bytes."""

    fields: tuple[tuple[str, int], ...]
    align: int = 8

    @property
    def size(self) -> int:
        n = sum(b for _, b in self.fields)
        return -(-n // self.align) * self.align

    def join(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """Concatenate named uint8 fields [..., nbytes] into records [..., size] (zero padding at the end)."""
        out = [parts[name] for name, _ in self.fields]
        pad = self.size - sum(b for _, b in self.fields)
        if pad:
            out.append(out[0].new_zeros(*out[0].shape[:-1], pad))
        return torch.cat(out, -1)

    def split(self, rec: torch.Tensor) -> dict[str, torch.Tensor]:
        """Records [..., size] -> named uint8 fields."""
        parts, off = {}, 0
        for name, nbytes in self.fields:
            parts[name] = rec[..., off : off + nbytes]
            off += nbytes
        return parts


def unpack_int32(packed: torch.Tensor, bits: int, width: int | None = None) -> torch.Tensor:
    """[..., n] int32 words -> [..., width] unsigned codes (int32), code j of a word at bit offset bits*j
    (width: all n*32/bits codes when None)."""
    per = 32 // bits
    shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * bits
    codes = ((packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).flatten(-2)
    return codes if width is None else codes[..., :width]


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
