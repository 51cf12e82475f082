"""Quality table on SmolLM2-135M-Instruct: RTN W4, GPTQ W4, the 3090 recipe, llama.cpp Q4_0 and Q4_K_M, all
measured by the same code (qconv.eval.measure.measure) against the same cached reference.

    .venv/bin/python bench/quality_table.py [--max-tokens 8192] [--window 2048] [--work .cache/eval] [--text FILE]

Group size: 128 where it divides a layer's in_features (down_proj, 1536), else 64 (576-wide inputs). Embeddings
(tied with lm_head) stay bf16 in the RTN/GPTQ rows; the 3090 row has INT8 embeddings/lm_head. GPTQ and the 3090
build calibrate on tinyshakespeare, never on wikitext. Prints the table, then one JSON line.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from qconv_cmd import QCONV, build_args  # noqa: E402  (bench/ is on sys.path: this script runs as bench/quality_table.py)

DATA = REPO.parent / "shared" / "data"


def gguf_quantize(src: Path, dst: Path, ftype_name: str) -> Path:
    import llama_cpp

    if not dst.is_file():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype_name}")
        params.allow_requantize = True
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize {ftype_name} failed: {rc}")
    return dst


def gguf_tensor_bytes(path: Path) -> int:
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors)


def build_recipe(src: Path, out: Path, recipe: str = "3090", extra: tuple[str, ...] = ()) -> Path | None:
    if (out / "qconv.json").is_file():
        return out
    cal = ("--dataset", DATA / "tinyshakespeare.txt", "--samples", 32, "--seq-len", 512)
    cmd = [*QCONV, *build_args(recipe, src, out, *cal, "--force", "--no-gates", *extra)]
    r = subprocess.run(cmd, cwd=REPO)
    return out if r.returncode == 0 and (out / "qconv.json").is_file() else None


def plain_text(path: Path, work: Path) -> Path:
    """A .jsonl file of records without a `text` field as plain text (each record's strings, one per line)."""
    if path.suffix != ".jsonl":
        return path
    out = work / f"{path.stem}.txt"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    out.write_text("\n\n".join("\n".join(v for v in r.values() if isinstance(v, str)) for r in records))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--work", type=Path, default=REPO / ".cache" / "eval")
    ap.add_argument(
        "--text",
        type=Path,
        default=DATA / "wikitext-2-raw-test.txt",
        help="held-out text; a .jsonl file (e.g. gsm8k_test.jsonl) is scored as its records' string "
        "fields joined (question, then answer), one record after another",
    )
    ap.add_argument("--rows", default="rtn,gptq,3090,q4_0,q4_k_m")
    ap.add_argument(
        "--recipe-row",
        action="append",
        default=[],
        metavar="NAME=RECIPE[,BUILD_ARG...]",
        help="an extra row: `qconv build --recipe RECIPE` (a name or YAML path) with these build args, "
        "e.g. bpw617=3090,--bpw,6.17; name it in --rows",
    )
    args = ap.parse_args()

    from qconv.convert.gguf import import_gguf
    from qconv.convert.sources import import_cached, source_files
    from qconv.eval.measure import Source, measure, safetensors_stats
    from qconv.eval.metrics import format_llamacpp
    from qconv.eval.record import EvalSettings
    from qconv.fsutil import sha256_json
    from qconv.paths import embedded_gguf
    from tests.eval_helpers import make_w4_artifact

    gguf = embedded_gguf()
    cached = REPO / ".cache" / "models" / "smollm2-135m-instruct"  # the tests' import of the same GGUF
    src = cached if (cached / "config.json").is_file() else import_cached(gguf)
    n_params = safetensors_stats(src)[0]
    source = Source(path=src, sha256=sha256_json(source_files(src)), num_parameters=n_params)
    w = args.work
    w.mkdir(parents=True, exist_ok=True)
    settings = EvalSettings(text=str(plain_text(args.text, w)), window=args.window, max_tokens=args.max_tokens)
    makers = {
        "rtn": (
            "RTN W4A16 sym g128/64",
            lambda: (
                make_w4_artifact(src, w / "smollm2-rtn-w4", algorithm="rtn")
                if not (w / "smollm2-rtn-w4" / "qconv.json").is_file()
                else w / "smollm2-rtn-w4"
            ),
            None,
        ),
        "rtn_zp": (
            "RTN W4A16 zero points g128/64",
            lambda: (
                make_w4_artifact(src, w / "smollm2-rtn-zp-w4", algorithm="rtn", symmetric=False)
                if not (w / "smollm2-rtn-zp-w4" / "qconv.json").is_file()
                else w / "smollm2-rtn-zp-w4"
            ),
            None,
        ),
        "gptq": (
            "GPTQ W4A16 sym g128/64",
            lambda: (
                make_w4_artifact(
                    src,
                    w / "smollm2-gptq-w4",
                    algorithm="gptq",
                    calib_text=DATA / "tinyshakespeare.txt",
                    samples=32,
                    seq_len=512,
                )
                if not (w / "smollm2-gptq-w4" / "qconv.json").is_file()
                else w / "smollm2-gptq-w4"
            ),
            None,
        ),
        "3090": ("qconv 3090 recipe", lambda: build_recipe(gguf, w / "smollm2-3090"), None),
    }
    for spec in args.recipe_row:
        name, _, rest = spec.partition("=")
        recipe, *extra = rest.split(",")
        makers[name] = (
            f"qconv {Path(recipe).stem} {' '.join(extra)}".strip(),
            lambda name=name, recipe=recipe, extra=tuple(extra): build_recipe(
                gguf, w / f"smollm2-{name}", recipe, extra
            ),
            None,
        )
    for ft in ("Q4_0", "Q4_K_M"):
        q = w / f"smollm2-{ft}.gguf"
        makers[ft.lower()] = (
            f"llama.cpp {ft}",
            lambda ft=ft, q=q: (
                gguf_quantize(gguf, q, ft),
                import_gguf(q, w / f"smollm2-{ft}-hf", force=True)
                if not (w / f"smollm2-{ft}-hf" / "config.json").is_file()
                else w / f"smollm2-{ft}-hf",
            )[1],
            q,
        )

    rows = []
    for key in args.rows.split(","):
        label, make, gguf_file = makers[key]
        t0 = time.time()
        art = make()
        if art is None:
            rows.append({"row": key, "label": label, "error": "build failed"})
            continue
        report, _ = measure(art, source, settings)
        bpw = 8 * gguf_tensor_bytes(gguf_file) / n_params if gguf_file else report.bits_per_weight
        s = report.weights
        rows.append(
            {
                "row": key,
                "label": label,
                "bpw": round(bpw, 3),
                "kld_mean": s.kld_mean,
                "kld_se": s.kld_se,
                "kld_p99": s.kld_p99,
                "top1": s.top1,
                "ppl_base": s.ppl_base,
                "ppl_q": s.ppl_q,
                "ln_ppl_ratio": s.ln_ppl_ratio,
                "tokens": s.tokens,
                "seconds": round(time.time() - t0, 1),
            }
        )
        print(f"\n### {label}\n{format_llamacpp(s)}", flush=True)

    print("\n| row | bpw | mean KLD | p99 KLD | same top | PPL base | PPL Q | ln(PPL_Q/PPL_base) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['label']} | {r['error']} |")
        else:
            print(
                f"| {r['label']} | {r['bpw']:.2f} | {r['kld_mean']:.4f} ± {r['kld_se']:.4f} | {r['kld_p99']:.3f} | "
                f"{100 * r['top1']:.1f}% | {r['ppl_base']:.2f} | {r['ppl_q']:.2f} | {r['ln_ppl_ratio']:.4f} |"
            )
    by = {r["row"]: r for r in rows if "error" not in r}
    if "rtn" in by and "gptq" in by:
        print(f"GPTQ mean KLD < RTN mean KLD: {by['gptq']['kld_mean'] < by['rtn']['kld_mean']}")
    print(
        json.dumps(
            {
                "bench": "quality_table",
                "text": str(args.text),
                "tokens": args.max_tokens,
                "window": args.window,
                "reference": str(src),
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
