"""Triton decode attention over a KVarN cache (sink + quantized tiles + the tile being filled), on the records and
device helpers of kvarn_triton.py; pure functions over tensors like it.

decode_attention(q, pool, block_table, n_closed, stage_k, stage_v, sink_len, cur_len, k_bits, v_bits, G, scale,
  num_splits=None) -> [B, Hq, D] in q's dtype: one query per sequence, GQA, split-K over quantized tiles with a
  log-sum-exp merge. pool uint8 [blocks, Hkv, record_bytes]; tile t (1..n_closed[b]) of sequence b is block
  block_table[b, t] (so block_table has more than n_closed[b] columns); stage_k/v fp16 [B, 2, Hkv, G, D] hold the
  exact sink (sink_len[b] tokens) and the tile being filled (cur_len[b] tokens). No host sync (CUDA-graph safe); a
  sequence of length 0 gives zeros. Splits past n_closed[b] load nothing (the out-of-bounds split-K bug elsewhere).

Decode attention keeps fp32 partials (tf32x3 dots on CUDA); the Hadamard matrix is cached per (D, device), so the
first call must not be inside a CUDA-graph capture.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qconv_vllm.kvarn_triton import check_shape, field_args, hadamard, unpack_codes, use_libdevice


@triton.jit
def _online(sc, m, den):
    """Online-softmax step for scores sc [BQ, T]: (new max, rescale of the old sums, probabilities, new den)."""
    m_new = tl.maximum(m, tl.max(sc, 1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(sc - m_new[:, None])
    return m_new, alpha, p, den * alpha + tl.sum(p, 1)


@triton.jit
def _exact_tile(q, k_ptr, v_ptr, n, m, den, acc, scale, D: tl.constexpr, BG: tl.constexpr, PREC: tl.constexpr):
    """One fp16 tile (sink or tile being filled) with n valid tokens, natural domain, into acc, BG tokens a step."""
    d = tl.arange(0, D)
    for j in range(0, tl.cdiv(n, BG)):
        g = j * BG + tl.arange(0, BG)
        valid = g < n
        offs = g[:, None] * D + d[None, :]
        k = tl.load(k_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        sc = tl.where(valid[None, :], tl.dot(q, tl.trans(k), input_precision=PREC) * scale, float("-inf"))
        m, alpha, p, den = _online(sc, m, den)
        v = tl.load(v_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PREC)
    return m, den, acc


@triton.jit
def _decode_kernel(
    q_ptr,
    qr_ptr,
    pool_ptr,
    pool16_ptr,
    bt_ptr,
    nc_ptr,
    sk_ptr,
    sv_ptr,
    sink_ptr,
    cur_ptr,
    m_ptr,
    den_ptr,
    accn_ptr,
    accr_ptr,
    scale,
    max_blocks,
    S,
    TPS,
    HKV: tl.constexpr,
    GQ: tl.constexpr,
    BQ: tl.constexpr,
    BG: tl.constexpr,
    PREC: tl.constexpr,
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
    """Program (sequence b, KV head h, split s): the GQ query heads of h over split s's quantized tiles; split 0
    also takes the exact sink and tile being filled. Writes unnormalized partials (m, den, acc natural, acc rotated).
    Tiles go BG tokens a step so no dot operand outgrows shared memory (a [256, 128] fp32 one would, at D=256)."""
    b, h, s = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), tl.program_id(2)
    qi, d = tl.arange(0, BQ), tl.arange(0, D)
    qmask = qi < GQ
    qoffs = (b * HKV * GQ + h * GQ + qi)[:, None] * D + d[None, :]
    q = tl.load(q_ptr + qoffs, mask=qmask[:, None], other=0.0)
    qr = tl.load(qr_ptr + qoffs, mask=qmask[:, None], other=0.0)
    m = tl.full([BQ], -1e30, tl.float32)  # finite: a split with no token leaves weight exp(-1e30 - M) = 0
    den = tl.zeros([BQ], tl.float32)
    acc_n = tl.zeros([BQ, D], tl.float32)
    acc_r = tl.zeros([BQ, D], tl.float32)
    if s == 0:
        st = ((b * 2) * HKV + h) * G * D
        m, den, acc_n = _exact_tile(
            q, sk_ptr + st, sv_ptr + st, tl.load(sink_ptr + b), m, den, acc_n, scale, D, BG, PREC
        )
        st += HKV * G * D
        m, den, acc_n = _exact_tile(
            q, sk_ptr + st, sv_ptr + st, tl.load(cur_ptr + b), m, den, acc_n, scale, D, BG, PREC
        )
    t_lo = 1 + s * TPS
    t_hi = tl.minimum(t_lo + TPS, tl.load(nc_ptr + b) + 1)  # tiles 1..n_closed only: nothing out of range is read
    for t in range(t_lo, t_hi):
        blk = tl.load(bt_ptr + b * max_blocks + t).to(tl.int64)
        rec, rec16 = pool_ptr + (blk * HKV + h) * RB, pool16_ptr + (blk * HKV + h) * (RB // 2)
        # K~[t, d] = (code a_d + z_d) r_t, rotated: score_t = r_t (sum_d code (qr_d a_d) + qr . z)
        qa = qr * tl.load(rec16 + KA // 2 + d).to(tl.float32)[None, :]
        qz = tl.sum(qr * tl.load(rec16 + KZ // 2 + d).to(tl.float32)[None, :], 1)
        vc = tl.load(rec16 + VCOL // 2 + d).to(tl.float32)
        for j in range(0, G // BG):
            g = j * BG + tl.arange(0, BG)
            sc = tl.dot(qa, unpack_codes(rec + KC, d, g, G, KB), input_precision=PREC) + qz[:, None]
            sc = sc * tl.load(rec16 + KR // 2 + g).to(tl.float32)[None, :] * scale
            m, alpha, p, den = _online(sc, m, den)
            # V~[t, d] = (code a_t + z_t) c_d: sum_t p_t V~[t, d] = c_d (sum_t (p_t a_t) code + p . z)
            pa = p * tl.load(rec16 + VA // 2 + g).to(tl.float32)[None, :]
            pz = tl.sum(p * tl.load(rec16 + VZ // 2 + g).to(tl.float32)[None, :], 1)
            pv = tl.dot(pa, unpack_codes(rec + VC, g, d, D, VB), input_precision=PREC)
            acc_r = acc_r * alpha[:, None] + (pv + pz[:, None]) * vc[None, :]
            acc_n = acc_n * alpha[:, None]  # the exact tiles' sum shares the running max (acc_r was 0 before them)
    row = (b * HKV * GQ + h * GQ + qi) * S + s
    tl.store(m_ptr + row, m, mask=qmask)
    tl.store(den_ptr + row, den, mask=qmask)
    tl.store(accn_ptr + row[:, None] * D + d[None, :], acc_n, mask=qmask[:, None])
    tl.store(accr_ptr + row[:, None] * D + d[None, :], acc_r, mask=qmask[:, None])


def decode_attention(
    q: torch.Tensor,
    pool: torch.Tensor,
    block_table: torch.Tensor,
    n_closed: torch.Tensor,
    stage_k: torch.Tensor,
    stage_v: torch.Tensor,
    sink_len: torch.Tensor,
    cur_len: torch.Tensor,
    k_bits: int,
    v_bits: int,
    G: int,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of one query per sequence over its whole KVarN cache (contract in the module docstring).

    Splits come from block_table's width (a static shape, so no host sync): each takes ceil(width / splits) tiles;
    partials merge here by log-sum-exp, and the rotated V sum is un-rotated once by H."""
    bsz, hq, d = q.shape
    check_shape(d, G, k_bits, v_bits)
    hkv = pool.shape[1]
    a = field_args(d, G, k_bits, v_bits)
    if hq % hkv or pool.shape[2] != a["RB"] or pool.dtype != torch.uint8:
        raise ValueError(
            f"decode_attention: pool must be uint8 [blocks, Hkv, {a['RB']}] with Hq={hq} a multiple of "
            f"Hkv, got {pool.dtype} {tuple(pool.shape)}"
        )
    if stage_k.shape != (bsz, 2, hkv, G, d) or stage_v.shape != stage_k.shape:
        raise ValueError(
            f"decode_attention: stage_k/v must be [{bsz}, 2, {hkv}, {G}, {d}], got "
            f"{tuple(stage_k.shape)} / {tuple(stage_v.shape)}"
        )
    width = block_table.shape[1]
    splits = num_splits or min(64, max(1, -(-width // 8)))
    tps = max(1, -(-width // splits))
    h = hadamard(d, q.device)
    qf = q.float().contiguous()
    gq = hq // hkv
    m = torch.empty(bsz, hq, splits, dtype=torch.float32, device=q.device)
    den, acc_n, acc_r = torch.empty_like(m), m.new_empty(bsz, hq, splits, d), m.new_empty(bsz, hq, splits, d)
    pool = pool.contiguous()
    _decode_kernel[(bsz, hkv, splits)](
        qf,
        (qf @ h).contiguous(),
        pool,
        pool.view(torch.float16),
        block_table.to(torch.int32).contiguous(),
        n_closed.to(torch.int32).contiguous(),
        stage_k.contiguous(),
        stage_v.contiguous(),
        sink_len.to(torch.int32).contiguous(),
        cur_len.to(torch.int32).contiguous(),
        m,
        den,
        acc_n,
        acc_r,
        float(scale),
        width,
        splits,
        tps,
        HKV=hkv,
        GQ=gq,
        BQ=max(16, triton.next_power_of_2(gq)),
        BG=min(G, 8192 // d),
        PREC="ieee" if not use_libdevice() else "tf32x3",
        num_warps=8,
        **a,
    )
    w = torch.exp(m - m.amax(-1, keepdim=True))  # [B, Hq, S]; empty splits weigh 0
    total = (w * den).sum(-1, keepdim=True)
    acc = (w.unsqueeze(-1) * acc_n).sum(-2) + (w.unsqueeze(-1) * acc_r).sum(-2) @ h
    return (acc / total.clamp_min(1e-30)).to(q.dtype)
