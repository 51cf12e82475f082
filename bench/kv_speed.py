"""Quantize + dequantize a whole long-context KV cache through the packed store on this CPU.

Default: the 27B's cache at 128K tokens — 16 full-attention layers x 4 KV heads x 131,072 tokens x D=256, K and V
(8.6 GB as fp16). Layers are written one at a time (heads batched) so the fp16 input never exists all at once;
synthetic K has outlier channels and a per-channel offset, V is Gaussian with varying token scales. Prints one JSON
line: seconds to quantize and to dequantize, stored bytes vs fp16, relative error.

    .venv/bin/python bench/kv_speed.py [--scheme kvarn_k4v2_g128] [--tokens 131072] [--layers 16] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch


def main() -> None:
    from qconv.kv import get_kv_scheme
    from qconv.kv.store import PackedKV

    ap = argparse.ArgumentParser()
    ap.add_argument("--scheme", default="kvarn_k4v2_g128")
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    s = get_kv_scheme(a.scheme)
    t_q = t_dq = 0.0
    stored = err_k = err_v = 0.0
    g = torch.Generator().manual_seed(0)
    for _ in range(a.layers):
        shape = (a.heads, a.tokens, a.head_dim)
        outl = torch.where(torch.rand(a.heads, 1, a.head_dim, generator=g) < 0.03, 10.0, 1.0)
        k = (torch.randn(*shape, generator=g) * outl + torch.randn(a.heads, 1, a.head_dim, generator=g)).half()
        v = (torch.randn(*shape, generator=g) * torch.rand(a.heads, a.tokens, 1, generator=g).add_(0.5)).half()
        store = PackedKV(s, a.head_dim)
        t0 = time.perf_counter()
        store.append(k, v)
        t1 = time.perf_counter()
        kd, vd = store.dequantize(torch.float16)
        t2 = time.perf_counter()
        t_q, t_dq, stored = t_q + t1 - t0, t_dq + t2 - t1, stored + store.nbytes
        err_k += float((kd.float() - k.float()).pow(2).mean() / k.float().pow(2).mean()) / a.layers
        err_v += float((vd.float() - v.float()).pow(2).mean() / v.float().pow(2).mean()) / a.layers
        del k, v, kd, vd, store
    fp16 = a.layers * a.heads * a.tokens * a.head_dim * 2 * 2
    print(json.dumps({
        "bench": "kv_speed", "scheme": a.scheme, "layers": a.layers, "heads": a.heads, "tokens": a.tokens,
        "head_dim": a.head_dim, "threads": a.threads, "cpu": platform.machine(),
        "quantize_s": round(t_q, 1), "dequantize_s": round(t_dq, 1),
        "quantize_head_tokens_per_s": round(a.layers * a.heads * a.tokens / t_q),
        "stored_bytes": int(stored), "fp16_bytes": fp16, "ratio_vs_fp16": round(fp16 / stored, 3),
        "rel_mse_k": round(err_k, 5), "rel_mse_v": round(err_v, 5)}))


if __name__ == "__main__":
    main()
