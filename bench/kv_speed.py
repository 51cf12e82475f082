"""Quantize + dequantize a whole long-context KV cache through the packed store on this CPU.

Default: the 27B's cache at 128K tokens — 16 full-attention layers x 4 KV heads x 131,072 tokens x D=256, K and V
(8.6 GB as fp16). Layers are written one at a time (heads batched) so the fp16 input never exists all at once;
synthetic K has outlier channels and a per-channel offset, V is Gaussian with varying token scales. Prints one JSON
line: seconds to quantize and to dequantize, stored bytes vs fp16, relative error.

--decode: greedy decoding speed of the runtime (SmolLM2-135M) on a long wikitext prompt with the packed store,
without and with the decoded-tile cache (`decoded_cache_bytes`: reads decode only tiles closed since the last
read). Prints one JSON line: decode tok/s for each, their ratio, and whether the generated tokens are the same.

    .venv/bin/python bench/kv_speed.py [--scheme kvarn_k4v2_g128] [--tokens 131072] [--layers 16] [--threads 1]
    .venv/bin/python bench/kv_speed.py --decode [--scheme kvarn_k4v4_g256] [--prompt-tokens 4096] [--new 32] [--decoded-cache-mb 0,48,all]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def _generate(model, prompt: torch.Tensor, new: int, cache) -> tuple[list[int], float, float]:
    """Greedy: (tokens, prefill seconds, decode tok/s over the new-1 single-token steps)."""
    cache.reset([0])
    t0 = time.perf_counter()
    tok = torch.tensor([[int(model(prompt, cache)[0, -1].argmax())]])
    t1 = time.perf_counter()
    gen = [int(tok)]
    for _ in range(new - 1):
        tok[0, 0] = int(model(tok, cache)[0, -1].argmax())
        gen.append(int(tok))
    return gen, t1 - t0, (new - 1) / (time.perf_counter() - t1)


def decode_speed(a) -> dict:
    """Prefill a.prompt_tokens wikitext tokens, decode a.new tokens: the packed store per decoded-cache budget, and
    the runtime's dense uncompressed cache for reference."""
    from qconv.engine import load_model, load_tokenizer
    from qconv.kv import get_kv_scheme

    model = load_model(a.model, dtype=torch.float32)
    ids = load_tokenizer(a.model)(open(a.text).read()[: a.prompt_tokens * 8], add_special_tokens=False)["input_ids"]
    prompt, max_len = torch.tensor([ids[: a.prompt_tokens]]), a.prompt_tokens + a.new + 1
    runs, tokens = {}, {}
    for mb in a.decoded_cache_mb.split(","):
        cache = model.new_cache(1, max_len, kv_scheme=a.scheme)
        st = cache.kv
        cache.kv = get_kv_scheme(a.scheme).new_store(  # the runtime builds it with the default budget (0)
            layers=len(st.seqs),
            max_batch=1,
            max_len=max_len,
            heads=st.heads,
            head_dim=st.head_dim,
            dtype=st.dtype,
            decoded_cache_bytes=1 << 50 if mb == "all" else int(float(mb) * 2**20),
        )
        tokens[mb], pre, tps = _generate(model, prompt, a.new, cache)
        runs[f"decoded_cache_mb={mb}"] = {
            "prefill_s": round(pre, 1),
            "decode_tok_s": round(tps, 3),
            "kv_bytes": cache.kv.nbytes,
            "decoded_cache_bytes": cache.kv.decoded_nbytes,
        }
    dense = model.new_cache(1, max_len, kv_scheme="none")
    gen, pre, tps = _generate(model, prompt, a.new, dense)
    runs["dense_fp32_cache"] = {
        "prefill_s": round(pre, 1),
        "decode_tok_s": round(tps, 3),
        "kv_bytes": sum(x.numel() * x.element_size() for x in dense.kv.k + dense.kv.v),
    }
    first = tokens[next(iter(tokens))]
    return {
        "bench": "kv_decode_speed",
        "scheme": a.scheme,
        "prompt_tokens": a.prompt_tokens,
        "new_tokens": a.new,
        "threads": a.threads,
        "runs": runs,
        "same_tokens_across_budgets": all(t == first for t in tokens.values()),
        "dense_same_tokens": gen == first,
    }


def _now(device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter()


def main() -> None:
    from qconv.kv import get_kv_scheme
    from qconv.kv.store import PackedKV

    ap = argparse.ArgumentParser()
    ap.add_argument("--decode", action="store_true", help="measure runtime decode tok/s, decoded-tile cache off/on")
    ap.add_argument("--model", default=str(REPO / ".cache/models/smollm2-135m-instruct"))
    ap.add_argument("--text", default=str(REPO.parent / "shared/data/wikitext-2-raw-test.txt"))
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--decoded-cache-mb", default="0,48,all", help="budgets for --decode ('all': every tile)")
    ap.add_argument("--scheme", default="kvarn_k4v2_g128")
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="where the cache lives and is (de)quantized, e.g. cuda")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.decode:
        print(json.dumps(decode_speed(a)))
        return
    s = get_kv_scheme(a.scheme)
    t_q = t_dq = 0.0
    stored = err_k = err_v = 0.0
    g = torch.Generator().manual_seed(0)
    for _ in range(a.layers):
        shape = (a.heads, a.tokens, a.head_dim)
        outl = torch.where(torch.rand(a.heads, 1, a.head_dim, generator=g) < 0.03, 10.0, 1.0)
        k = (torch.randn(*shape, generator=g) * outl + torch.randn(a.heads, 1, a.head_dim, generator=g)).half()
        v = (torch.randn(*shape, generator=g) * torch.rand(a.heads, a.tokens, 1, generator=g).add_(0.5)).half()
        k, v = k.to(a.device), v.to(a.device)
        store = PackedKV(s, a.head_dim)
        t0 = _now(a.device)
        store.append(k, v)
        t1 = _now(a.device)
        kd, vd = store.dequantize(torch.float16)
        t2 = _now(a.device)
        t_q, t_dq, stored = t_q + t1 - t0, t_dq + t2 - t1, stored + store.nbytes
        err_k += float((kd.float() - k.float()).pow(2).mean() / k.float().pow(2).mean()) / a.layers
        err_v += float((vd.float() - v.float()).pow(2).mean() / v.float().pow(2).mean()) / a.layers
        del k, v, kd, vd, store
    fp16 = a.layers * a.heads * a.tokens * a.head_dim * 2 * 2
    print(
        json.dumps(
            {
                "bench": "kv_speed",
                "scheme": a.scheme,
                "layers": a.layers,
                "heads": a.heads,
                "tokens": a.tokens,
                "head_dim": a.head_dim,
                "threads": a.threads,
                "cpu": platform.machine(),
                "device": a.device,
                "quantize_s": round(t_q, 1),
                "dequantize_s": round(t_dq, 1),
                "quantize_head_tokens_per_s": round(a.layers * a.heads * a.tokens / t_q),
                "stored_bytes": int(stored),
                "fp16_bytes": fp16,
                "ratio_vs_fp16": round(fp16 / stored, 3),
                "rel_mse_k": round(err_k, 5),
                "rel_mse_v": round(err_v, 5),
            }
        )
    )


if __name__ == "__main__":
    main()
