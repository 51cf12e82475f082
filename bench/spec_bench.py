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
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--fixed-blocks", action="store_true", help="verify every block in full (no adaptive trimming)")
    ap.add_argument("--tree-nodes", type=int, default=63, help="0 = one linear draft chain per step")
    ap.add_argument("--tolerance", type=float, default=GenerationConfig.tolerance,
                    help="verify the largest draft whose expected speed is within this of the best one's")
    ap.add_argument("--no-aliases", action="store_true", help="lookup matches exact tokens only")
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--history", type=int, default=None, metavar="N",
                    help="cross-request history: token trees also draft from N other prompts' outputs (not "
                         "measured) and from the earlier measured prompts")
    ap.add_argument("--dequantize", action="store_true",
                    help="artifact: dense weights (float32, or bf16 with --dtype bfloat16) instead of the int kernels")
    ap.add_argument("--device", default=None, help="run our engine on this device (e.g. cuda)")
    ap.add_argument("--no-text-lookup", action="store_true", help="no lookup on normalized text")
    ap.add_argument("--datastore", nargs="+", default=None, metavar="PATH",
                    help="retrieval drafting: token trees also draft from these files/folders (e.g. a stdlib)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                    help="both engines' dtype (default: the CLI's, float32 for a plain folder)")
    a = ap.parse_args()
    out = {"bench": "runtime_spec", "model": a.model, "adaptive": not a.fixed_blocks,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "workloads": {}}
    for w in a.workloads.split(","):
        cfg = GenerationConfig(max_tokens=a.max_tokens, spec=a.spec, adaptive=not a.fixed_blocks,
                               tree_nodes=a.tree_nodes, tolerance=a.tolerance)
        r = run_bench(a.model, w, Path(a.data) / FILES[w], prompts=a.prompts, cfg=cfg,
                      compare_transformers=not a.no_transformers, threads=a.threads, aliases=not a.no_aliases,
                      text_lookup=not a.no_text_lookup, dequantize=a.dequantize, device=a.device,
                      history=a.history, datastore=a.datastore, dtype=a.dtype)
        out["workloads"][w] = r
        print(json.dumps({w: r}), file=sys.stderr, flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
