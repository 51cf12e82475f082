"""How tight is the top-k reference? On SmolLM2 (vocab 49,152, where full log-probs fit), compare the exact mean KLD
of an artifact with the top-k estimate and its stated bound for several k — the same logits, stored both ways.

    .venv/bin/python bench/topk_bound.py [--artifact .cache/eval/smollm2-rtn-w4] [--tokens 4096]

Prints one line per k, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--artifact", type=Path, default=REPO / ".cache" / "eval" / "smollm2-rtn-w4")
    ap.add_argument("--source", type=Path, default=REPO / ".cache" / "models" / "smollm2-135m-instruct")
    ap.add_argument("--text", default=str(REPO.parent / "shared" / "data" / "wikitext-2-raw-test.txt"))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--ks", default="16,64,256,1024")
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer

    from qconv.eval.metrics import TokenStats, summarize
    from qconv.eval.reference import load_causal_lm, ref_window_from_logits, window_logits
    from qconv.eval.text import load_text, make_windows

    ks = [0] + [int(k) for k in args.ks.split(",")]
    windows = make_windows(
        AutoTokenizer.from_pretrained(args.source), load_text(args.text), window=args.window, max_tokens=args.tokens
    )
    src, art = load_causal_lm(args.source), load_causal_lm(args.artifact)
    stats = {k: TokenStats() for k in ks}
    exact_sum, n = 0.0, 0
    for ids in windows.ids:
        base, targets = window_logits(src, ids, 0)
        q, _ = window_logits(art, ids, 0)
        lp, lq = torch.log_softmax(base.double(), -1), torch.log_softmax(q.double(), -1)
        exact_sum, n = exact_sum + (lp.exp() * (lp - lq)).sum().item(), n + len(targets)
        for k in ks:
            stats[k].add(ref_window_from_logits(base, targets, k or None), q, targets)
    rows = []
    exact = exact_sum / n  # float64 from the fp32 logits: no storage at all
    for k in ks:
        s = summarize(stats[k])
        within = s.kld_mean - 1e-5 <= exact <= s.kld_mean + s.kld_bound + 1e-5
        rows.append(
            {
                "k": k or "full-fp16",
                "kld_mean": s.kld_mean,
                "bound": s.kld_bound,
                "exact": exact,
                "error": exact - s.kld_mean,
                "within_bound": within,
            }
        )
        print(
            f"k={k or 'full':>5}: estimate {s.kld_mean:.5f}  stated bound +{s.kld_bound:.5f}  "
            f"exact {exact:.5f}  error {exact - s.kld_mean:+.5f}  within: {within}"
        )
    print(
        json.dumps(
            {
                "bench": "topk_bound",
                "artifact": str(args.artifact),
                "tokens": windows.num_scored,
                "vocab": 49152,
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
