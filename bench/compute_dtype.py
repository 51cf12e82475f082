"""Why qconv computes in float32 on a CPU without native bf16: one forward and one forward + backward of the same
bf16 weights, computed in bf16 and in float32 (qconv.compute.upcast), on one sequence. Prints one JSON line:
seconds per pass for each dtype, their ratios, and whether this CPU computes bf16 natively.

Usage: python bench/compute_dtype.py [MODEL] [--tokens 256] [--repeats 2]"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from qconv.compute import bf16_native, computing_in
from qconv.convert.hfmodel import load_causal_lm

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / ".cache/models/smollm2-135m-instruct"


def timed(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=str(DEFAULT_MODEL))
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    model = load_causal_lm(a.model)
    for p in model.parameters():
        p.requires_grad_(False)
    x = torch.randint(0, model.config.vocab_size, (1, a.tokens), generator=torch.Generator().manual_seed(0))
    model.get_input_embeddings().register_forward_hook(lambda m, i, out: out.detach().requires_grad_())

    def forward():
        with torch.no_grad():
            model(x)

    def backward():
        logits = model(x).logits[0, :-1].float()
        torch.nn.functional.cross_entropy(logits, x[0, 1:]).backward()

    out = {"model": Path(a.model).name, "tokens": a.tokens, "bf16_native": bf16_native("cpu")}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        with computing_in(model, dtype):
            out[f"{name}_forward_s"] = round(timed(forward, a.repeats), 3)
            out[f"{name}_forward_backward_s"] = round(timed(backward, a.repeats), 3)
    out["forward_ratio"] = round(out["bf16_forward_s"] / out["fp32_forward_s"], 2)
    out["forward_backward_ratio"] = round(out["bf16_forward_backward_s"] / out["fp32_forward_backward_s"], 2)
    out["machine"] = f"{cpu_name()}, {torch.get_num_threads()} threads"
    print(json.dumps(out))


if __name__ == "__main__":
    main()
