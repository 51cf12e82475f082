"""What a newcomer meets first, timed: `scripts/demo.sh` from its setup to its generation (each stage's seconds as
the build prints them, the artifact's size and quality), and a tiny random Qwen3.5 (4 layers, hidden 256) built with
the 3090 recipe at the recipe's own calibration size (128 x 2,048 tokens). Prints one JSON line.

Usage: python bench/first_contact.py [--demo] [--tiny] [--data ../shared/data]
An AVX2-only CPU can be stood in for on an AVX-512 host: ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
MKL_ENABLE_INSTRUCTIONS=AVX2 (torch then reports no native bf16 and takes its AVX2 kernels)."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
STAGE = re.compile(r"^✓ (\S+(?: \S+)?)\s+([\d.]+) s")


def cpu() -> dict:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    model = next((line.split(":", 1)[1].strip() for line in flags.splitlines() if line.startswith("model name")), "")
    return {"model": model, "cores": os.cpu_count(), "torch_isa": torch.backends.cpu.get_cpu_capability()}


def stages(text: str) -> dict[str, float]:
    return {m[1]: float(m[2]) for line in text.splitlines() if (m := STAGE.match(line.strip()))}


def summary(artifact: Path) -> dict:
    m = json.loads((artifact / "qconv.json").read_text())
    q = (m.get("quality") or {}).get("weights") or {}
    return {
        "bits_per_weight": (m.get("quality") or {}).get("bits_per_weight"),
        "kld_mean": q.get("kld_mean"),
        "compute_dtype": m["build"].get("compute_dtype"),
        "elapsed_s": m["build"].get("elapsed_s"),
        # which weights it made: two commits that build the same bytes need no quality comparison
        "weights_sha256": {k: f["sha256"][:16] for k, f in m["files"].items() if k.endswith(".safetensors")},
    }


def demo(tmp: Path) -> dict:
    env = {**os.environ, "QCONV_DEMO_OUT": str(tmp / "out")}
    t = time.perf_counter()
    r = subprocess.run(["bash", "scripts/demo.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if r.returncode:
        sys.exit(f"demo failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return {"wall_s": round(wall, 1), "stages": stages(r.stdout + r.stderr), **summary(tmp / "out/smollm2-135m-3090")}


def tiny(tmp: Path, data: Path) -> dict:
    """A seeded random Qwen3.5 text model of 4 layers at hidden 256 with SmolLM2's tokenizer."""
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from qconv.paths import embedded_gguf

    tok = AutoTokenizer.from_pretrained(str(embedded_gguf().parent), gguf_file=embedded_gguf().name)
    cfg = Qwen3_5TextConfig(
        vocab_size=len(tok),
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        full_attention_interval=2,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(cfg).to(torch.bfloat16)
    src = tmp / "tiny-qwen3_5"
    model.save_pretrained(src)
    tok.save_pretrained(src)
    out = tmp / "tiny-3090"
    cmd = [sys.executable, "-m", "qconv.cli", "build", "--recipe", "3090", "--model", src, "--out", out]
    cmd += ["--dataset", data / "tinyshakespeare.txt", "--work-dir", tmp / "work"]
    t = time.perf_counter()
    r = subprocess.run([str(c) for c in cmd], cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if r.returncode:
        sys.exit(f"tiny build failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    m = json.loads((out / "qconv.json").read_text())
    cal = m["calibration"]
    return {
        "wall_s": round(wall, 1),
        "stages": stages(r.stdout + r.stderr),
        "calibration": f"{cal['samples']} x {cal['seq_len']}",
        "compute_dtype": m["build"].get("compute_dtype"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--demo", action="store_true", help="time scripts/demo.sh")
    ap.add_argument("--tiny", action="store_true", help="time the tiny Qwen3.5 at the recipe's calibration size")
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    a = ap.parse_args()
    out: dict = {"bench": "first_contact", "cpu": cpu(), "date": time.strftime("%Y-%m-%d")}
    with tempfile.TemporaryDirectory() as d:
        if a.demo or not a.tiny:
            out["demo"] = demo(Path(d))
        if a.tiny or not a.demo:
            out["tiny"] = tiny(Path(d), a.data)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
