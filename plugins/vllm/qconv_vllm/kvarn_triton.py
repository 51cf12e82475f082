"""Triton kernels for the KVarN KV cache: encode full tiles into records, with the device helpers the attention
(kvarn_attention.py) shares. Pure functions over tensors (no vLLM, no qconv import;
constants and layout from kvarn_codec, the torch path), so the vLLM backend calls them on CUDA and the tests run them
on CPU under TRITON_INTERPRET=1 against qconv.kv.kvarn.

Record of one (tile of G tokens, KV head): the byte layout of qconv.kv.kvarn.TileScheme.layout(D) -- fields k_codes
[D x G codes], k_a [D], k_z [D], k_r [G], v_codes [G x D codes], v_c [D], v_a [G], v_z [G]; fp16 fields as raw bytes,
codes little-end-first, padded to 8 bytes (never to a power of two). K codes are in the rotated domain (x @ H/sqrt(D)).

- encode_tiles(k, v, k_bits, v_bits, iters=8) -> uint8 [N, record_bytes]; k, v fp16 [N, G, D], natural domain.
- attention (decodes, verifies, prefill chunks): kvarn_attention.py, which reads records without dequantizing.

Records follow kvarn.py op by op (the rotation is the same torch matmul; IEEE division and sqrt, round-half-even,
libdevice exp/log on CUDA). The kernel's sums run in another order than torch's BLAS, so, as in the torch codecs,
the balance runs in float64 and each exp of a log-scale is taken in float64 and rounded to float32: the bytes are
the torch codec's (tests/test_kvarn_triton.py). The Hadamard matrix is cached per (D, device), so the first call
must not be inside a CUDA-graph capture.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from qconv_vllm import kvarn_codec as ref

# The torch codec's constants, as constexpr so jit code may read them
STD_MIN, STD_MAX = tl.constexpr(ref.STD_CLAMP[0]), tl.constexpr(ref.STD_CLAMP[1])
LOG_MIN, LOG_MAX = tl.constexpr(ref.LOG_CLAMP[0]), tl.constexpr(ref.LOG_CLAMP[1])
FP16_MAX, MIN_GAIN = tl.constexpr(ref.FP16_MAX), tl.constexpr(ref.MIN_GAIN)
# Kernel parameter of each record field's byte offset, in kvarn_codec.Codec.fields' storage order
FIELD_ARGS = ("KC", "KA", "KZ", "KR", "VC", "VCOL", "VA", "VZ")


def record_fields(d: int, g: int, k_bits: int, v_bits: int) -> tuple[dict[str, int], int]:
    """Byte offset of each record field (kvarn_codec.Codec's layout) and the record size."""
    codec, offs, o = ref.Codec(k_bits, v_bits, g, d), {}, 0
    for name, n in codec.fields:
        offs[name], o = o, o + n
    return offs, codec.record_bytes


def record_bytes(d: int, g: int, k_bits: int, v_bits: int) -> int:
    return ref.Codec(k_bits, v_bits, g, d).record_bytes


@functools.lru_cache(maxsize=8)
def hadamard(d: int, device: torch.device) -> torch.Tensor:
    """H/sqrt(d) float32 on `device`, made once per device (no copy per call, nothing to copy in a CUDA graph)."""
    return ref.hadamard(d, device)


def check_shape(d: int, g: int, k_bits: int, v_bits: int) -> None:
    if d not in (64, 128, 256) or g not in (64, 128, 256) or k_bits not in (2, 4, 8) or v_bits not in (2, 4, 8):
        raise ValueError(
            f"KVarN kernels take head_dim and tile in 64/128/256 and 2/4/8-bit codes, "
            f"got D={d} G={g} k{k_bits}v{v_bits}"
        )


def use_libdevice() -> bool:
    """Interpret mode has no libdevice; compiled CUDA uses it for correctly rounded exp/log (tl.exp is approximate)."""
    return os.environ.get("TRITON_INTERPRET", "0") != "1"


# ---------------------------------------------------------------- shared device helpers
@triton.jit
def _exp(x, LIBDEV: tl.constexpr):
    """libdevice's exp (as accurate as torch's) on CUDA, where tl.exp is approximate."""
    if LIBDEV:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _log(x, LIBDEV: tl.constexpr):
    """libdevice's log on CUDA, where tl.log is approximate."""
    if LIBDEV:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def unpack_codes(base, rows, cols, ROW: tl.constexpr, BITS: tl.constexpr):
    """Codes [rows, cols] of a row-major [*, ROW] code matrix packed little-end-first at `base`, as float32."""
    f = rows[:, None] * ROW + cols[None, :]
    byte = tl.load(base + f // (8 // BITS)).to(tl.int32)
    return ((byte >> ((f % (8 // BITS)) * BITS)) & ((1 << BITS) - 1)).to(tl.float32)


# ---------------------------------------------------------------- encode
# A program encodes one side of one tile, [R, C] = K^T [D, G] or V [G, D] (row-major, so a chunk's rows read along
# memory), over chunks of BR rows loaded again on every pass: the whole tile held in registers through the balance
# (D=256 G=128: 128 float64 a thread at 8 warps) spilled 211 KB a thread on sm_90a and took ptxas minutes. Per-row
# vectors live as [R // BR, BR]: a register tensor cannot be indexed by the loop variable, chunk j is a mask.
@triton.jit
def _exp32(x, LIBDEV: tl.constexpr):
    """kvarn.exp32: e^x of float32 log-scales, taken in float64 and rounded to float32."""
    return _exp(x.to(tl.float64), LIBDEV).to(tl.float32)


@triton.jit
def _std(s1, s2, N: tl.constexpr):
    """kvarn._weighted_std from the sums of w x and (w w)(x x) over N: sqrt(max(E[w x^2 w] - E[w x]^2, 0))."""
    m = s1 * (1.0 / N)
    return tl.sqrt(tl.maximum(s2 * (1.0 / N) - m * m, 0.0))  # float64 sqrt and division are IEEE-rounded


@triton.jit
def _row_sums(x_ptr, w, R: tl.constexpr, C: tl.constexpr, BR: tl.constexpr):
    """Sums of w x and (w w)(x x) along each row of x [R, C] for column weights w [C], as [R // BR, BR]."""
    NCH: tl.constexpr = R // BR
    c, chunk = tl.arange(0, C), tl.arange(0, NCH)[:, None]
    m = tl.zeros([NCH, BR], tl.float64)
    s = tl.zeros([NCH, BR], tl.float64)
    at, w2 = tl.arange(0, BR)[:, None] * C + c[None, :], w * w
    for j in range(NCH):
        x = tl.load(x_ptr + j * (BR * C) + at).to(tl.float64)
        here = chunk == j
        m = tl.where(here, tl.sum(w[None, :] * x, 1)[None, :], m)
        s = tl.where(here, tl.sum(w2[None, :] * (x * x), 1)[None, :], s)
    return m, s


@triton.jit
def _col_sums(x_ptr, w, R: tl.constexpr, C: tl.constexpr, BR: tl.constexpr):
    """Sums of w x and (w w)(x x) down each column of x [R, C] for row weights w [R // BR, BR] (w > 0), as [C]."""
    NCH: tl.constexpr = R // BR
    c, chunk = tl.arange(0, C), tl.arange(0, NCH)[:, None]
    m = tl.zeros([C], tl.float64)
    s = tl.zeros([C], tl.float64)
    at = tl.arange(0, BR)[:, None] * C + c[None, :]
    for j in range(NCH):
        x = tl.load(x_ptr + j * (BR * C) + at).to(tl.float64)
        wj = tl.max(tl.where(chunk == j, w, 0.0), 0)[:, None]
        m += tl.sum(wj * x, 0)
        s += tl.sum((wj * wj) * (x * x), 0)
    return m, s


@triton.jit
def _imbalance(col, row):
    """max/min of the column stds [C] plus max/min of the row stds [R // BR, BR]."""
    return tl.max(col, 0) / tl.min(col, 0) + tl.max(tl.max(row, 1), 0) / tl.min(tl.min(row, 1), 0)


@triton.jit
def _balance(x_ptr, R: tl.constexpr, C: tl.constexpr, BR: tl.constexpr, ITERS: tl.constexpr, LIBDEV: tl.constexpr):
    """kvarn.balance on one tile x [R, C] in float64: column log-scales u [C], row log-scales v [R // BR, BR]
    (float32), best-so-far. Each std is a pass over the row chunks; the exp/log of the scales run on whole vectors
    between passes."""
    NCH: tl.constexpr = R // BR
    u = tl.zeros([C], tl.float64)
    v = tl.zeros([NCH, BR], tl.float64)
    m, s = _row_sums(x_ptr, tl.full([C], 1.0, tl.float64), R, C, BR)
    row = tl.clamp(_std(m, s, C), STD_MIN, STD_MAX)
    m, s = _col_sums(x_ptr, tl.full([NCH, BR], 1.0, tl.float64), R, C, BR)
    col = tl.clamp(_std(m, s, R), STD_MIN, STD_MAX)
    best_u, best_v = u, v
    best_i = _imbalance(col, row)
    for _ in range(ITERS):
        u = tl.clamp(u + _log(col, LIBDEV), LOG_MIN, LOG_MAX)
        eu = _exp(-u, LIBDEV)
        m, s = _row_sums(x_ptr, eu, R, C, BR)
        raw = _std(m, s, C)
        v = tl.clamp(v + _log(tl.clamp(raw * _exp(-v, LIBDEV), STD_MIN, STD_MAX), LIBDEV), LOG_MIN, LOG_MAX)
        ev = _exp(-v, LIBDEV)
        row = tl.clamp(raw * ev, STD_MIN, STD_MAX)
        m, s = _col_sums(x_ptr, ev, R, C, BR)
        col = tl.clamp(_std(m, s, R) * eu, STD_MIN, STD_MAX)
        imb = _imbalance(col, row)
        better = imb < best_i * MIN_GAIN
        best_i = tl.where(better, imb, best_i)
        best_u = tl.where(better, u, best_u)
        best_v = tl.where(better, v, best_v)
    return best_u.to(tl.float32), best_v.to(tl.float32)


@triton.jit
def _rne(t):
    """Round half to even (torch.round) for t >= 0; t - floor(t) is exact here."""
    f = tl.floor(t)
    fr = t - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    return f + tl.where((fr > 0.5) | ((fr == 0.5) & odd), 1.0, 0.0)


@triton.jit
def _side(
    x_ptr,
    rec,
    rec16,
    CODES: tl.constexpr,
    A: tl.constexpr,
    Z: tl.constexpr,
    COL: tl.constexpr,
    R: tl.constexpr,
    C: tl.constexpr,
    BR: tl.constexpr,
    BITS: tl.constexpr,
    ITERS: tl.constexpr,
    LIBDEV: tl.constexpr,
):
    """kvarn.TileScheme._side on x [R, C] at x_ptr: balance, RTN per row (chunk by chunk), fold scales into fp16,
    pack (codes hold disjoint bits, so a sum packs them, like the reference); write the fields of one record."""
    NCH: tl.constexpr = R // BR
    PER: tl.constexpr = 8 // BITS
    u, v = _balance(x_ptr, R, C, BR, ITERS, LIBDEV)
    c, chunk = tl.arange(0, C), tl.arange(0, NCH)[:, None]
    eu, emv, ev = _exp32(-u, LIBDEV), _exp32(-v, LIBDEV), _exp32(v, LIBDEV)
    shifts = tl.arange(0, PER) * BITS
    for j in range(NCH):
        r = j * BR + tl.arange(0, BR)
        y = tl.load(x_ptr + r[:, None] * C + c[None, :]) * tl.max(tl.where(chunk == j, emv, 0.0), 0)[:, None]
        y = y * eu[None, :]
        lo = tl.min(y, 1)
        step = tl.maximum(tl.div_rn(tl.max(y, 1) - lo, (1 << BITS) - 1.0), 1e-10)
        q = tl.clamp(_rne(tl.div_rn(y - lo[:, None], step[:, None])), 0.0, (1 << BITS) - 1.0).to(tl.int32)
        packed = tl.sum(tl.reshape(q, [BR, C // PER, PER]) << shifts[None, None, :], 2).to(tl.uint8)
        tl.store(rec + CODES + r[:, None] * (C // PER) + tl.arange(0, C // PER)[None, :], packed)
        evj = tl.max(tl.where(chunk == j, ev, 0.0), 0)
        tl.store(rec16 + A // 2 + r, tl.clamp(step * evj, -FP16_MAX, FP16_MAX).to(tl.float16))
        tl.store(rec16 + Z // 2 + r, tl.clamp(lo * evj, -FP16_MAX, FP16_MAX).to(tl.float16))
    tl.store(rec16 + COL // 2 + c, tl.clamp(_exp32(u, LIBDEV), -FP16_MAX, FP16_MAX).to(tl.float16))


@triton.jit
def _encode_kernel(
    k_ptr,
    v_ptr,
    rec_ptr,
    rec16_ptr,
    D: tl.constexpr,
    G: tl.constexpr,
    KB: tl.constexpr,
    VB: tl.constexpr,
    RB: tl.constexpr,
    KC: tl.constexpr,
    KA: tl.constexpr,
    KZ: tl.constexpr,
    KR: tl.constexpr,
    VC: tl.constexpr,
    VCOL: tl.constexpr,
    VA: tl.constexpr,
    VZ: tl.constexpr,
    ITERS: tl.constexpr,
    LIBDEV: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (n, 0) encodes tile n's K side, (n, 1) its V side (they share nothing), in chunks of BLOCK elements;
    k comes rotated and transposed (float32 [N, D, G], rows = channels), v rotated (float32 [N, G, D])."""
    n = tl.program_id(0).to(tl.int64)
    rec, rec16 = rec_ptr + n * RB, rec16_ptr + n * (RB // 2)
    if tl.program_id(1) == 0:
        _side(k_ptr + n * G * D, rec, rec16, KC, KA, KZ, KR, D, G, BLOCK // G, KB, ITERS, LIBDEV)
    else:
        _side(v_ptr + n * G * D, rec, rec16, VC, VA, VZ, VCOL, G, D, BLOCK // D, VB, ITERS, LIBDEV)


def field_args(d: int, g: int, k_bits: int, v_bits: int) -> dict[str, int]:
    """The kernels' constexpr layout arguments: D, G, bits KB/VB, record bytes RB, the byte offset of each field in
    storage order. Each its own tl.constexpr parameter: compiled Triton (not the interpreter) rejects tl.arange and
    shapes over values unpacked from a constexpr tuple ("arange's arguments must be of type tl.constexpr")."""
    o, rb = record_fields(d, g, k_bits, v_bits)
    return dict(D=d, G=g, KB=k_bits, VB=v_bits, RB=rb, **dict(zip(FIELD_ARGS, o.values(), strict=True)))


# _encode_kernel's launch: chunks of 2048 elements (BLOCK // C rows, a power of two <= R at every shape check_shape
# admits) on 8 warps, 8 a thread; at D=256 G=128 ptxas gives sm_86 and sm_90a 128 registers and no spills
# (tests/test_kvarn_triton_compile.py), so two programs share an SM's registers
ENCODE_BLOCK, ENCODE_WARPS = 2048, 8


def encode_args(layout: dict[str, int], iters: int = ref.ITERS) -> dict:
    """_encode_kernel's constexprs and launch options past the layout, as encode_tiles passes them (and the compile
    test compiles them); no FMA, as torch does none."""
    return dict(
        layout, ITERS=iters, LIBDEV=use_libdevice(), BLOCK=ENCODE_BLOCK, num_warps=ENCODE_WARPS, enable_fp_fusion=False
    )


def encode_tiles(k: torch.Tensor, v: torch.Tensor, k_bits: int, v_bits: int, iters: int = ref.ITERS) -> torch.Tensor:
    """Full tiles k, v fp16 [N, G, D] (natural domain) -> KVarN records uint8 [N, record_bytes]. The rotation is a
    torch matmul, the reference's own op (a [D, D] operand would not fit a Triton program's shared memory at D=256)."""
    n, g, d = k.shape
    check_shape(d, g, k_bits, v_bits)
    if v.shape != k.shape:
        raise ValueError(f"encode_tiles: k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    a = field_args(d, g, k_bits, v_bits)
    rec = torch.empty(n, a["RB"], dtype=torch.uint8, device=k.device)
    if n:
        h = hadamard(d, k.device)
        _encode_kernel[(n, 2)](
            (k.half().float() @ h).transpose(1, 2).contiguous(),  # K^T [N, D, G]: a K program's rows are channels
            v.half().float() @ h,
            rec,
            rec.view(torch.float16),
            **encode_args(a, iters),
        )
    return rec
