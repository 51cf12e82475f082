"""Projected wall time of the 27B's 64-layer streamed build and eval, on this CPU and on an RTX 3090, from a
`bench/scale_27b.py` run (its JSON line and its work folder's logs).

Method, stated so that anyone can redo it by hand:
1. Per layer, from the measured depths: the build's GPTQ seconds (llmcompressor's own `GPTQ | METRIC - time`
   lines, which do not depend on the calibration size), the rest of the quantization stage (calibration forwards
   and Hessians: proportional to calibration tokens), the sensitivity stage (forward, backward and Hessians on its
   8 windows: proportional to their tokens; its row errors are not, so scaling it overestimates) and the streamed
   eval (proportional to evaluation tokens). A per-layer value is the difference between the deepest two depths
   divided by their layer difference (d8 - d4 is exactly the 27B's 3:1 Gated-DeltaNet:attention mix); the fixed
   part is what the deepest run leaves over its layers.
2. This CPU, 64 layers: fixed + 64 x per layer, token-proportional parts scaled to the recipe's calibration
   (128 x 2,048; its sensitivity windows 8 x 2,048) and the quality stage's 8,192 evaluation tokens.
3. The 3090: every compute part divided by R = (3090 throughput) / (this CPU's, measured here by a GEMM of the same
   precision: fp32 for GPTQ, bf16 for the rest), then the disk floor added: each layer's bf16 weights read once per
   pass, and the calibration activations written and read back per layer (they are kept on disk), at --disk-gbps.
   The 3090's throughputs default to its datasheet peaks (35.6 TFLOPS fp32, 71 TFLOPS bf16 tensor) times
   --gpu-efficiency.

    .venv/bin/python bench/project_27b.py --scale-json scale27b.json --work /tmp/qconv-scale-27b
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG_27B = REPO.parent / "shared" / "models" / "qwen3.8-27b-config"


def gemm_gflops(dtype_name: str, n: int = 4096, reps: int = 5) -> float:
    import torch

    dtype = getattr(torch, dtype_name)
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n ** 3 * reps / (time.perf_counter() - t0) / 1e9


def gptq_seconds(build_log: Path) -> float:
    return sum(float(s) for s in re.findall(r"GPTQ \| METRIC - time ([\d.]+)s", build_log.read_text(errors="replace")))


def per_layer(rows: list[dict], key) -> tuple[float, float]:
    """(fixed, per layer) from the deepest two depths."""
    a, b = sorted(rows, key=lambda r: r["depth"])[-2:]
    slope = (key(b) - key(a)) / (b["depth"] - a["depth"])
    return key(b) - slope * b["depth"], slope


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale-json", type=Path, required=True, help="The JSON line bench/scale_27b.py printed.")
    ap.add_argument("--work", type=Path, required=True, help="The --work folder of that run.")
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--calib-tokens", type=int, default=128 * 2048)
    ap.add_argument("--sens-tokens", type=int, default=8 * 2048)
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--gpu-fp32-tflops", type=float, default=35.6)
    ap.add_argument("--gpu-bf16-tflops", type=float, default=71.0)
    ap.add_argument("--gpu-efficiency", type=float, default=0.5, help="Fraction of peak the kernels reach.")
    ap.add_argument("--disk-gbps", type=float, default=2.0, help="NVMe read/write, GB/s.")
    args = ap.parse_args()

    run = json.loads(args.scale_json.read_text().strip().splitlines()[-1])
    tag = f"w{run['width_div']}-v{'full' if run['vocab'] == '27b' else run['vocab']}"
    rows = run["rows"]
    for r in rows:
        r["gptq_s"] = gptq_seconds(args.work / f"work-d{r['depth']}-{tag}" / "build.log")
    measured_calib = run["samples"] * run["seq_len"]
    measured_sens = min(run["samples"], 8) * run["seq_len"]
    stage = lambda name: (lambda r: r["build_stage_s"].get(name, 0.0))  # noqa: E731
    parts = {
        "gptq": (per_layer(rows, lambda r: r["gptq_s"]), 1.0, "float32"),
        "calibration_forward_hessian": (per_layer(rows, lambda r: stage("quantization")(r) - r["gptq_s"]),
                                        args.calib_tokens / measured_calib, "bfloat16"),
        "sensitivity": (per_layer(rows, stage("sensitivity")), args.sens_tokens / measured_sens, "bfloat16"),
        "eval": (per_layer(rows, lambda r: r["eval_wall_s"]), args.eval_tokens / run["eval_tokens"], "bfloat16"),
    }
    cpu = {"float32": gemm_gflops("float32"), "bfloat16": gemm_gflops("bfloat16")}
    gpu = {"float32": args.gpu_fp32_tflops * 1e3 * args.gpu_efficiency,
           "bfloat16": args.gpu_bf16_tflops * 1e3 * args.gpu_efficiency}
    tc = json.loads((CONFIG_27B / "config.json").read_text())["text_config"]
    deepest = max(rows, key=lambda r: r["depth"])
    layer_bytes = (deepest["bf16_bytes"] - 2 * tc["vocab_size"] * tc["hidden_size"] * 2) / deepest["depth"]
    act_bytes = args.calib_tokens * tc["hidden_size"] * 2
    disk = {"build": (3 * layer_bytes + 4 * act_bytes) / (args.disk_gbps * 1e9),  # weights: 2 passes + sensitivity
            "eval": 2 * layer_bytes / (args.disk_gbps * 1e9)}  # the artifact's and the source's layer
    out = {"bench": "project_27b", "layers": args.layers, "calib_tokens": args.calib_tokens,
           "sens_tokens": args.sens_tokens, "eval_tokens": args.eval_tokens, "cpu_gemm_gflops": cpu,
           "gpu_gflops_assumed": gpu, "per_layer_s": {}, "fixed_s": {}}
    totals = {"cpu_build_s": 0.0, "cpu_eval_s": 0.0, "gpu_build_s": 0.0, "gpu_eval_s": 0.0}
    for name, ((fixed, slope), scale, dtype) in parts.items():
        kind = "eval" if name == "eval" else "build"
        layer_cpu = slope * scale
        out["per_layer_s"][name] = round(layer_cpu, 1)
        out["fixed_s"][name] = round(fixed, 1)
        cpu_total = fixed + args.layers * layer_cpu
        ratio = gpu[dtype] / cpu[dtype]
        totals[f"cpu_{kind}_s"] += cpu_total
        totals[f"gpu_{kind}_s"] += cpu_total / ratio
    totals["gpu_build_s"] += args.layers * disk["build"]
    totals["gpu_eval_s"] += args.layers * disk["eval"]
    out["disk_floor_per_layer_s"] = {k: round(v, 1) for k, v in disk.items()}
    out.update({k: round(v) for k, v in totals.items()})
    out["cpu_build_h"], out["gpu_build_h"] = round(totals["cpu_build_s"] / 3600, 1), round(totals["gpu_build_s"] / 3600, 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
