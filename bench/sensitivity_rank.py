"""Does the cheap per-layer proxy rank SmolLM2's units like the model-level measure? Prints Spearman, one JSON line.

Model-level: every candidate unit at INT8 (RTN), then each unit alone at 4 bits; score = increase of the mean KLD
of the final logits against the bf16 source on calibration tokens (one forward pass per unit). Proxy: the build's
Fisher-weighted layer error (qconv.calibrate.sensitivity.proxy_scores). Calibration: tinyshakespeare, never wikitext.

    OMP_NUM_THREADS=1 .venv/bin/python bench/sensitivity_rank.py --samples 8 --seq-len 256 --kld-samples 2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qconv.calibrate.data import load_calibration
    from qconv.calibrate.sensitivity import model_kld_scores, proxy_scores, spearman
    from qconv.convert.layout import candidate_units, layout_model
    from qconv.convert.sources import read_config
    from qconv.recipes.recipe import load_recipe

    sys.path.insert(0, str(REPO / "bench"))
    from int8_selection import SHARED, smollm2

    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--kld-samples", type=int, default=2, help="sequences for the model-level measure")
    ap.add_argument("--out", type=Path, default=Path("/tmp/qconv-sensitivity-rank.json"))
    args = ap.parse_args()
    t0 = time.time()
    src = smollm2()
    recipe = load_recipe("3090")
    plan = layout_model(src, read_config(src), recipe)
    units = candidate_units(plan, recipe)
    tok = AutoTokenizer.from_pretrained(src)
    cal = load_calibration(str(SHARED / "tinyshakespeare.txt"), tok, samples=args.samples, seq_len=args.seq_len, seed=0)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    t = time.time()
    proxy = proxy_scores(model, units, cal.input_ids)
    t_proxy = time.time() - t
    t = time.time()
    kld = model_kld_scores(model, units, cal.input_ids[: args.kld_samples])
    t_kld = time.time() - t
    eligible = {u.name for u in units if not u.refusal}
    sub = lambda d: {k: v for k, v in d.items() if k in eligible}  # noqa: E731
    res = {
        "bench": "sensitivity_rank",
        "model": "SmolLM2-135M-Instruct",
        "units": len(units),
        "eligible_int8_units": len(eligible),
        "calibration": f"tinyshakespeare {args.samples}x{args.seq_len}",
        "kld_tokens": kld.tokens,
        "spearman_all": spearman(proxy.values, kld.values),
        "spearman_eligible": spearman(sub(proxy.values), sub(kld.values)),
        "top5_model_level": sorted(kld.values, key=lambda k: -kld.values[k])[:5],
        "top5_proxy": sorted(proxy.values, key=lambda k: -proxy.values[k])[:5],
        "proxy_s": round(t_proxy, 1),
        "model_level_s": round(t_kld, 1),
        "elapsed_s": round(time.time() - t0, 1),
    }
    args.out.write_text(json.dumps({"proxy": proxy.values, "kld": kld.values, "result": res}, indent=1))
    print(json.dumps(res))


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
