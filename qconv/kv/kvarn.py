"""KVarN: per-tile KV-cache quantization with a Hadamard rotation and Sinkhorn-style variance normalization.

Per (tile of G tokens, KV head), at write time and without calibration: rotate rows by H/sqrt(D); lay K out as
channels x tokens and V as tokens x channels; balance the tile by row and column log-scales so no channel or token
dominates its row's range; round each row asymmetrically to b bits; fold the balance into fp16 row/column scales
(K~[t,d] = (q a_d + z_d) r_t, V~[t,d] = (q a_t + z_t) c_d); pack codes little-end-first. `rotate=False,
balance=False` is the KIVI-style ablation (K per channel, V per token, nothing else)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qconv.kv.base import KVScheme
from qconv.kv.hadamard import rotate as hadamard_rotate
from qconv.kv.packing import Layout, bytes_fp16, fp16_bytes, pack_bits, unpack_bits

STD_MIN, STD_MAX = 1e-3, 1e3
LOG_MIN, LOG_MAX = -0.3, 10.0
# An iterate replaces the best so far only if it lowers the imbalance by 0.01%: once the tile is balanced the
# imbalance sits at 2 within float noise, and a strict `<` would pick among near-equal iterates by summation order,
# so this codec and its Triton port (plugins/vllm/qconv_vllm/kvarn_triton.py) or a GPU would write different scales.
MIN_GAIN = 1 - 1e-4
# The balance runs in float64 and hands float32 log-scales on; every exp of them is taken in float64 and rounded to
# float32. A sum's order (BLAS, a Triton tree, numpy) then moves the float32 results only when a value lies within
# ~1e-15 of a float32 rounding boundary, and libraries' exp no longer differ by an ulp: the torch codec, the plugin's
# and the Triton kernels write the same bytes.
BALANCE_DTYPE = torch.float64


def exp32(x: torch.Tensor) -> torch.Tensor:
    """e^x of float32 log-scales, correctly rounded to float32 wherever it is computed (see BALANCE_DTYPE)."""
    return torch.exp(x.to(BALANCE_DTYPE)).float()


def _imbalance(col: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    return col.amax(-1) / col.amin(-1) + row.amax(-1) / row.amin(-1)


def _weighted_std(x: torch.Tensor, x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """std over the rows of x [..., n, m] with row i scaled by w_i (w: [..., n]) -> [..., m], without building the
    scaled tile: vector-matrix products with x and x^2 (precomputed), cheaper than torch.std's Welford pass; the
    E[x^2] - E[x]^2 cancellation is harmless here (float64, 64-256 values per row)."""
    n = x.shape[-2]
    m = (w.unsqueeze(-2) @ x).squeeze(-2) / n
    s = ((w * w).unsqueeze(-2) @ x2).squeeze(-2) / n
    return (s - m * m).clamp_min_(0).sqrt_()


def balance(x: torch.Tensor, iters: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-scales (u per column, v per row) so that x / (e^v e^u^T) has even row and column spreads.

    Alternates column and row std normalization (stds clamped to [1e-3, 1e3], log-scales to [-0.3, 10]). The
    iteration need not converge under the clamps, so the (u, v) with the lowest imbalance max/min(col std) +
    max/min(row std) seen so far (by at least 0.01%, MIN_GAIN) is returned, starting from the unscaled tile
    (returning the last iterate instead is a known accuracy bug). x: [..., R, C] float32; computed in float64,
    returned as float32."""
    x = x.to(BALANCE_DTYPE)
    xt = x.transpose(-1, -2).contiguous()  # row stats as vector @ matrix too (far faster than matrix @ vector)
    x2, xt2 = x * x, xt * xt
    u = x.new_zeros(*x.shape[:-2], x.shape[-1])
    v = x.new_zeros(*x.shape[:-1])
    col = _weighted_std(x, x2, torch.ones_like(v)).clamp_(STD_MIN, STD_MAX)
    row = _weighted_std(xt, xt2, torch.ones_like(u)).clamp_(STD_MIN, STD_MAX)
    best_u, best_v, best_i = u, v, _imbalance(col, row)
    for _ in range(iters):
        u = (u + col.log()).clamp_(LOG_MIN, LOG_MAX)
        row_raw = _weighted_std(xt, xt2, torch.exp(-u))  # row std before dividing by e^v
        v = (v + (row_raw * torch.exp(-v)).clamp_(STD_MIN, STD_MAX).log()).clamp_(LOG_MIN, LOG_MAX)
        row = (row_raw * torch.exp(-v)).clamp_(STD_MIN, STD_MAX)
        col = (_weighted_std(x, x2, torch.exp(-v)) * torch.exp(-u)).clamp_(STD_MIN, STD_MAX)
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


@dataclass(frozen=True)
class TileScheme(KVScheme):
    """KVarN (rotate + balance) or its KIVI-style ablation (neither); sink tile and tile-in-progress stay fp16."""

    tile: int = 128
    sink: bool = True
    k_bits: int = 4
    v_bits: int = 2
    rotate: bool = True
    balance: bool = True
    iters: int = 8

    def layout(self, d: int) -> Layout:
        g, f = self.tile, []
        f += [("k_codes", d * g * self.k_bits // 8), ("k_a", 2 * d), ("k_z", 2 * d)]
        f += [("k_r", 2 * g)] if self.balance else []
        f += [("v_codes", g * d * self.v_bits // 8)]
        f += [("v_c", 2 * d)] if self.balance else []
        f += [("v_a", 2 * g), ("v_z", 2 * g)]
        return Layout(tuple(f))

    def record_bytes(self, head_dim: int) -> int:
        return self.layout(head_dim).size

    def serving_work_bytes(
        self, layers: int, q_heads: int, kv_heads: int, head_dim: int, max_num_seqs: int, batched_tokens: int
    ) -> int:
        """The qconv-vllm backend's worst case beside the KV pool (tests/test_kvarn_triton.py holds it to the
        plugin's own sizes): per layer an fp16 staging buffer of 3 tiles of K and V for each of 2 x max_num_seqs
        + 8 slots, and once, the Triton attention's transient work for a batch of `batched_tokens` query tokens
        (rotated query and output, split-K partials for at least 1,024 rows, the rotated exact run)."""
        g, d, t = self.tile, head_dim, batched_tokens
        staging = layers * (2 * max_num_seqs + 8) * 3 * 2 * kv_heads * g * d * 2
        exact = t + 2 * g * max_num_seqs
        attention = 4 * (4 * t * q_heads * d + max(t, 1024) * q_heads * (d + 2) + exact * (2 * kv_heads * d + 1))
        return staging + attention

    def _side(self, x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One tile matrix [N, R, C] -> (packed codes, row scale a, row zero z, column scale), scales as fp16 bytes."""
        if self.balance:
            u, v = balance(x, self.iters)
            y = x * exp32(-v).unsqueeze(-1) * exp32(-u).unsqueeze(-2)
        else:
            u, v, y = None, None, x
        q, step, lo = rtn_rows(y, bits)
        ev = exp32(v) if v is not None else 1.0
        col = fp16_bytes(exp32(u)) if u is not None else None
        return pack_bits(q.flatten(-2), bits), fp16_bytes(step * ev), fp16_bytes(lo * ev), col

    def _encode(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.rotate:
            k, v = hadamard_rotate(k), hadamard_rotate(v)
        kc, ka, kz, kr = self._side(k.transpose(-1, -2), self.k_bits)  # rows = channels
        vc, va, vz, vcol = self._side(v, self.v_bits)  # rows = tokens
        parts = {"k_codes": kc, "k_a": ka, "k_z": kz, "k_r": kr, "v_codes": vc, "v_c": vcol, "v_a": va, "v_z": vz}
        return self.layout(k.shape[-1]).join(parts)

    def _decode(self, rec: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        p, g, d = self.layout(head_dim).split(rec), self.tile, head_dim
        qk = unpack_bits(p["k_codes"], self.k_bits).unflatten(-1, (d, g)).float()
        k = qk * bytes_fp16(p["k_a"]).unsqueeze(-1) + bytes_fp16(p["k_z"]).unsqueeze(-1)  # [N, D, G]
        if self.balance:
            k = k * bytes_fp16(p["k_r"]).unsqueeze(-2)
        qv = unpack_bits(p["v_codes"], self.v_bits).unflatten(-1, (g, d)).float()
        v = qv * bytes_fp16(p["v_a"]).unsqueeze(-1) + bytes_fp16(p["v_z"]).unsqueeze(-1)  # [N, G, D]
        if self.balance:
            v = v * bytes_fp16(p["v_c"]).unsqueeze(-2)
        k = k.transpose(-1, -2)
        if self.rotate:
            k, v = hadamard_rotate(k), hadamard_rotate(v)
        return k, v


def kvarn(k_bits: int, v_bits: int, tile: int) -> TileScheme:
    """Preset `kvarn_k{k}v{v}_g{tile}`. Tile sizes: 128 is the design's default; 64 costs a few % more bytes for a
    little less error; 256 is for head_dim <= 64, where each record's per-channel fields (a_d, z_d, c_d: 6 B per
    channel) weigh twice as much against the codes as at D=128 and g128 ends up larger than q4_0 (k4v4 at D=64:
    73 B/token/head vs int4_g32's 72) -- a 256-token tile halves their share (71.5 B). The price: a 256-token fp16
    sink and up to 255 fp16 tokens in progress per sequence."""
    return TileScheme(name=f"kvarn_k{k_bits}v{v_bits}_g{tile}", tile=tile, k_bits=k_bits, v_bits=v_bits)
