"""Peak RSS and wall time of a streamed 3090 build and a layer-streamed eval at the 27B's real shapes, by depth.

For each depth, a seeded random `qwen3_5_text` model with the widths of ../shared/models/qwen3.8-27b-config (hidden
5120, intermediate 17408, vocab 248,320, its head counts and its 3:1 Gated-DeltaNet:attention pattern) is written
one tensor at a time, then `qconv build --recipe 3090 --stream` and `qconv eval --streamed` run on it, each under
`/usr/bin/time -v` (the OS's own peak RSS). Prints one JSON line: per depth the parameters, bf16 bytes, peak RSS and
wall time of build and eval, the bytes written; across depths the least-squares split of RSS and wall time into a
fixed part and a per-layer part.

Full run (hours on a CPU; depth 8 is 5.6B parameters, ~11 GB bf16):
    OMP_NUM_THREADS=2 .venv/bin/python bench/scale_27b.py --depths 2,4,8 --samples 32 --seq-len 2048 --int8-budget 0.68GiB
Smoke run at narrow widths (every width / 16, vocab 16,384; a minute or two):
    .venv/bin/python bench/scale_27b.py --depths 2 --width-div 16 --vocab 16384 --samples 2 --seq-len 128
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED_CONFIG_27B = REPO.parent / "shared" / "models" / "qwen3.8-27b-config"
# The repo's copy of that config.json travels where ../shared does not (a lent GPU machine: bench/gpu_build.py)
REPO_CONFIG_27B = REPO / "bench" / "data" / "qwen3.8-27b-config"
CONFIG_27B = SHARED_CONFIG_27B if (SHARED_CONFIG_27B / "config.json").is_file() else REPO_CONFIG_27B


def text_config(config_dir: Path, depth: int, width_div: int, vocab: int | None):
    """The 27B's text config at `depth` layers (its layer pattern cut there), widths divided by `width_div`."""
    from transformers import Qwen3_5TextConfig

    sys.path.insert(0, str(REPO))
    from tests.tiny import fit_mrope

    tc = json.loads((config_dir / "config.json").read_text())["text_config"]
    tc = {k: v for k, v in tc.items() if k != "model_type"}
    tc["num_hidden_layers"] = depth
    tc["layer_types"] = tc["layer_types"][:depth]
    tc["mtp_num_hidden_layers"] = 0  # the text model alone: the MTP head is copied, never built
    if width_div > 1:
        for k in ("hidden_size", "intermediate_size", "head_dim", "linear_key_head_dim", "linear_value_head_dim"):
            tc[k] //= width_div
        fit_mrope(tc)
    if vocab:
        tc["vocab_size"] = vocab
    tc.update(
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
        max_position_embeddings=8192,
        architectures=["Qwen3_5ForCausalLM"],
    )
    return Qwen3_5TextConfig(**tc)


def timed(cmd: list[str], log: Path) -> dict:
    """Run under /usr/bin/time -v; peak RSS as the OS accounts it, wall seconds, exit code."""
    t0 = time.time()
    with open(log, "w") as f:
        rc = subprocess.call(
            ["/usr/bin/time", "-v", *cmd],
            cwd=REPO,
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
    wall = time.time() - t0
    text = log.read_text(errors="replace")
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    if rc:
        sys.stderr.write(text[-4000:])
        raise SystemExit(f"{cmd[2:4]} failed with exit code {rc}; log: {log}")
    return {"peak_rss_bytes": int(m.group(1)) * 1024 if m else None, "wall_s": round(wall, 1)}


def dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.exists() else 0


def stage_seconds(build_log: Path) -> dict[str, float]:
    """Wall seconds per build stage, from the stage start lines of the work dir's build.log to the next one (the
    last stage to the log's last timestamped line)."""
    from datetime import datetime

    stamp = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+) ")
    starts, last = [], None
    for line in build_log.read_text(errors="replace").splitlines():
        m = stamp.match(line)
        if not m:
            continue
        last = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f")
        st = re.search(r"stage (\w+): running", line)
        if st:
            starts.append((st.group(1), last))
    ends = [t for _, t in starts[1:]] + [last]
    return {name: round((end - t0).total_seconds(), 1) for (name, t0), end in zip(starts, ends)}


def linear_fit(xs: list[int], ys: list[float]) -> dict | None:
    """y = fixed + per_layer * depth, least squares (None below two depths)."""
    if len(set(xs)) < 2:
        return None
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return {"fixed": round(my - slope * mx, 1), "per_layer": round(slope, 1), "n": n}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=Path("/tmp/qconv-scale-27b"))
    ap.add_argument("--config", type=Path, default=CONFIG_27B)
    ap.add_argument("--depths", default="2,4,8")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--width-div", type=int, default=1, help="Divide every width by this (1: the 27B's own).")
    ap.add_argument("--vocab", type=int, help="Vocabulary size (default: the 27B's 248,320).")
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument(
        "--int8-budget",
        help="Passed to the build (the recipe's `auto` is 0 at these depths: the INT8 "
        "embedding and lm_head already exceed selection.max_bpw); 0.68GiB is "
        "what `auto` finds for the 27B, so the build scores its units as the 27B's does.",
    )
    args = ap.parse_args()

    sys.path.insert(0, str(REPO / "bench"))
    sys.path.insert(0, str(REPO))
    from build_memory import write_model
    from qconv_cmd import QCONV, streamed_build

    from tests.tiny import CORPUS

    args.work.mkdir(parents=True, exist_ok=True)
    text = args.work / "text.txt"
    text.write_text(CORPUS * max(200, -(-6 * args.samples * args.seq_len // len(CORPUS))))  # >= samples windows
    rows = []
    for depth in [int(d) for d in args.depths.split(",")]:
        tag = f"d{depth}-w{args.width_div}-v{args.vocab or 'full'}"
        src, art, work = args.work / f"model-{tag}", args.work / f"art-{tag}", args.work / f"work-{tag}"
        index = src / "model.safetensors.index.json"
        if index.is_file():
            total = json.loads(index.read_text())["metadata"]["total_size"]
            params = total // 2
        else:
            params, total = write_model(src, depth, 0, cfg=text_config(args.config, depth, args.width_div, args.vocab))
        budget = ["--int8-budget", args.int8_budget] if args.int8_budget else []
        build = timed(
            streamed_build(src, art, text, args.samples, args.seq_len, work, *budget),
            args.work / f"build-{tag}.log",
        )
        window = min(args.window, args.eval_tokens)
        ev = timed(
            QCONV
            + [
                "eval",
                str(art),
                "--reference",
                str(src),
                "--text",
                str(text),
                "--window",
                str(window),
                "--max-tokens",
                str(args.eval_tokens),
                "--streamed",
                "--out",
                str(args.work / f"eval-{tag}"),
            ],
            args.work / f"eval-{tag}.log",
        )
        report = json.loads((args.work / f"eval-{tag}" / "report.json").read_text())
        rows.append(
            {
                "depth": depth,
                "params": params,
                "bf16_bytes": total,
                "build_peak_rss_bytes": build["peak_rss_bytes"],
                "build_wall_s": build["wall_s"],
                "eval_peak_rss_bytes": ev["peak_rss_bytes"],
                "eval_wall_s": ev["wall_s"],
                "build_stage_s": stage_seconds(work / "build.log"),
                "artifact_bytes": dir_bytes(art),
                "work_dir_bytes": dir_bytes(work),
                "kld_mean": report["weights"]["kld_mean"],
                "eval_streamed": report["forward"]["streamed"],
            }
        )
    depths = [r["depth"] for r in rows]
    fits = {
        k: linear_fit(depths, [r[k] for r in rows])
        for k in ("build_peak_rss_bytes", "build_wall_s", "eval_peak_rss_bytes", "eval_wall_s")
    }
    print(
        json.dumps(
            {
                "bench": "scale_27b",
                "width_div": args.width_div,
                "vocab": args.vocab or "27b",
                "samples": args.samples,
                "seq_len": args.seq_len,
                "eval_tokens": args.eval_tokens,
                "int8_budget": args.int8_budget or "recipe",
                "rows": rows,
                "fit": fits,
            }
        )
    )


if __name__ == "__main__":
    main()
