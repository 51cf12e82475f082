"""KVarN tile codec in plain torch: the plugin's CPU path and the reference its Triton kernels are checked against.

The plugin runs in vLLM's own environment, where qconv is not installed, so it carries its own codec; the record it
writes is byte-for-byte the one `qconv.kv.kvarn` writes (tests/test_kvarn_vllm_codec.py holds the two together).
Per tile of G tokens of one KV head: rotate rows by H/sqrt(D); K as channels x tokens, V as tokens x channels;
balance rows and columns by log-scales, keeping the least imbalanced iterate; round each row asymmetrically;
fold the balance into fp16 row/column scales; pack codes little-end-first. Record fields, in storage order:
k_codes, k_a, k_z, k_r, v_codes, v_c, v_a, v_z, then zero padding to 8 bytes."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch

PRESET = re.compile(r"^kvarn_k(?P<k>[248])v(?P<v>[248])_g(?P<g>64|128|256)$")
ITERS = 8
STD_CLAMP, LOG_CLAMP = (1e-3, 1e3), (-0.3, 10.0)
FP16_MAX = 65504.0
MIN_GAIN = 1 - 1e-4  # qconv.kv.kvarn.MIN_GAIN: a new best iterate must lower the imbalance by 0.01%
BALANCE_DTYPE = torch.float64  # qconv.kv.kvarn.BALANCE_DTYPE: balance and exps in float64, rounded to float32


def _exp32(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x.to(BALANCE_DTYPE)).float()


@functools.lru_cache(maxsize=8)
def _hadamard(d: int) -> torch.Tensor:
    if d <= 0 or d & (d - 1):
        raise ValueError(f"KVarN rotates by a Hadamard matrix: head_dim must be a power of two, got {d}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / d**0.5).float()


def hadamard(d: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """H_d / sqrt(d) (float32): symmetric and its own inverse, so it rotates and un-rotates."""
    return _hadamard(d).to(device)


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
    def record_bytes(self) -> int:
        """Bytes of one tile of one head, K and V together, padded to 8 (never to a power of two)."""
        return -(-sum(n for _, n in self.fields) // 8) * 8

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
        parts = dict(zip(("k_codes", "k_a", "k_z", "k_r"), _quantize(kr.transpose(1, 2), self.k_bits)))
        v_codes, v_a, v_z, v_c = _quantize(vr, self.v_bits)
        parts.update(v_codes=v_codes, v_a=v_a, v_z=v_z, v_c=v_c)
        out = [parts[name] for name, _ in self.fields]
        pad = self.record_bytes - sum(n for _, n in self.fields)
        if pad:
            out.append(torch.zeros(k.shape[0], pad, dtype=torch.uint8, device=k.device))
        return torch.cat(out, -1)

    # --- decode -----------------------------------------------------------------------------------------------
    def split(self, rec: torch.Tensor) -> dict[str, torch.Tensor]:
        out, off = {}, 0
        for name, n in self.fields:
            out[name] = rec[..., off : off + n]
            off += n
        return out

    def decode_rotated(self, rec: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """records [..., record_bytes] -> (k, v) [..., G, D] float32, still in the rotated domain."""
        p, g, d = self.split(rec), self.tile, self.head_dim
        kq = _unpack(p["k_codes"], self.k_bits).unflatten(-1, (d, g)).float()
        k = (kq * _f16(p["k_a"]).unsqueeze(-1) + _f16(p["k_z"]).unsqueeze(-1)) * _f16(p["k_r"]).unsqueeze(-2)
        vq = _unpack(p["v_codes"], self.v_bits).unflatten(-1, (g, d)).float()
        v = (vq * _f16(p["v_a"]).unsqueeze(-1) + _f16(p["v_z"]).unsqueeze(-1)) * _f16(p["v_c"]).unsqueeze(-2)
        return k.transpose(-1, -2), v

    def decode(self, rec: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """records -> (k, v) [..., G, D] float32 in the model's own (un-rotated) domain."""
        k, v = self.decode_rotated(rec)
        h = hadamard(self.head_dim, rec.device)
        return k @ h, v @ h


def _std_rows(x: torch.Tensor, x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Population std down the rows of x [N, R, C], row r scaled by w [N, R] -> [N, C]; as E[x^2] - E[x]^2 through
    vector-matrix products (x^2 precomputed), the same arithmetic qconv.kv uses, so the records match bit for bit."""
    n = x.shape[-2]
    mean = torch.matmul(w.unsqueeze(-2), x).squeeze(-2) / n
    sq = torch.matmul((w * w).unsqueeze(-2), x2).squeeze(-2) / n
    return (sq - mean * mean).clamp_min_(0).sqrt_()


def _balance(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Column (u) and row (v) log-scales evening out x [N, R, C] (float64 inside, float32 out); the iterate of least
    imbalance max/min(col std) + max/min(row std) wins by at least 0.01%, the unscaled tile included (the last
    iterate need not be best; near-equal ones would be told apart by summation order only)."""
    lo, hi = STD_CLAMP
    x = x.to(BALANCE_DTYPE)
    xt = x.transpose(-1, -2).contiguous()
    x2, xt2 = x * x, xt * xt
    u = x.new_zeros(x.shape[0], x.shape[2])
    v = x.new_zeros(x.shape[0], x.shape[1])
    col = _std_rows(x, x2, torch.ones_like(v)).clamp_(lo, hi)
    row = _std_rows(xt, xt2, torch.ones_like(u)).clamp_(lo, hi)
    spread = lambda c, r: c.amax(-1) / c.amin(-1) + r.amax(-1) / r.amin(-1)  # noqa: E731
    keep_u, keep_v, keep = u, v, spread(col, row)
    for _ in range(ITERS):
        u = (u + col.log()).clamp_(*LOG_CLAMP)
        raw = _std_rows(xt, xt2, torch.exp(-u))
        v = (v + (raw * torch.exp(-v)).clamp_(lo, hi).log()).clamp_(*LOG_CLAMP)
        row = (raw * torch.exp(-v)).clamp_(lo, hi)
        col = (_std_rows(x, x2, torch.exp(-v)) * torch.exp(-u)).clamp_(lo, hi)
        now = spread(col, row)
        win = now < keep * MIN_GAIN
        keep = torch.where(win, now, keep)
        keep_u = torch.where(win.unsqueeze(-1), u, keep_u)
        keep_v = torch.where(win.unsqueeze(-1), v, keep_v)
    return keep_u.float(), keep_v.float()


def _quantize(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, ...]:
    """One side of a tile, x [N, R, C] float32 -> (packed codes, row step, row zero, column scale) as bytes."""
    u, v = _balance(x)
    y = x * _exp32(-v).unsqueeze(-1) * _exp32(-u).unsqueeze(-2)
    lo, hi = torch.aminmax(y, dim=-1)
    step = ((hi - lo) / (2**bits - 1)).clamp_min(1e-10)
    q = ((y - lo.unsqueeze(-1)) / step.unsqueeze(-1)).round_().clamp_(0, 2**bits - 1).to(torch.uint8)
    ev = _exp32(v)
    return _pack(q.flatten(-2), bits), _bytes(step * ev), _bytes(lo * ev), _bytes(_exp32(u))


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    per = 8 // bits
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    return (codes.unflatten(-1, (-1, per)) << shifts).sum(-1, dtype=torch.uint8)


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).flatten(-2)


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP16_MAX, FP16_MAX).to(torch.float16).contiguous().view(torch.uint8)


def _f16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).float()
