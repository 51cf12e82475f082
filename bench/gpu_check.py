"""The bundled runtime and the KVarN quantizer on a CUDA GPU (run where one is lent; everything else is CPU-tested).

1. Logit parity with transformers on the GPU (fp32, tiny random llama / qwen3 / qwen3_5 models, prefill + 32 decode
   steps), 2. greedy speculative decoding == plain greedy on the GPU (llama: prompt lookup; qwen3_5: MTP and
   hybrid), 3. quantize + dequantize a 128K-token, 16-layer, 4-head, D=256 KVarN cache on the GPU (bench/kv_speed.py's
   synthetic cache, timed with CUDA syncs). Prints one JSON line.

    python bench/gpu_check.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def spec_equal(path: Path, modes: tuple[str, ...], device: str, prompts: int = 6, new: int = 32) -> dict:
    from qconv.engine import load_model
    from qconv.engine.generate import GenerationConfig, generate_tokens
    from qconv.engine.spec import SpecConfig

    model = load_model(path).to(device)
    model.config.eos_token_ids = []  # random weights say eos early: run every token
    g = torch.Generator().manual_seed(2)
    out = {}
    for mode in modes:
        same = 0
        for _ in range(prompts):
            base = torch.randint(3, 300, (6,), generator=g).tolist()
            ids = base * 3 + base[:2]
            ref = list(generate_tokens(model, ids, GenerationConfig(max_tokens=new)))
            cfg = GenerationConfig(max_tokens=new, spec=SpecConfig(mode))
            same += ref == list(generate_tokens(model, ids, cfg))
        out[mode] = f"{same}/{prompts}"
    return out


def main() -> None:
    from tests.test_engine_model import parity
    from tests.tiny import make_tiny_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="where to build the tiny models (default: a temp dir)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: no CUDA device (this check is for a GPU machine; the CPU path is in the tests)")
    dev = "cuda"
    root = Path(a.out or tempfile.mkdtemp())
    report = {"bench": "gpu_check", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    for fam in ("llama", "qwen3", "qwen3_5"):
        path = make_tiny_model(fam, root / fam)
        pre, dec = parity(path, device=dev)
        report[f"parity_{fam}"] = {"prefill_max_abs": pre, "decode_max_abs": dec, "pass": max(pre, dec) <= 1e-3}
    report["spec_llama"] = spec_equal(root / "llama", ("lookup",), dev)
    report["spec_qwen3_5"] = spec_equal(root / "qwen3_5", ("mtp", "hybrid"), dev)
    t = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    kv = subprocess.run(
        [sys.executable, str(REPO / "bench" / "kv_speed.py"), "--device", dev], capture_output=True, text=True, env=env
    )
    report["kv_speed"] = json.loads(kv.stdout.strip().splitlines()[-1]) if kv.returncode == 0 else kv.stderr[-2000:]
    report["kv_speed_wall_s"] = round(time.perf_counter() - t, 1)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
