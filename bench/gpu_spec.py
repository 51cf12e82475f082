"""Speculative decoding on a CUDA GPU (run where one is lent; <= 8 min): a tiny random qwen3_5 with its MTP head,
on repeating prompts (copy-like: prompt lookup can follow them).

1. Through vLLM on CUDA: plain greedy; MTP with k tokens (vLLM's own proposer); the plugin's stretched prompt lookup
   (custom_class qconv_vllm.stretch, k tokens, the block after N fully accepted steps). Tokens per verify step from
   vLLM's spec-decode metrics, and whether greedy output equals plain greedy. vLLM's MTP proposer cannot be
   stretched (custom_class replaces the drafter), so MTP + stretch runs in 2. Where vLLM is not installed (a lent
   machine: its CUDA wheel is far over what travels there) this part is skipped and reported as
   "vllm": "not installed".
2. Our engine on CUDA (fp32): MTP alone vs MTP stretched by prompt lookup (hybrid, after_saturated N): tokens per
   step and greedy equality.

Prints one JSON line; a part that raises is reported as {"error": ...} in it and the exit status is 1. Without CUDA
one JSON line with "error", exit status 2. `--device cpu` runs part 2 alone on the CPU (this script's own check).

    python bench/gpu_spec.py [--k 4 --block 15 --after-saturated 2 --max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "plugins" / "vllm"), str(REPO / "bench")]


def fail(msg: str) -> None:
    print(json.dumps({"bench": "gpu_spec", "error": msg}))
    raise SystemExit(2)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        base = torch.randint(3, 300, (12,), generator=g).tolist()
        out.append(base * 4 + base[:3])
    return out


def vllm_runs(path: Path, ids: list[list[int]], a) -> dict:
    from vllm import LLM, SamplingParams
    from vllm_spec import delta, spec_metrics

    from qconv_vllm.stretch import class_name

    configs = {
        "plain": None,
        "mtp": {"method": "mtp", "num_speculative_tokens": a.k},
        "stretched_lookup": {
            "method": "custom_class",
            "num_speculative_tokens": a.block,
            "model": "qconv_vllm.stretch." + class_name(a.k, a.after_saturated, 2, 4),
        },
    }
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    out, ref = {}, None
    for name, spec in configs.items():
        t0 = time.perf_counter()
        llm = LLM(
            model=str(path),
            max_model_len=1024,
            enforce_eager=True,
            speculative_config=spec,
            seed=0,
            disable_log_stats=False,
            gpu_memory_utilization=0.3,
        )
        before = spec_metrics(llm)
        res = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
        toks = [list(r.outputs[0].token_ids) for r in res]
        row = delta(spec_metrics(llm), before)
        row["seconds"] = round(time.perf_counter() - t0, 1)
        if ref is None:
            ref = toks
        else:
            row["identical_to_plain"] = toks == ref
        out[name] = row
        del llm
    return out


def engine_runs(path: Path, ids: list[list[int]], a) -> dict:
    from qconv.engine.generate import GenerationConfig, GenerationStats, generate_tokens
    from qconv.engine.loader import load_model
    from qconv.engine.spec import SpecConfig

    model = load_model(path).to(a.device)
    model.config.eos_token_ids = []  # random weights say eos early: run every token
    specs = {
        "mtp": SpecConfig("mtp", k=a.k, max_block=a.k, adaptive=False),
        "mtp_stretched": SpecConfig(
            "hybrid", k=a.k, max_block=a.block, adaptive=False, after_saturated=a.after_saturated
        ),
    }
    ref = [list(generate_tokens(model, p, GenerationConfig(max_tokens=a.max_tokens))) for p in ids]
    out = {}
    for name, spec in specs.items():
        stats = GenerationStats()
        toks = [
            list(generate_tokens(model, p, GenerationConfig(max_tokens=a.max_tokens, spec=spec), stats)) for p in ids
        ]
        out[name] = {"tokens_per_step": round(stats.tokens_per_step, 3), "identical_to_plain": toks == ref}
    return out


def part(fn, *args) -> dict:
    """One part's result, or its error: a failing vLLM run must not take the engine's numbers down with it."""
    try:
        return fn(*args)
    except Exception as e:  # reported in the JSON line, exit status 1
        return {"error": f"{type(e).__name__}: {e}"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--block", type=int, default=15)
    ap.add_argument("--after-saturated", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: our engine alone, no vLLM")
    a = ap.parse_args()
    try:
        import torch
    except ImportError:
        fail("torch is not installed")
    if a.device == "cuda" and not torch.cuda.is_available():
        fail("no CUDA device: bench/gpu_spec.py is for a lent GPU (the CPU path is in tests/test_vllm_stretch.py)")
    try:
        import vllm

        vllm_version = vllm.__version__
    except ImportError:
        vllm_version = None
    from tests.tiny import make_tiny_model

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    t0 = time.perf_counter()
    path = make_tiny_model("qwen3_5", Path(tempfile.mkdtemp()))
    ids = prompts(a.prompts)
    report = {
        "bench": "gpu_spec",
        "gpu": torch.cuda.get_device_name() if a.device == "cuda" else None,
        "device": a.device,
        "vllm": (vllm_version or "not installed") if a.device == "cuda" else "skipped: --device cpu",
        "k": a.k,
        "block": a.block,
        "after_saturated": a.after_saturated,
        "max_tokens": a.max_tokens,
        "engine": part(engine_runs, path, ids, a),
    }
    if a.device == "cuda" and vllm_version:
        report["vllm_runs"] = part(vllm_runs, path, ids, a)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(report))
    if any("error" in report.get(k, {}) for k in ("engine", "vllm_runs")):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
