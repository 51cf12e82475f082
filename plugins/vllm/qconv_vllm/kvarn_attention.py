"""Triton attention over a KVarN cache for every batch shape vLLM sends (decodes, spec-decode verifies, chunked
prefills, mixed), on the records and device helpers of kvarn_triton.py; pure functions over tensors like it.

attention(q, pool, block_table, seq_lens, query_start, ex_k, ex_v, ex_pos, ex_start, k_bits, v_bits, G, scale,
  num_splits=None) -> [T, Hq, D] in q's dtype. Request b's queries are rows query_start[b]..query_start[b+1] of q, at
  positions seq_lens[b] - its query count onwards. A query at position p reads (decode form, what token-by-token
  decoding would read): tile t >= 1 of its sequence from its record in pool (block block_table[b, t]) once the tile
  closed at or before p, i.e. (t + 1) G - 1 <= p and t <= seq_lens[b] // G - 1; every other token j <= p from the
  exact run, fp16/fp32 K/V [Hkv, E, D] (natural domain) at positions ex_pos[ex_start[b]:ex_start[b + 1]]: the
  sink and every token of a tile still open at p (the caller lists them; listing more is harmless, they are masked).

Programs are (block of BT query tokens x the GQ query heads of one KV head, KV head, split); a program finds its
request by binary search over query_start (as vLLM's Triton backend does), so the grid depends on shapes only:
no host sync, CUDA-graph safe. Extra memory, all proportional to the batch's query tokens T, never to the context:
`work_bytes`. Scores use the rotated query against the rotated records (no dequantized copy) and the exact run is
rotated once here, so one accumulator serves both; the output is un-rotated by H after the log-sum-exp merge.
The Hadamard matrix is cached per (D, device), so the first call must not be inside a CUDA-graph capture.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qconv_vllm.kvarn_triton import check_shape, field_args, hadamard, unpack_codes, use_libdevice

ROWS = 16  # rows (query token x query head) of a program: tl.dot's minimum M, the smallest register footprint
SPLIT_ROWS = 1024  # split-K partial rows (query token x split) per batch at most: bounds the partials
MAX_SPLITS = 64


def tokens_per_program(gq: int) -> int:
    return max(1, ROWS // gq)


def num_splits(tokens: int, width: int) -> int:
    """Split-K count for `tokens` query tokens over a block table `width` tiles wide (shapes only: no sync)."""
    return max(1, min(MAX_SPLITS, -(-width // 8), SPLIT_ROWS // max(tokens, 1)))


def work_bytes(tokens: int, seqs: int, hq: int, hkv: int, d: int, g: int) -> int:
    """Most bytes one `attention` call allocates for `tokens` query tokens of `seqs` requests, whatever the
    context: the rotated query and output (T Hq D fp32 each, twice for the merge), the split-K partials
    (max(T, SPLIT_ROWS) Hq (D + 2) fp32) and the rotated exact run (at most T + 2 G tokens a request: its new
    tokens, the sink and the head of the open tile; K and V, fp32, plus an int32 position)."""
    partial_rows = max(tokens, SPLIT_ROWS)
    exact = tokens + 2 * g * seqs
    return 4 * (4 * tokens * hq * d + partial_rows * hq * (d + 2) + exact * (2 * hkv * d + 1))


@triton.jit
def _online(sc, m, den):
    """Online-softmax step for scores sc [BQ, T]: (new max, rescale of the old sums, probabilities, new den)."""
    m_new = tl.maximum(m, tl.max(sc, 1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(sc - m_new[:, None])
    return m_new, alpha, p, den * alpha + tl.sum(p, 1)


@triton.jit
def _dot_exact_b(a, b, PREC: tl.constexpr):
    """a @ b for fp32 a and a b that tf32 holds exactly (codes, small integers): two tf32 MMAs, a split into its
    top 11 significant bits and the rest (relative error ~2^-21, as tf32x3's three). "ieee" where it is asked."""
    if PREC == "ieee":
        return tl.dot(a, b, input_precision="ieee")
    else:
        hi = (a.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
        return tl.dot(hi, b, input_precision="tf32") + tl.dot(a - hi, b, input_precision="tf32")


@triton.jit
def _find_request(qs_ptr, pid, nreq, BT: tl.constexpr):
    """The request whose program blocks hold program `pid`: request b owns blocks qs[b] // BT + b onwards."""
    lo = 0
    hi = nreq
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(qs_ptr + mid) // BT + mid <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attn_kernel(
    q_ptr,
    pool_ptr,
    pool16_ptr,
    bt_ptr,
    lens_ptr,
    qs_ptr,
    ek_ptr,
    ev_ptr,
    epos_ptr,
    es_ptr,
    m_ptr,
    den_ptr,
    acc_ptr,
    scale,
    max_blocks,
    E,
    nreq,
    S,
    TPS,
    HKV: tl.constexpr,
    GQ: tl.constexpr,
    BT: tl.constexpr,
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
    """Program (token block, KV head h, split s): rows = BT query tokens x GQ heads of h, over split s's closed
    tiles; split 0 also takes the exact run. Writes unnormalized partials (m, den, acc) in the rotated domain.
    Tiles go BG tokens a step so no dot operand outgrows shared memory."""
    pid, h, s = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    b = _find_request(qs_ptr, pid, nreq, BT)
    q0, q1 = tl.load(qs_ptr + b), tl.load(qs_ptr + b + 1)
    length = tl.load(lens_ptr + b)
    r, d = tl.arange(0, BQ), tl.arange(0, D)
    tok = q0 + (pid - q0 // BT - b) * BT + r // GQ
    valid = (r < BT * GQ) & (tok < q1)
    pos = length - q1 + tok  # position of each row's query
    qrow = tok.to(tl.int64) * (HKV * GQ) + h * GQ + r % GQ
    q = tl.load(q_ptr + qrow[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
    pmax = tl.max(tl.where(valid, pos, -1), 0)
    m = tl.full([BQ], -1e30, tl.float32)  # finite: a split with no token leaves weight exp(-1e30 - M) = 0
    den = tl.zeros([BQ], tl.float32)
    acc = tl.zeros([BQ, D], tl.float32)
    if s == 0:
        e0, e1 = tl.load(es_ptr + b), tl.load(es_ptr + b + 1)
        for j in range(0, tl.cdiv(e1 - e0, BG)):
            e = e0 + j * BG + tl.arange(0, BG)
            ok = e < e1
            kp = tl.load(epos_ptr + e, mask=ok, other=0)
            open_at = (kp < G) | ((kp // G + 1) * G - 1 > pos[:, None])  # sink, or its tile still open at p
            seen = ok[None, :] & (kp[None, :] <= pos[:, None]) & open_at
            offs = (h * E + e)[:, None] * D + d[None, :]
            k = tl.load(ek_ptr + offs, mask=ok[:, None], other=0.0)
            sc = tl.where(seen, tl.dot(q, tl.trans(k), input_precision=PREC) * scale, float("-inf"))
            m, alpha, p, den = _online(sc, m, den)
            v = tl.load(ev_ptr + offs, mask=ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PREC)
    t_lo = 1 + s * TPS
    # tiles 1..n_closed that closed by the last query of the block: nothing out of range is read
    t_hi = tl.minimum(tl.minimum(t_lo + TPS, tl.maximum(length // G - 1, 0) + 1), (pmax + 1) // G)
    for t in range(t_lo, t_hi):
        blk = tl.load(bt_ptr + b * max_blocks + t).to(tl.int64)
        rec, rec16 = pool_ptr + (blk * HKV + h) * RB, pool16_ptr + (blk * HKV + h) * (RB // 2)
        closed = (t + 1) * G - 1 <= pos  # rows that read this tile's record
        # K~[t, d] = (code a_d + z_d) r_t, rotated: score_t = r_t (sum_d code (q_d a_d) + q . z)
        qa = q * tl.load(rec16 + KA // 2 + d).to(tl.float32)[None, :]
        qz = tl.sum(q * tl.load(rec16 + KZ // 2 + d).to(tl.float32)[None, :], 1)
        vc = tl.load(rec16 + VCOL // 2 + d).to(tl.float32)
        for j in range(0, G // BG):
            g = j * BG + tl.arange(0, BG)
            sc = _dot_exact_b(qa, unpack_codes(rec + KC, d, g, G, KB), PREC) + qz[:, None]
            sc = sc * tl.load(rec16 + KR // 2 + g).to(tl.float32)[None, :] * scale
            m, alpha, p, den = _online(tl.where(closed[:, None], sc, float("-inf")), m, den)
            # V~[t, d] = (code a_t + z_t) c_d: sum_t p_t V~[t, d] = c_d (sum_t (p_t a_t) code + p . z)
            pa = p * tl.load(rec16 + VA // 2 + g).to(tl.float32)[None, :]
            pz = tl.sum(p * tl.load(rec16 + VZ // 2 + g).to(tl.float32)[None, :], 1)
            pv = _dot_exact_b(pa, unpack_codes(rec + VC, g, d, D, VB), PREC)
            acc = acc * alpha[:, None] + (pv + pz[:, None]) * vc[None, :]
    row = qrow * S + s
    tl.store(m_ptr + row, m, mask=valid)
    tl.store(den_ptr + row, den, mask=valid)
    tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=valid[:, None])


def launch_args(d: int, g: int, k_bits: int, v_bits: int, hkv: int, gq: int, arch: int | None = None) -> dict:
    """_attn_kernel's constexprs and launch options for compute capability `arch` (86 = RTX 3090), as `attention`
    passes them and the compile test compiles them. At D=256 (ptxas, tests/test_kvarn_triton_compile.py): 32 keys a
    step took 168 KB of shared memory and spilled on sm_86, so BG = 4096 / D keys a step (16), with the two-MMA dots
    on codes (tf32x3 everywhere still spilled 360 B). Pipeline stages: 3 take 100,480 B of shared memory, 896 B under
    an RTX 3090's 101,376; 2 take 67,648 B, no spills, so Ampere gets 2; sm_90a keeps 3 (2 spill there)."""
    bt = tokens_per_program(gq)
    return dict(
        field_args(d, g, k_bits, v_bits),
        HKV=hkv,
        GQ=gq,
        BT=bt,
        BQ=max(16, triton.next_power_of_2(bt * gq)),
        BG=min(g, 4096 // d if use_libdevice() else 64),  # interpreted: 64 (its cost is per op, not per element)
        PREC="ieee" if not use_libdevice() else "tf32x3",
        num_warps=8,
        num_stages=2 if arch is not None and arch < 90 else 3,
    )


def attention(
    q: torch.Tensor,
    pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start: torch.Tensor,
    ex_k: torch.Tensor,
    ex_v: torch.Tensor,
    ex_pos: torch.Tensor,
    ex_start: torch.Tensor,
    k_bits: int,
    v_bits: int,
    G: int,
    scale: float,
    num_splits_: int | None = None,
) -> torch.Tensor:
    """Decode-form attention of every query of the batch over its KVarN cache (contract in the module docstring)."""
    t, hq, d = q.shape
    check_shape(d, G, k_bits, v_bits)
    hkv, nreq = pool.shape[1], seq_lens.shape[0]
    cc = torch.cuda.get_device_capability(q.device) if q.is_cuda else None  # cached by torch: no device work
    a = launch_args(d, G, k_bits, v_bits, hkv, hq // max(hkv, 1), cc[0] * 10 + cc[1] if cc else None)
    if hq % hkv or pool.shape[2] != a["RB"] or pool.dtype != torch.uint8:
        raise ValueError(
            f"attention: pool must be uint8 [blocks, Hkv, {a['RB']}] with Hq={hq} a multiple of "
            f"Hkv, got {pool.dtype} {tuple(pool.shape)}"
        )
    if ex_k.shape != ex_v.shape or ex_k.shape[::2] != (hkv, d) or ex_pos.shape != ex_k.shape[1:2]:
        raise ValueError(
            f"attention: ex_k/ex_v must be [{hkv}, E, {d}] with ex_pos [E], got {tuple(ex_k.shape)} / "
            f"{tuple(ex_v.shape)} / {tuple(ex_pos.shape)}"
        )
    if query_start.shape != (nreq + 1,) or ex_start.shape != (nreq + 1,):
        raise ValueError(f"attention: query_start and ex_start must have {nreq + 1} entries (seq_lens has {nreq})")
    width = block_table.shape[1]
    splits = num_splits_ or num_splits(t, width)
    tps = max(1, -(-width // splits))
    h = hadamard(d, q.device)
    qr = (q.float() @ h).contiguous()
    m = torch.empty(t, hq, splits, dtype=torch.float32, device=q.device)
    den, acc = torch.empty_like(m), m.new_empty(t, hq, splits, d)
    pool = pool.contiguous()
    if t and nreq:
        _attn_kernel[(t // a["BT"] + nreq, hkv, splits)](
            qr,
            pool,
            pool.view(torch.float16),
            block_table.to(torch.int32).contiguous(),
            seq_lens.to(torch.int32).contiguous(),
            query_start.to(torch.int32).contiguous(),
            (ex_k.float() @ h).contiguous(),
            (ex_v.float() @ h).contiguous(),
            ex_pos.to(torch.int32).contiguous(),
            ex_start.to(torch.int32).contiguous(),
            m,
            den,
            acc,
            float(scale),
            width,
            ex_k.shape[1],
            nreq,
            splits,
            tps,
            **a,
        )
    w = torch.exp(m - m.amax(-1, keepdim=True))  # [T, Hq, S]; empty splits weigh 0
    total = (w * den).sum(-1, keepdim=True)
    out = torch.einsum("ths,thsd->thd", w, acc) / total.clamp_min(1e-30)
    return (out @ h).to(q.dtype)
