"""Triton kernels for the KVarN KV cache: encode full tiles into records and dequantize records, with the device
helpers decode attention (kvarn_attention.py) shares. Pure functions over tensors (no vLLM, no qconv import;
constants and layout from kvarn_codec, the torch path), so the vLLM backend calls them on CUDA and the tests run them
on CPU under TRITON_INTERPRET=1 against qconv.kv.kvarn.

Record of one (tile of G tokens, KV head): the byte layout of qconv.kv.kvarn.TileScheme.layout(D) -- fields k_codes
[D x G codes], k_a [D], k_z [D], k_r [G], v_codes [G x D codes], v_c [D], v_a [G], v_z [G]; fp16 fields as raw bytes,
codes little-end-first, padded to 8 bytes (never to a power of two). K codes are in the rotated domain (x @ H/sqrt(D)).

- encode_tiles(k, v, k_bits, v_bits, iters=8) -> uint8 [N, record_bytes]; k, v fp16 [N, G, D], natural domain.
- dequant_tiles(records, D, G, k_bits, v_bits, out_dtype=float32) -> (k, v) [N, G, D] in the NATURAL domain.
- decode_attention: kvarn_attention.py.

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
def _explog(x, LOG: tl.constexpr, LIBDEV: tl.constexpr):
    """log(x) if LOG else exp(x): libdevice's (as accurate as torch's) on CUDA, where tl.exp/tl.log are approximate."""
    if LOG:
        if LIBDEV:
            return libdevice.log(x)
        else:
            return tl.log(x)
    elif LIBDEV:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _exp(x, LIBDEV: tl.constexpr):
    return _explog(x, False, LIBDEV)


@triton.jit
def _log(x, LIBDEV: tl.constexpr):
    return _explog(x, True, LIBDEV)


@triton.jit
def unpack_codes(base, rows, cols, ROW: tl.constexpr, BITS: tl.constexpr):
    """Codes [rows, cols] of a row-major [*, ROW] code matrix packed little-end-first at `base`, as float32."""
    f = rows[:, None] * ROW + cols[None, :]
    byte = tl.load(base + f // (8 // BITS)).to(tl.int32)
    return ((byte >> ((f % (8 // BITS)) * BITS)) & ((1 << BITS) - 1)).to(tl.float32)


# ---------------------------------------------------------------- encode
@triton.jit
def _exp32(x, LIBDEV: tl.constexpr):
    """kvarn.exp32: e^x of float32 log-scales, taken in float64 and rounded to float32."""
    return _exp(x.to(tl.float64), LIBDEV).to(tl.float32)


@triton.jit
def _std(x, w, AXIS: tl.constexpr, N: tl.constexpr):
    """kvarn._weighted_std in float64: sqrt(max(E[w x^2 w] - E[w x]^2, 0)) over AXIS, w broadcast against x."""
    m = tl.sum(w * x, AXIS) * (1.0 / N)
    s = tl.sum((w * w) * (x * x), AXIS) * (1.0 / N)
    return tl.sqrt(tl.maximum(s - m * m, 0.0))  # float64 sqrt and division are IEEE-rounded (no _rn needed)


@triton.jit
def _imbalance(col, row):
    return tl.max(col, 0) / tl.min(col, 0) + tl.max(row, 0) / tl.min(row, 0)


@triton.jit
def _balance(x32, R: tl.constexpr, C: tl.constexpr, ITERS: tl.constexpr, LIBDEV: tl.constexpr):
    """kvarn.balance on one tile x [R, C] in float64: column log-scales u [C], row log-scales v [R] (float32),
    best-so-far."""
    x = x32.to(tl.float64)
    u = tl.zeros([C], tl.float64)
    v = tl.zeros([R], tl.float64)
    col = tl.clamp(_std(x, tl.full([R, 1], 1.0, tl.float64), 0, R), STD_MIN, STD_MAX)
    row = tl.clamp(_std(x, tl.full([1, C], 1.0, tl.float64), 1, C), STD_MIN, STD_MAX)
    best_u, best_v, best_i = u, v, _imbalance(col, row)
    for _ in range(ITERS):
        u = tl.clamp(u + _log(col, LIBDEV), LOG_MIN, LOG_MAX)
        eu = _exp(-u, LIBDEV)
        row_raw = _std(x, eu[None, :], 1, C)
        v = tl.clamp(v + _log(tl.clamp(row_raw * _exp(-v, LIBDEV), STD_MIN, STD_MAX), LIBDEV), LOG_MIN, LOG_MAX)
        ev = _exp(-v, LIBDEV)
        row = tl.clamp(row_raw * ev, STD_MIN, STD_MAX)
        col = tl.clamp(_std(x, ev[:, None], 0, R) * eu, STD_MIN, STD_MAX)
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
def _or(a, b):
    return a | b


@triton.jit
def _side(
    x,
    rec,
    rec16,
    CODES: tl.constexpr,
    A: tl.constexpr,
    Z: tl.constexpr,
    COL: tl.constexpr,
    R: tl.constexpr,
    C: tl.constexpr,
    BITS: tl.constexpr,
    ITERS: tl.constexpr,
    LIBDEV: tl.constexpr,
):
    """kvarn.TileScheme._side: balance, RTN per row, fold scales into fp16, pack; write the fields of one record."""
    u, v = _balance(x, R, C, ITERS, LIBDEV)
    y = x * _exp32(-v, LIBDEV)[:, None] * _exp32(-u, LIBDEV)[None, :]
    lo = tl.min(y, 1)
    step = tl.maximum(tl.div_rn(tl.max(y, 1) - lo, (1 << BITS) - 1.0), 1e-10)
    q = tl.clamp(_rne(tl.div_rn(y - lo[:, None], step[:, None])), 0.0, (1 << BITS) - 1.0).to(tl.int32)
    PER: tl.constexpr = 8 // BITS
    shifts = (tl.arange(0, PER) * BITS).to(tl.uint8)
    packed = tl.reduce(tl.reshape(q.to(tl.uint8), [R, C // PER, PER]) << shifts[None, None, :], 2, _or)
    r = tl.arange(0, R)
    tl.store(rec + CODES + r[:, None] * (C // PER) + tl.arange(0, C // PER)[None, :], packed)
    ev = _exp32(v, LIBDEV)
    tl.store(rec16 + A // 2 + r, tl.clamp(step * ev, -FP16_MAX, FP16_MAX).to(tl.float16))
    tl.store(rec16 + Z // 2 + r, tl.clamp(lo * ev, -FP16_MAX, FP16_MAX).to(tl.float16))
    tl.store(rec16 + COL // 2 + tl.arange(0, C), tl.clamp(_exp32(u, LIBDEV), -FP16_MAX, FP16_MAX).to(tl.float16))


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
):
    """One tile per program; k, v come rotated (float32 [N, G, D]); K is read transposed (rows = channels)."""
    n = tl.program_id(0).to(tl.int64)
    d, g = tl.arange(0, D), tl.arange(0, G)
    rec, rec16 = rec_ptr + n * RB, rec16_ptr + n * (RB // 2)
    _side(tl.load(k_ptr + n * G * D + g[None, :] * D + d[:, None]), rec, rec16, KC, KA, KZ, KR, D, G, KB, ITERS, LIBDEV)
    _side(
        tl.load(v_ptr + n * G * D + g[:, None] * D + d[None, :]), rec, rec16, VC, VA, VZ, VCOL, G, D, VB, ITERS, LIBDEV
    )


def field_args(d: int, g: int, k_bits: int, v_bits: int) -> dict[str, int]:
    """The kernels' constexpr layout arguments: D, G, bits KB/VB, record bytes RB, the byte offset of each field in
    storage order. Each its own tl.constexpr parameter: compiled Triton (not the interpreter) rejects tl.arange and
    shapes over values unpacked from a constexpr tuple ("arange's arguments must be of type tl.constexpr")."""
    o, rb = record_fields(d, g, k_bits, v_bits)
    return dict(D=d, G=g, KB=k_bits, VB=v_bits, RB=rb, **dict(zip(FIELD_ARGS, o.values(), strict=True)))


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
        _encode_kernel[(n,)](
            k.half().float() @ h,
            v.half().float() @ h,
            rec,
            rec.view(torch.float16),
            ITERS=iters,
            LIBDEV=use_libdevice(),
            num_warps=8,
            enable_fp_fusion=False,
            **a,
        )  # torch does no FMA
    return rec


# ---------------------------------------------------------------- dequantize
@triton.jit
def _dequant_kernel(
    rec_ptr,
    rec16_ptr,
    k_ptr,
    v_ptr,
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
):
    """One record per program -> k [G, D], v [G, D] float32, rotated."""
    n = tl.program_id(0).to(tl.int64)
    d, g = tl.arange(0, D), tl.arange(0, G)
    rec, rec16 = rec_ptr + n * RB, rec16_ptr + n * (RB // 2)
    kt = (
        unpack_codes(rec + KC, d, g, G, KB) * tl.load(rec16 + KA // 2 + d).to(tl.float32)[:, None]
        + tl.load(rec16 + KZ // 2 + d).to(tl.float32)[:, None]
    )
    kt = kt * tl.load(rec16 + KR // 2 + g).to(tl.float32)[None, :]  # [D, G] rotated
    vt = (
        unpack_codes(rec + VC, g, d, D, VB) * tl.load(rec16 + VA // 2 + g).to(tl.float32)[:, None]
        + tl.load(rec16 + VZ // 2 + g).to(tl.float32)[:, None]
    )
    vt = vt * tl.load(rec16 + VCOL // 2 + d).to(tl.float32)[None, :]  # [G, D] rotated
    tl.store(k_ptr + n * G * D + g[None, :] * D + d[:, None], kt)  # transposed store: [G, D]
    tl.store(v_ptr + n * G * D + g[:, None] * D + d[None, :], vt)


def dequant_tiles(
    records: torch.Tensor, D: int, G: int, k_bits: int, v_bits: int, out_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Records uint8 [N, record_bytes] -> (k, v) [N, G, D] in the natural (un-rotated) domain, like TileScheme.decode;
    natural so the prefill path can concatenate them with the exact fp16 sink and current tile."""
    check_shape(D, G, k_bits, v_bits)
    a = field_args(D, G, k_bits, v_bits)
    n = records.shape[0]
    if records.shape != (n, a["RB"]) or records.dtype != torch.uint8:
        raise ValueError(
            f"dequant_tiles: records must be uint8 [N, {a['RB']}], got {records.dtype} {tuple(records.shape)}"
        )
    k = torch.empty(n, G, D, dtype=torch.float32, device=records.device)
    v = torch.empty_like(k)
    if n:
        rec = records.contiguous()
        _dequant_kernel[(n,)](rec, rec.view(torch.float16), k, v, num_warps=8, **a)
    h = hadamard(D, records.device)  # un-rotate with the reference's own op
    return (k @ h).to(out_dtype), (v @ h).to(out_dtype)
