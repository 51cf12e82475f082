"""KV-cache quality on SmolLM2-135M (head_dim 64): KLD(unquantized-KV model || quantized-KV model) per scheme.

Weights stay fp32; only the cache is simulated (qconv.eval.kvsim: every attention layer attends over the scheme's
dequantized K/V). Prefill semantics: each window runs as one forward, so every full tile is quantized before any
query reads it — pessimistic next to decoding, where a query's own tile is still fp16. Scored: the second half of
each window (llama.cpp's convention). Prints one JSON line.

    .venv/bin/python bench/kv_quality.py [--windows 4] [--window 2048] [--schemes a,b,...] [--threads 1]
    (--schemes may include int4_g32+sinkN, e.g. int4_g32+sink128: the int4 baseline with an exact fp16 sink of
    N tokens like KVarN's, an ablation)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SINK_ABLATION = "int4_g32+sink"  # + N: int4_g32 with KVarN's fp16 first N tokens: is the win only the sink?


def _sink_ablation(name: str):
    from dataclasses import dataclass

    from qconv.kv.baselines import IntGroup

    sink = int(name.removeprefix(SINK_ABLATION))

    @dataclass(frozen=True)
    class Int4Sink(IntGroup):
        def split(self, tokens):
            n = min(tokens, sink)
            return n, tokens - n, 0

    return Int4Sink(name, bits=4, group=32)


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qconv.eval.kvsim import SimulatedKV, kv_simulation
    from qconv.kv import KV_SCHEME_NAMES, get_kv_scheme

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(REPO / ".cache/models/smollm2-135m-instruct"))
    ap.add_argument("--text", default=str(REPO.parent / "shared/data/wikitext-2-raw-test.txt"))
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--schemes", default=",".join(KV_SCHEME_NAMES))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--kv-form",
        choices=["decode", "prefill"],
        default="decode",
        help="the runtime's decode-time tiles, or every full tile quantized (pessimistic)",
    )
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    head_dim = (
        model.config.head_dim
        if getattr(model.config, "head_dim", None)
        else model.config.hidden_size // model.config.num_attention_heads
    )
    ids = tok(Path(a.text).read_text(), add_special_tokens=False)["input_ids"]
    # windows spread over the whole test set, not only its first article
    n_avail = len(ids) // a.window
    picks = [round(i * (n_avail - 1) / max(1, a.windows - 1)) for i in range(a.windows)]
    windows = [ids[p * a.window : (p + 1) * a.window] for p in picks]
    first = a.window // 2
    names = a.schemes.split(",")

    def scheme(n):
        return _sink_ablation(n) if n.startswith(SINK_ABLATION) else get_kv_scheme(n)

    acc = {n: {"kld": [], "agree": [], "nll": []} for n in names}
    ref_nll = []

    @torch.inference_mode()
    def logp(x):  # logits of positions first-1 .. len-2 only (they predict the scored tokens)
        logits = model(input_ids=x, use_cache=False, logits_to_keep=x.shape[1] - first + 1).logits
        return torch.log_softmax(logits[0, :-1].float(), -1)

    for wi, w in enumerate(windows):
        x = torch.tensor([w])
        target = x[0, first:]
        lp = logp(x)
        ref_nll.append(-lp.gather(-1, target[:, None])[:, 0])
        for n in names:
            with kv_simulation(model, SimulatedKV(scheme(n), a.kv_form)):
                lq = logp(x)
            acc[n]["kld"].append((lp.exp() * (lp - lq)).sum(-1))
            acc[n]["agree"].append((lp.argmax(-1) == lq.argmax(-1)).float())
            acc[n]["nll"].append(-lq.gather(-1, target[:, None])[:, 0])
            print(
                f"window {wi} {n}: mean KLD {float(acc[n]['kld'][-1].mean()):.5f} ({time.time() - t0:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    ref_ppl = math.exp(float(torch.cat(ref_nll).mean()))
    out = {
        "bench": "kv_quality",
        "model": Path(a.model).name,
        "head_dim": head_dim,
        "window": a.window,
        "windows": len(windows),
        "scored_tokens": len(windows) * (a.window - first),
        "ref_ppl": round(ref_ppl, 4),
        "schemes": {},
    }
    for n in names:
        s = scheme(n)
        kld = torch.cat(acc[n]["kld"]).double()
        out["schemes"][n] = {
            "bits_per_element": round(s.bits_per_element(head_dim), 4),
            "bits_at_window": round(8 * s.stored_bytes_per_head(a.window, head_dim) / (2 * head_dim * a.window), 4),
            "mean_kld": float(kld.mean()),
            "se_kld": float(kld.std() / math.sqrt(len(kld))),
            "median_kld": float(kld.median()),
            "p99_kld": float(kld.quantile(0.99)),
            "max_kld": float(kld.max()),
            "top1": float(torch.cat(acc[n]["agree"]).mean()),
            "ppl_ratio": math.exp(float(torch.cat(acc[n]["nll"]).mean())) / ref_ppl,
        }
    out["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
