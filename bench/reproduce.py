"""Which artifact bytes a build gives on this host: the seeded tiny Qwen3.5 of the tests (tests/tiny.py) through the
3090 recipe (8 x 64 tokens of the tests' corpus, --upgrade-budget 8%), once per compute dtype with this CPU's own
kernels and once with `--cpu-isa avx2`. Prints one JSON line: each build's sha256 over its safetensors.

Run it at one commit on two hosts: the `avx2` hashes of an AVX-512 host equal the `native` hashes of an AVX2-only
host when an AVX2-only CPU rebuilds an artifact bit for bit (docs/BUILD.md, "Compute dtype").

Usage: python bench/reproduce.py"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.first_contact import cpu  # noqa: E402
from tests.tiny import CORPUS, make_tiny_model  # noqa: E402


def build(tmp: Path, model: Path, dtype: str, isa: str | None) -> str:
    out = tmp / f"out-{dtype}-{isa or 'native'}"
    cmd = [sys.executable, "-m", "qconv.cli", "build", "--recipe", "3090", "--model", model, "--out", out]
    cmd += ["--dataset", tmp / "cal.txt", "--samples", "8", "--seq-len", "64", "--upgrade-budget", "8%"]
    cmd += ["--no-gates", "--work-dir", tmp / f"w-{out.name}", "--compute-dtype", dtype]
    cmd += ["--cpu-isa", isa] if isa else []
    env = {**os.environ, "QCONV_HOME": str(tmp / "home"), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([str(c) for c in cmd], cwd=ROOT, capture_output=True, text=True, env=env)
    if r.returncode:
        sys.exit(f"build failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(out.glob("*.safetensors")))).hexdigest()


def main() -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    out: dict = {"bench": "reproduce", "cpu": cpu(), "date": time.strftime("%Y-%m-%d"), "commit": commit.stdout.strip()}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = make_tiny_model("qwen3_5", tmp / "tiny")
        (tmp / "cal.txt").write_text(CORPUS * 20)
        for dtype in ("float32", "bfloat16"):
            for isa in (None, "avx2"):
                out[f"{dtype}_{isa or 'native'}"] = build(tmp, model, dtype, isa)[:16]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
