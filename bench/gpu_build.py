"""The streamed 3090 build on a CUDA GPU at the 27B's real widths (issue 31), for a machine with a GPU lent to it.

1. Writes bench/scale_27b.py's seeded random `qwen3_5_text` model at depth 2 (hidden 5,120, intermediate 17,408,
   vocabulary 248,320 untied: 3.31 B parameters, 6.6 GB bf16), and the same model cut at depth 1 (the same seed,
   so embed_tokens and layer 0 hold the same values).
2. `qconv build --recipe 3090 --stream --device cuda` on depth 2, then `qconv eval --streamed --device cuda` on it:
   seconds a layer and peak torch.cuda.max_memory_allocated per layer and for the lm_head (the build's per-layer
   lines in build.log), the eval's peak, and each process's peak host RSS.
3. The CPU reference: `--device cpu` on depth 1 with lm_head kept bf16 (GPTQ of one layer only: the whole depth-2
   CPU build does not fit the 8 minutes). Compared, layer 0 and embed_tokens:
   - embed_tokens is round-to-nearest from bf16 min/max (exact on both devices): its packed bytes must be equal;
   - layer 0's int4 codes: GPTQ rounds column by column and carries each rounding error into the columns after it,
     so a float reordering on the GPU (other summation orders in the Hessian, Cholesky and matmuls) flips a code that
     sits at a rounding boundary and the flip moves the rest of that row: bit equality is not the criterion. The
     tolerance: every module's weight-space quantization error ||W_q - W|| / ||W|| within 1% (relative) of the CPU
     build's. The share of equal codes and the largest code difference are reported as they come.
Prints one JSON line; on a machine without CUDA, one JSON line with the error and exit code 1, nothing written.

    python bench/gpu_build.py [--work DIR] [--samples 4] [--seq-len 2048]

Budget: ~8 minutes on one GPU with 16 CPU cores (the model files ~1.5 min, the GPU build and eval ~2-3 min, the
one-layer CPU build ~2-3 min); --samples / --seq-len scale both builds' calibration.
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
TOLERANCE = 0.01  # relative difference of the weight-space quantization error, GPU build against CPU build


def fail(msg: str, code: int = 1) -> None:
    print(json.dumps({"bench": "gpu_build", "error": msg}))
    raise SystemExit(code)


PROBE = (
    "import resource, runpy, sys, torch\nsys.argv = ['qconv'] + sys.argv[1:]\ntry:\n"
    "    runpy.run_module('qconv.cli', run_name='__main__')\nfinally:\n"
    "    cuda = torch.cuda.max_memory_allocated() if torch.cuda.is_initialized() else 0\n"
    "    print('PEAKS', cuda, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, flush=True)"
)


def qconv(args: list, log: Path) -> dict:
    """One qconv command in its own process: wall seconds, its peak torch.cuda.max_memory_allocated and its peak
    host RSS (both read by the process itself as it exits)."""
    t0 = time.time()
    with open(log, "w") as f:
        rc = subprocess.call(
            [sys.executable, "-c", PROBE, *map(str, args)],
            cwd=REPO,
            stdout=f,
            stderr=subprocess.STDOUT,
            # REPO first, the caller's path kept: packages carried to a lent machine come in on PYTHONPATH
            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))},
        )
    text = log.read_text(errors="replace")
    peaks = re.search(r"PEAKS (\d+) (\d+)", text)
    if rc or not peaks:
        fail(f"qconv {args[0]} exited {rc}: {text[-1500:]}")
    return {
        "wall_s": round(time.time() - t0, 1),
        "cuda_peak_gib": round(int(peaks[1]) / 2**30, 2),
        "host_peak_rss_gib": round(int(peaks[2]) / 2**30, 2),
    }


def layer_lines(build_log: Path) -> list[dict]:
    """The build's per-layer lines (qconv.convert.device.LayerClock): seconds and peak device memory."""
    pat = re.compile(r"(layer \d+/\d+|lm_head): ([\d.]+) s\b.*? peak (?:allocated|RSS) ([\d.]+) GiB")
    return [
        {"phase": m[1], "s": float(m[2]), "peak_gib": float(m[3])}
        for m in pat.finditer(build_log.read_text(errors="replace"))
    ]


def dequantized(art: Path, prefix: str) -> dict:
    """name -> (int codes, dequantized float32 weight) of every pack-quantized module under `prefix`."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors import safe_open

    tensors = {}
    for shard in art.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)})
    out = {}
    for k in tensors:
        if not k.endswith(".weight_packed"):
            continue
        name = k.removesuffix(".weight_packed")
        shape = torch.Size(tensors[f"{name}.weight_shape"].tolist())
        scale = tensors[f"{name}.weight_scale"].float()
        codes = unpack_from_int32(tensors[k], 32 * tensors[k].shape[1] // shape[1], shape)
        g = shape[1] // scale.shape[1]
        out[name] = (codes, (codes.float().view(shape[0], -1, g) * scale.unsqueeze(-1)).view(shape))
    return out


def compare(gpu: Path, cpu: Path, source: Path) -> dict:
    import torch
    from safetensors import safe_open

    orig = {}
    for shard in source.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            orig.update(
                {
                    k.removesuffix(".weight"): f.get_tensor(k).float()
                    for k in f.keys()
                    if k.startswith("model.layers.0.") and k.endswith(".weight")
                }
            )
    g, c = dequantized(gpu, "model.layers.0."), dequantized(cpu, "model.layers.0.")
    rows, ok = {}, True
    for name in sorted(c):
        w = orig[name]
        eg = float((g[name][1] - w).norm() / w.norm())
        ec = float((c[name][1] - w).norm() / w.norm())
        same = float((g[name][0] == c[name][0]).float().mean())
        rows[name.removeprefix("model.layers.0.")] = {
            "err_gpu": round(eg, 5),
            "err_cpu": round(ec, 5),
            "codes_equal": round(same, 4),
            "max_code_diff": int((g[name][0] - c[name][0]).abs().max()),
        }
        ok &= abs(eg - ec) <= TOLERANCE * ec
    emb = dequantized(gpu, "model.embed_tokens")
    emb_cpu = dequantized(cpu, "model.embed_tokens")
    emb_equal = all(torch.equal(emb[k][0], emb_cpu[k][0]) and torch.equal(emb[k][1], emb_cpu[k][1]) for k in emb)
    return {"layer0": rows, "layer0_within_tolerance": ok, "tolerance": TOLERANCE, "embed_tokens_equal": emb_equal}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=Path("/tmp/qconv-gpu-build"))
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--skip-cpu", action="store_true", help="No CPU reference build (GPU numbers only).")
    args = ap.parse_args()
    try:
        import torch
    except ImportError as e:
        fail(f"torch is not importable: {e}")
    if not torch.cuda.is_available():
        fail(
            f"no CUDA device: torch {torch.__version__} sees no GPU (this bench is for a machine with one; the CPU "
            "path is in tests/test_build_device.py)"
        )
    import importlib.util

    absent = [m for m in ("llmcompressor", "compressed_tensors") if importlib.util.find_spec(m) is None]
    if absent:  # before the model files, not minutes later in the build's log
        fail(f"qconv build needs {' and '.join(absent)}, not importable in this Python (carry the wheels)")
    sys.path.insert(0, str(REPO / "bench"))
    sys.path.insert(0, str(REPO))
    from build_memory import write_model
    from qconv_cmd import build_args
    from scale_27b import CONFIG_27B, text_config

    from tests.tiny import CORPUS

    w = args.work
    w.mkdir(parents=True, exist_ok=True)
    text = w / "text.txt"
    text.write_text(CORPUS * max(200, -(-6 * args.samples * args.seq_len // len(CORPUS))))
    t0 = time.time()
    src2, src1 = w / "model-d2", w / "model-d1"
    for depth, src in ((2, src2), (1, src1)):
        if not (src / "model.safetensors.index.json").is_file():
            write_model(src, depth, 0, cfg=text_config(CONFIG_27B, depth, 1, None))
    written_s = round(time.time() - t0, 1)
    cal = [
        "--dataset",
        text,
        "--samples",
        args.samples,
        "--seq-len",
        args.seq_len,
        "--int8-budget",
        "0",
        "--stream",
        "--force",
        "--fresh",
    ]
    gpu_art, cpu_art = w / "art-gpu", w / "art-cpu"
    build = qconv(
        build_args("3090", src2, gpu_art, "--work-dir", w / "work-gpu", "--device", "cuda", *cal),
        w / "build-gpu.log",
    )
    phases = layer_lines(w / "work-gpu" / "build.log")
    ev_out = w / "eval-gpu"
    ev = qconv(
        [
            "eval",
            gpu_art,
            "--reference",
            src2,
            "--text",
            text,
            "--window",
            2048,
            "--max-tokens",
            args.eval_tokens,
            "--streamed",
            "--device",
            "cuda",
            "--out",
            ev_out,
        ],
        w / "eval-gpu.log",
    )
    report = json.loads((ev_out / "report.json").read_text())
    result = {
        "bench": "gpu_build",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "samples": args.samples,
        "seq_len": args.seq_len,
        "model_write_s": written_s,
        "build": {**build, "phases": phases, "s_per_layer": [x["s"] for x in phases if x["phase"].startswith("layer")]},
        "eval": {**ev, "kld_mean": report["weights"]["kld_mean"], "forward": report["forward"]},
    }
    if not args.skip_cpu:
        keep_head = w / "cpu-ref.yaml"
        keep_head.write_text('extends: "3090"\nname: 3090-cpu-ref\nroles: {lm_head: bf16}\n')
        result["cpu_reference"] = qconv(
            build_args(keep_head, src1, cpu_art, "--work-dir", w / "work-cpu", "--device", "cpu", *cal),
            w / "build-cpu.log",
        )
        result["compare"] = compare(gpu_art, cpu_art, src2)
    result["total_s"] = round(time.time() - t0, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
