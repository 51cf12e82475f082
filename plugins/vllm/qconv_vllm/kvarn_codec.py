"""KVarN tile codec in plain torch: the one definition of its arithmetic, used by qconv's own KV cache
(qconv.kv.kvarn), the plugin's CPU path, and as the reference its Triton kernels are checked against.

The plugin runs in vLLM's own environment, where qconv is not installed, so the codec lives here and qconv imports it.
Per tile of G tokens of one KV head: rotate rows by H/sqrt(D); K as channels x tokens, V as tokens x channels;
balance rows and columns by log-scales, keeping the least imbalanced iterate; round each row asymmetrically;
fold the balance into fp16 row/column scales; pack codes little-end-first. Record fields, in storage order:
k_codes, k_a, k_z, k_r, v_codes, v_c, v_a, v_z, then zero padding to 8 bytes."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch

from qconv_vllm.packing import FP16_MAX as FP16_MAX
from qconv_vllm.packing import RecordLayout, bytes_fp16, fp16_bytes, pack_bits, unpack_bits

PRESET = re.compile(r"^kvarn_k(?P<k>[248])v(?P<v>[248])_g(?P<g>64|128|256)$")
ITERS = 8
STD_CLAMP, LOG_CLAMP = (1e-3, 1e3), (-0.3, 10.0)
# An iterate replaces the best so far only if it lowers the imbalance by 0.01%: once the tile is balanced the
# imbalance sits at 2 within float noise, and a strict `<` would pick among near-equal iterates by summation order,
# so this codec and its Triton port (kvarn_triton.py) or a GPU would write different scales.
MIN_GAIN = 1 - 1e-4
# The balance runs in float64 and hands float32 log-scales on; every exp of them is taken in float64 and rounded to
# float32. A sum's order (BLAS, a Triton tree, numpy) then moves the float32 results only when a value lies within
# ~1e-15 of a float32 rounding boundary, and libraries' exp no longer differ by an ulp: the torch codec and the
# Triton kernels write the same bytes.
BALANCE_DTYPE = torch.float64


def exp32(x: torch.Tensor) -> torch.Tensor:
    """e^x of float32 log-scales, correctly rounded to float32 wherever it is computed (see BALANCE_DTYPE)."""
    return torch.exp(x.to(BALANCE_DTYPE)).float()


@functools.lru_cache(maxsize=8)
def sylvester(d: int) -> torch.Tensor:
    """H_d / sqrt(d) in float64 by the Sylvester recursion H_2n = [[H, H], [H, -H]] (d a power of two)."""
    if d <= 0 or d & (d - 1):
        raise ValueError(f"KVarN rotates by a Hadamard matrix: head_dim must be a power of two, got {d}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / d**0.5


def hadamard(d: int, device: torch.device | str | None = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """H_d / sqrt(d): symmetric and its own inverse, so it rotates and un-rotates."""
    return sylvester(d).to(dtype=dtype, device=device)


@dataclass(frozen=True)
class Codec:
    """One preset at one head_dim: the record's field sizes and the encode/decode of whole tiles."""

    k_bits: int
    v_bits: int
    tile: int
    head_dim: int

    @classmethod
    def from_dtype(cls, name: str, head_dim: int) -> Codec:
        m = PRESET.match(name)
        if m is None:
            raise ValueError(f"{name!r} is not a KVarN cache dtype (kvarn_k<bits>v<bits>_g<tile>)")
        return cls(int(m["k"]), int(m["v"]), int(m["g"]), head_dim)

    @property
    def fields(self) -> tuple[tuple[str, int], ...]:
        d, g = self.head_dim, self.tile
        return (
            ("k_codes", d * g * self.k_bits // 8),
            ("k_a", 2 * d),
            ("k_z", 2 * d),
            ("k_r", 2 * g),
            ("v_codes", g * d * self.v_bits // 8),
            ("v_c", 2 * d),
            ("v_a", 2 * g),
            ("v_z", 2 * g),
        )

    @property
    def layout(self) -> RecordLayout:
        return RecordLayout(self.fields)

    @property
    def record_bytes(self) -> int:
        """Bytes of one tile of one head, K and V together, padded to 8 (never to a power of two)."""
        return self.layout.size

    @property
    def bytes_per_token(self) -> int:
        """Per token and head; exact for the presets (a tile's per-channel fields divide evenly over its tokens)."""
        if self.record_bytes % self.tile:
            raise ValueError(
                f"a {self.tile}-token tile at head_dim {self.head_dim} does not split into whole bytes "
                "per token; use a tile size of at most 2 x head_dim"
            )
        return self.record_bytes // self.tile

    # --- encode -----------------------------------------------------------------------------------------------
    def encode(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """k, v [N, G, D] (the fp16 values, any float dtype) -> uint8 records [N, record_bytes]."""
        h = hadamard(self.head_dim, k.device)
        kr, vr = k.float() @ h, v.float() @ h
        parts = dict(zip(("k_codes", "k_a", "k_z", "k_r"), encode_side(kr.transpose(1, 2), self.k_bits)))
        v_codes, v_a, v_z, v_c = encode_side(vr, self.v_bits)
        parts.update(v_codes=v_codes, v_a=v_a, v_z=v_z, v_c=v_c)
        return self.layout.join(parts)

    # --- decode -----------------------------------------------------------------------------------------------
    def decode_rotated(self, rec: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """records [..., record_bytes] -> (k, v) [..., G, D] float32, still in the rotated domain."""
        p, g, d = self.layout.split(rec), self.tile, self.head_dim
        kq = unpack_bits(p["k_codes"], self.k_bits).unflatten(-1, (d, g)).float()
        k = (kq * bytes_fp16(p["k_a"]).unsqueeze(-1) + bytes_fp16(p["k_z"]).unsqueeze(-1)) * bytes_fp16(
            p["k_r"]
        ).unsqueeze(-2)
        vq = unpack_bits(p["v_codes"], self.v_bits).unflatten(-1, (g, d)).float()
        v = (vq * bytes_fp16(p["v_a"]).unsqueeze(-1) + bytes_fp16(p["v_z"]).unsqueeze(-1)) * bytes_fp16(
            p["v_c"]
        ).unsqueeze(-2)
        return k.transpose(-1, -2), v

    def decode(self, rec: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """records -> (k, v) [..., G, D] float32 in the model's own (un-rotated) domain."""
        k, v = self.decode_rotated(rec)
        h = hadamard(self.head_dim, rec.device)
        return k @ h, v @ h


def _weighted_std(x: torch.Tensor, x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """std over the rows of x [..., n, m] with row i scaled by w_i (w: [..., n]) -> [..., m], without building the
    scaled tile: vector-matrix products with x and x^2 (precomputed), cheaper than torch.std's Welford pass; the
    E[x^2] - E[x]^2 cancellation is harmless here (float64, 64-256 values per row)."""
    n = x.shape[-2]
    m = (w.unsqueeze(-2) @ x).squeeze(-2) / n
    s = ((w * w).unsqueeze(-2) @ x2).squeeze(-2) / n
    return (s - m * m).clamp_min_(0).sqrt_()


def _imbalance(col: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    return col.amax(-1) / col.amin(-1) + row.amax(-1) / row.amin(-1)


def balance(x: torch.Tensor, iters: int = ITERS) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-scales (u per column, v per row) so that x / (e^v e^u^T) has even row and column spreads.

    Alternates column and row std normalization (stds clamped to STD_CLAMP, log-scales to LOG_CLAMP). The
    iteration need not converge under the clamps, so the (u, v) with the lowest imbalance max/min(col std) +
    max/min(row std) seen so far (by at least 0.01%, MIN_GAIN) is returned, starting from the unscaled tile
    (returning the last iterate instead is a known accuracy bug). x: [..., R, C] float32; computed in float64,
    returned as float32."""
    lo, hi = STD_CLAMP
    x = x.to(BALANCE_DTYPE)
    xt = x.transpose(-1, -2).contiguous()  # row stats as vector @ matrix too (far faster than matrix @ vector)
    x2, xt2 = x * x, xt * xt
    u = x.new_zeros(*x.shape[:-2], x.shape[-1])
    v = x.new_zeros(*x.shape[:-1])
    col = _weighted_std(x, x2, torch.ones_like(v)).clamp_(lo, hi)
    row = _weighted_std(xt, xt2, torch.ones_like(u)).clamp_(lo, hi)
    best_u, best_v, best_i = u, v, _imbalance(col, row)
    for _ in range(iters):
        u = (u + col.log()).clamp_(*LOG_CLAMP)
        row_raw = _weighted_std(xt, xt2, torch.exp(-u))  # row std before dividing by e^v
        v = (v + (row_raw * torch.exp(-v)).clamp_(lo, hi).log()).clamp_(*LOG_CLAMP)
        row = (row_raw * torch.exp(-v)).clamp_(lo, hi)
        col = (_weighted_std(x, x2, torch.exp(-v)) * torch.exp(-u)).clamp_(lo, hi)
        imb = _imbalance(col, row)
        better = imb < best_i * MIN_GAIN
        best_i = torch.where(better, imb, best_i)
        best_u = torch.where(better.unsqueeze(-1), u, best_u)
        best_v = torch.where(better.unsqueeze(-1), v, best_v)
    return best_u.float(), best_v.float()


def rtn_rows(y: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric round-to-nearest per row: (codes uint8, step, row min)."""
    lo, hi = torch.aminmax(y, dim=-1)
    step = ((hi - lo) / (2**bits - 1)).clamp_min(1e-10)
    q = ((y - lo.unsqueeze(-1)) / step.unsqueeze(-1)).round_().clamp_(0, 2**bits - 1)
    return q.to(torch.uint8), step, lo


def encode_side(
    x: torch.Tensor, bits: int, balanced: bool = True, iters: int = ITERS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One side of a tile, x [..., R, C] float32 -> (packed codes, row step, row zero, column scale) as bytes; the
    balance folded into the fp16 row and column scales (`balanced=False`: plain per-row rounding, no column scale)."""
    if balanced:
        u, v = balance(x, iters)
        y = x * exp32(-v).unsqueeze(-1) * exp32(-u).unsqueeze(-2)
    else:
        u, v, y = None, None, x
    q, step, lo = rtn_rows(y, bits)
    ev = exp32(v) if v is not None else 1.0
    col = fp16_bytes(exp32(u)) if u is not None else None
    return pack_bits(q.flatten(-2), bits), fp16_bytes(step * ev), fp16_bytes(lo * ev), col
