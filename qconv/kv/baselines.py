"""Baseline KV schemes for side-by-side numbers: bf16 (the reference cache), fp8 e4m3 with one scale per tensor,
int8 per token, q4_0-like int4 per token group of 32, and KIVI-style K-per-channel / V-per-token tiles."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from qconv.kv.base import KVScheme
from qconv.kv.kvarn import TileScheme
from qconv_vllm.packing import bytes_fp16, fp16_bytes, pack_bits, unpack_bits

FP8_MAX = 448.0  # largest finite float8_e4m3fn


@dataclass(frozen=True)
class BF16(KVScheme):
    """Unquantized cache in bf16 (what vLLM stores by default)."""

    def record_bytes(self, head_dim: int) -> int:
        return 2 * head_dim * 2

    def _encode(self, k, v):
        return torch.cat([k, v], -1).to(torch.bfloat16).view(torch.uint8).flatten(-2)

    def _decode(self, rec, head_dim):
        x = rec.contiguous().view(torch.bfloat16).float().unsqueeze(-2)
        return x[..., :head_dim], x[..., head_dim:]


@dataclass(frozen=True)
class FP8(KVScheme):
    """float8 e4m3 with one scale per tensor (K and V separately): amax/448 of the data it is calibrated on.
    The store fixes the scales on its first append (the prompt); later values beyond them saturate at +-448."""

    k_scale: float | None = None
    v_scale: float | None = None

    def record_bytes(self, head_dim: int) -> int:
        return 2 * head_dim

    def calibrated(self, k, v):
        if self.k_scale is not None:
            return self
        scale = [max(float(x.abs().amax()) / FP8_MAX, 1e-12) if x.numel() else 1.0 for x in (k, v)]
        return replace(self, k_scale=scale[0], v_scale=scale[1])

    def _encode(self, k, v):
        if self.k_scale is None:
            raise ValueError("FP8 needs calibrated scales: call scheme.calibrated(k, v) first")
        x = torch.cat([(k / self.k_scale).clamp(-FP8_MAX, FP8_MAX), (v / self.v_scale).clamp(-FP8_MAX, FP8_MAX)], -1)
        return x.to(torch.float8_e4m3fn).view(torch.uint8).flatten(-2)

    def _decode(self, rec, head_dim):
        x = rec.contiguous().view(torch.float8_e4m3fn).float().unsqueeze(-2)
        return x[..., :head_dim] * self.k_scale, x[..., head_dim:] * self.v_scale


@dataclass(frozen=True)
class IntGroup(KVScheme):
    """Symmetric integer codes per token, one fp16 scale per group of `group` channels (None: the whole row).
    bits=8: int8 per token (scale = amax/127). bits=4: q4_0-like (scale = signed max / -8, codes q+8 in [0, 15])."""

    bits: int = 8
    group: int | None = None

    def _groups(self, head_dim: int) -> int:
        return head_dim // self.group if self.group else 1

    def record_bytes(self, head_dim: int) -> int:
        return 2 * (head_dim * self.bits // 8 + 2 * self._groups(head_dim))

    def _enc_one(self, x):
        g = x.unflatten(-1, (self._groups(x.shape[-1]), -1))  # [N, 1, groups, gs]
        if self.bits == 8:
            scale = g.abs().amax(-1) / 127
            q = (g / scale.clamp_min(1e-30).unsqueeze(-1)).round().clamp(-127, 127) + 128
        else:
            m = g.gather(-1, g.abs().argmax(-1, keepdim=True)).squeeze(-1)
            scale = m / -8
            safe = torch.where(scale == 0, torch.ones_like(scale), scale)
            q = (g / safe.unsqueeze(-1)).round().clamp(-8, 7) + 8
        codes = pack_bits(q.to(torch.uint8).flatten(-3), self.bits)
        return torch.cat([codes, fp16_bytes(scale.flatten(-2))], -1)

    def _encode(self, k, v):
        return torch.cat([self._enc_one(k), self._enc_one(v)], -1)

    def _dec_one(self, rec, head_dim):
        nc = head_dim * self.bits // 8
        q = unpack_bits(rec[..., :nc], self.bits).float() - (128 if self.bits == 8 else 8)
        scale = bytes_fp16(rec[..., nc:])
        return (q.unflatten(-1, (scale.shape[-1], -1)) * scale.unsqueeze(-1)).flatten(-2).unsqueeze(-2)

    def _decode(self, rec, head_dim):
        half = rec.shape[-1] // 2
        return self._dec_one(rec[..., :half], head_dim), self._dec_one(rec[..., half:], head_dim)


def kivi(k_bits: int, v_bits: int, tile: int = 128) -> TileScheme:
    """KIVI-style: K per channel and V per token over the same tiles as KVarN, without rotation or normalization."""
    return TileScheme(
        name=f"kivi_k{k_bits}v{v_bits}_g{tile}", tile=tile, k_bits=k_bits, v_bits=v_bits, rotate=False, balance=False
    )
