"""bench/gpu_day.py's bench part, apart from the kernel parts: the carried wheels of `qconv serve`'s server chain
(fetched here, unpacked on the device), the model it serves, and the `qconv bench` run itself."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WHEELS = REPO / ".cache" / "wheels"
SMOLLM2 = REPO / ".cache" / "models" / "smollm2-135m-instruct"
SMOLLM2_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
COMPILED = {"pydantic_core"}  # one wheel per CPython version
PYTHONS = ("3.10", "3.11", "3.12", "3.13", "3.14")


def requirements() -> list[str]:
    """The pinned requirements of bench/gpu_day_wheels.txt."""
    lines = (REPO / "bench" / "gpu_day_wheels.txt").read_text().splitlines()
    return [x.strip() for x in lines if x.strip() and not x.startswith("#")]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def wheel_files(folder: Path = WHEELS) -> list[Path]:
    """The fetched wheels of the listed requirements (each name and version; compiled ones for every Python)."""
    want = {_norm(r.split("==")[0]): r.split("==")[1] for r in requirements()}
    found = [w for w in sorted(folder.glob("*.whl")) if want.get(_norm(w.name.split("-")[0])) == w.name.split("-")[1]]
    return found


def fetch_wheels(folder: Path = WHEELS) -> list[Path]:
    """Download the listed wheels (pip, no dependencies: the list is the whole chain)."""
    folder.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "-d", str(folder)]
    plain = [r for r in requirements() if _norm(r.split("==")[0]) not in COMPILED]
    subprocess.run([*pip, *plain], check=True)
    for r in requirements():
        if _norm(r.split("==")[0]) in COMPILED:
            for py in PYTHONS:
                plat = ["--python-version", py, "--platform", "manylinux_2_17_x86_64"]
                subprocess.run([*pip, *plat, r], check=True)
    return wheel_files(folder)


def unpack_wheels(site: Path, folder: Path = WHEELS) -> Path:
    """Unpack the carried wheels into `site` (a wheel is a zip laid out for site-packages), the compiled ones for
    this Python only. A missing wheel is an error naming the fetch command."""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    files = wheel_files(folder)
    names = {_norm(w.name.split("-")[0]) for w in files}
    missing = [r for r in requirements() if _norm(r.split("==")[0]) not in names]
    if missing:
        raise FileNotFoundError(f"wheels {missing} not in {folder}: run `python bench/gpu_day.py --fetch-wheels`")
    site.mkdir(parents=True, exist_ok=True)
    for w in files:
        if _norm(w.name.split("-")[0]) in COMPILED and f"-{tag}-" not in w.name:
            continue
        with zipfile.ZipFile(w) as z:
            z.extractall(site)
    return site


def bench_model(out: Path, small: bool) -> Path:
    """SmolLM2-135M's shape with seeded random bf16 weights (its carried config and tokenizer), or, with --small,
    the tiny llama of the tests."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if small:
        from tests.tiny import make_tiny_model

        return make_tiny_model("llama", out)
    missing = [f for f in SMOLLM2_FILES if not (SMOLLM2 / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{missing} not in {SMOLLM2}: carry them (bench/gpu_day.py's docstring)")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(SMOLLM2), dtype=torch.bfloat16)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(SMOLLM2).save_pretrained(out)
    for f in ("generation_config.json", "chat_template.jinja"):
        if (SMOLLM2 / f).is_file():
            (out / f).write_bytes((SMOLLM2 / f).read_bytes())
    return out


def run_bench(model: Path, site: Path, device: str, levels: str, prompts: int, max_tokens: int) -> dict:
    """`qconv bench MODEL --backend native --device DEVICE` with the unpacked wheels first on the path; bench.json."""
    out = model.parent / "bench"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)]), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "qconv.cli", "bench", str(model), "--backend", "native", "--device", device]
    cmd += ["--workloads", "copy,code,chat,math", "--concurrency", levels, "--prompts", str(prompts)]
    cmd += ["--max-tokens", str(max_tokens), "--no-charts", "--out", str(out)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=420)
    if r.returncode:
        raise RuntimeError(f"qconv bench exited {r.returncode}: {(r.stderr or r.stdout)[-1500:]}")
    return json.loads((out / "bench.json").read_text())
