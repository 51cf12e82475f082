"""Speculative decoding benchmark on SmolLM2 (or any model folder / artifact): per workload, our tokens/step and
speedup over our own plain decode (same run), and transformers' prompt lookup (same weights, prompts, block size)
vs its own greedy. Prints one JSON line.

    .venv/bin/python bench/spec_bench.py --model .cache/models/smollm2-135m-instruct --threads 1
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from qconv.runtime.bench import run_bench  # noqa: E402
from qconv.runtime.generate import GenerationConfig  # noqa: E402
from qconv.runtime.spec import SpecConfig  # noqa: E402

DATA = REPO.parent / "shared" / "data"
FILES = {"copy": "wikitext-2-raw-test.txt", "code": "humaneval.jsonl", "chat": "mt_bench_questions.jsonl",
         "math": "gsm8k_test.jsonl"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(REPO / ".cache" / "models" / "smollm2-135m-instruct"))
    ap.add_argument("--workloads", default="copy,code,chat")
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--spec", default="lookup")
    ap.add_argument("--max-block", type=int, default=15)
    ap.add_argument("--ngram", default="1,4", help="prompt lookup's n-gram range min,max")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--transformers", action="store_true", help="also run transformers' prompt lookup")
    ap.add_argument("--fixed-blocks", action="store_true", help="always draft max-block tokens (no acceptance EMA)")
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--dequantize", action="store_true",
                    help="artifact: dense weights (float32, or bf16 with --dtype bfloat16) instead of the int kernels")
    ap.add_argument("--device", default=None, help="run our engine on this device (e.g. cuda)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                    help="both engines' dtype (default: the CLI's, float32 for a plain folder)")
    a = ap.parse_args()
    lo, hi = (int(x) for x in a.ngram.split(","))
    spec = SpecConfig(a.spec, max_block=a.max_block, ngram_min=lo, ngram_max=hi, adaptive=not a.fixed_blocks)
    out = {"bench": "runtime_spec", "model": a.model, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "workloads": {}}
    for w in a.workloads.split(","):
        r = run_bench(a.model, w, Path(a.data) / FILES[w], prompts=a.prompts,
                      cfg=GenerationConfig(max_tokens=a.max_tokens, spec=spec), compare_transformers=a.transformers,
                      threads=a.threads, dequantize=a.dequantize, device=a.device, dtype=a.dtype, keep_spec=True)
        out["workloads"][w] = r
        print(json.dumps({w: r}), file=sys.stderr, flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
