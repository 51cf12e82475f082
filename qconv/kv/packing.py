"""Byte-level record helpers: low-bit codes packed little-end-first, fp16 fields as raw bytes, fixed field layouts.

A record is one uint8 row; its layout is a list of (field, nbytes) in storage order, padded to 8 bytes so records
stay aligned when the runtime stores them back to back."""

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
class Layout:
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
