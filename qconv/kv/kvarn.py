"""KVarN: per-tile KV-cache quantization with a Hadamard rotation and Sinkhorn-style variance normalization.

Per (tile of G tokens, KV head), at write time and without calibration: rotate rows by H/sqrt(D); lay K out as
channels x tokens and V as tokens x channels; balance the tile by row and column log-scales so no channel or token
dominates its row's range; round each row asymmetrically to b bits; fold the balance into fp16 row/column scales
(K~[t,d] = (q a_d + z_d) r_t, V~[t,d] = (q a_t + z_t) c_d); pack codes little-end-first. `rotate=False,
balance=False` is the KIVI-style ablation (K per channel, V per token, nothing else).

The arithmetic (balance, rounding, packing) is the qconv-vllm plugin's (qconv_vllm.kvarn_codec), so qconv's engine and
vLLM with the plugin write the same records; this module adds the scheme around it (layout, sizing, decode)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qconv.kv.base import KVScheme
from qconv.kv.hadamard import rotate as hadamard_rotate
from qconv_vllm.kvarn_codec import encode_side
from qconv_vllm.packing import RecordLayout, bytes_fp16, unpack_bits


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

    def layout(self, d: int) -> RecordLayout:
        g, f = self.tile, []
        f += [("k_codes", d * g * self.k_bits // 8), ("k_a", 2 * d), ("k_z", 2 * d)]
        f += [("k_r", 2 * g)] if self.balance else []
        f += [("v_codes", g * d * self.v_bits // 8)]
        f += [("v_c", 2 * d)] if self.balance else []
        f += [("v_a", 2 * g), ("v_z", 2 * g)]
        return RecordLayout(tuple(f))

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

    def _encode(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.rotate:
            k, v = hadamard_rotate(k), hadamard_rotate(v)
        kc, ka, kz, kr = encode_side(k.transpose(-1, -2), self.k_bits, self.balance, self.iters)  # rows = channels
        vc, va, vz, vcol = encode_side(v, self.v_bits, self.balance, self.iters)  # rows = tokens
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
