"""One device session's checks, for a lent GPU (a bare H200: torch, Triton, transformers; no vLLM, no pytest, no
network), in under 8 minutes. One JSON line per part; a part that raises prints {"part", "error"} and the exit
status is 1; without CUDA one line with "error" and exit status 2 (`--device cpu --small` runs the KVarN parts at
tiny shapes here, under TRITON_INTERPRET=1: the script's own check, tests/test_kvarn_triton.py).

Parts (PARTS, in order; `--parts a,b` picks):
- kernels: the plugin's Triton encode byte-equal to qconv.kv's codec (CPU) at D=256 G=128; then the attention at
  the 27B's layer shape (24 query / 4 KV heads) for a decode (1 token), a spec-decode verify (5 tokens) and a
  prefill chunk (2,048 tokens) at 32K and 128K of context: milliseconds, and the peak extra memory
  (torch.cuda.max_memory_reserved over what was reserved before) against kvarn_attention.work_bytes, the bound
  the backend reserves and `qconv plan` sets aside on a 24 GB RTX 3090 (its `budget_3090_gib`).
- backend: the vLLM backend's layer code without vLLM (KVarNAttentionImpl driven like vLLM's runner: a prefill
  closing a tile next to one crossing the sink, verifies, decodes), CUDA (Triton encode + attention) against the
  same steps on the CPU torch path.
- engine: our engine's logits against transformers on CUDA (tiny llama / qwen3 / qwen3_5, prefill + 32 decode
  steps), and greedy speculative decoding (lookup; MTP, hybrid) equal to plain greedy.
- bench: `qconv bench` on our engine on CUDA, the copy/code/chat/math workloads at concurrency 1, 4, 16, on a
  model of SmolLM2-135M's shape (its carried config and tokenizer, seeded random bf16 weights: the engine runs an
  artifact's int4 weights dense on CUDA, so the speed is the shape's). `qconv serve`'s server needs fastapi,
  uvicorn and their chain, which the device lacks: they come from the carried wheels (bench/gpu_day_wheels.txt),
  unpacked into a temporary folder first on the server's path.
- build: the streamed GPTQ build (bench/gpu_build.py) needs llm-compressor and its chain (datasets, pyarrow,
  pandas, accelerate, ...), far over the 40 MiB of wheels a session carries; it is left out and says so. Run
  bench/gpu_build.py where those are installed.
Every timing here is an H200's; an RTX 3090 runs FP64 at 1/64 of FP32 and has 101,376 B of shared memory a block
(the compile test checks sm_86 limits on the CPU). A later part registers itself with @part("name").

    python bench/gpu_day.py --fetch-wheels          # here, before a device session: the wheels into .cache/wheels
    python bench/gpu_day.py [--parts kernels,backend,engine,bench,build] [--device cuda] [--small]

The device call carries `.cache/wheels` and SmolLM2's config and tokenizer files (`.cache/models/
smollm2-135m-instruct/{config.json,generation_config.json,tokenizer.json,tokenizer_config.json,chat_template.jinja}`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "plugins" / "vllm"), str(REPO / "bench")]
GIB = 2**30
PARTS: dict[str, Callable[[argparse.Namespace], dict]] = {}
HQ, HKV, D, G = 24, 4, 256, 128  # the 27B's attention layer; tile of the huge profile (kvarn_k4v2_g128)


def part(name: str):
    """Register a part: a function of the parsed arguments returning its JSON fields."""

    def add(fn):
        PARTS[name] = fn
        return fn

    return add


def _sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


@part("kernels")
def kernels(a: argparse.Namespace) -> dict:
    from qconv.kv.kvarn import kvarn
    from qconv_vllm import kvarn_attention as ka
    from qconv_vllm import kvarn_triton as kt
    from qconv_vllm.kvarn_metadata import exact_positions

    dev, out = a.device, {}
    d, g, hq, hkv = (64, 64, 4, 2) if a.small else (D, G, HQ, HKV)
    gen = torch.Generator().manual_seed(0)
    for kb, vb in ((4, 2), (4, 4)):
        k = (
            torch.randn(2 if a.small else 8, g, d, generator=gen) * (0.2 + 4 * torch.rand(1, 1, d, generator=gen) ** 4)
        ).half()
        v = torch.randn(k.shape[0], g, d, generator=gen).half()
        rec = kt.encode_tiles(k.to(dev), v.to(dev), kb, vb).cpu()
        ref = kvarn(kb, vb, g).encode(k.float(), v.float())
        out[f"encode_k{kb}v{vb}_bytes_differing"] = int((rec != ref).sum())
    kb, vb = 4, 2
    distinct = 4 if a.small else 64  # records repeated through the block table (encode is not what is timed)
    k, v = (torch.randn(distinct * hkv, g, d, generator=gen).half().to(dev) for _ in range(2))
    pool = kt.encode_tiles(k, v, kb, vb).view(distinct, hkv, -1)
    plan = kvarn(kb, vb, g).serving_work_bytes(17, hq, hkv, d, 1, 2048)  # 27B: 16 layers + MTP, huge profile
    out["budget_3090_gib"] = round(plan / GIB, 3)
    shapes = [(1, 1), (5, 1), (2048, 1)] if not a.small else [(1, 2), (5, 1), (96, 1)]
    for context in (4 * g,) if a.small else (32768, 131072):
        for tokens, reqs in shapes:
            qs = [i * tokens for i in range(reqs + 1)]
            lens = [context] * reqs
            pos, starts = exact_positions(qs, lens, g)
            table = torch.randint(0, distinct, (reqs, context // g + 1), generator=gen).to(dev)
            args = (
                torch.randn(qs[-1], hq, d, generator=gen).half().to(dev),
                pool,
                table,
                torch.tensor(lens, device=dev),
                torch.tensor(qs, device=dev),
                torch.randn(hkv, len(pos), d, generator=gen).half().to(dev),
                torch.randn(hkv, len(pos), d, generator=gen).half().to(dev),
                torch.tensor(pos, device=dev),
                torch.tensor(starts, device=dev),
                kb,
                vb,
                g,
                d**-0.5,
            )
            ka.attention(*args)  # compile
            _sync(dev)
            if dev == "cuda":  # cached blocks released first, so the reserved peak counts what the calls need
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                base, base_alloc = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            for _ in range(a.repeat):
                o = ka.attention(*args)
            _sync(dev)
            ms = (time.perf_counter() - t0) / a.repeat * 1e3
            bound = ka.work_bytes(qs[-1], reqs, hq, hkv, d, g)
            row = {"ms": round(ms, 3), "finite": bool(torch.isfinite(o).all()), "bound_mib": round(bound / 2**20, 1)}
            if dev == "cuda":
                extra = torch.cuda.max_memory_reserved() - base
                alloc = torch.cuda.max_memory_allocated() - base_alloc
                row.update(
                    extra_reserved_mib=round(extra / 2**20, 1),
                    extra_allocated_mib=round(alloc / 2**20, 1),
                    within_bound=max(extra, alloc) <= bound,
                )
            out[f"attention_ctx{context}_q{tokens}x{reqs}"] = row
    out["pass"] = all(v == 0 for n, v in out.items() if n.endswith("_differing")) and all(
        r["finite"] and r.get("within_bound", True) for n, r in out.items() if n.startswith("attention_")
    )
    return out


@part("backend")
def backend(a: argparse.Namespace) -> dict:
    """The mixed-batch scenario of tests/test_kvarn_vllm_codec.py's 27B-layout test, on `device` (Triton) and
    on the CPU (torch path), the same inputs."""
    from qconv_vllm.kvarn_backend import KVarNAttentionImpl
    from qconv_vllm.kvarn_metadata import SlotTable, step_metadata

    d, hk, grp, preset = (64, 1, 2, "kvarn_k4v2_g64") if a.small else (D, HKV, HQ // HKV, "kvarn_k4v2_g128")
    g = int(preset.rsplit("_g", 1)[1])
    gen = torch.Generator().manual_seed(4)
    lens = (2 * g + 8, g + 6)
    data = [[torch.randn(t, h, d, generator=gen) for h in (hk * grp, hk, hk)] for t in lens]
    steps = [((0, 2 * g - 6), None), ((2 * g - 6, 2 * g + 2), (0, g + 4)), ((2 * g + 2, 2 * g + 7), (g + 4, g + 5))]
    steps.append(((2 * g + 7, 2 * g + 8), (g + 5, g + 6)))
    results = []
    for dev, kernels in (("cpu", False), (a.device, True)):
        impl = KVarNAttentionImpl(hk * grp, d, d**-0.5, hk, kv_cache_dtype=preset)
        impl.kernels = kernels
        impl.reserve(4, dev)
        rb = impl.codec.bytes_per_token
        pool = torch.zeros(8, hk, g, rb, dtype=torch.uint8, device=dev)
        table, blocks, outs = SlotTable(4), [[0, 5, 7], [3, 1]], [[], []]
        for step in steps:
            live = [i for i, ab in enumerate(step) if ab]
            qs = [0]
            for i in live:
                qs.append(qs[-1] + step[i][1] - step[i][0])
            bt = torch.tensor([blocks[i] + [0] * (3 - len(blocks[i])) for i in live], dtype=torch.int32, device=dev)
            m = step_metadata(table, qs, [step[i][1] for i in live], [blocks[i][0] for i in live], bt, g)
            q, k, v = (torch.cat([data[i][j][slice(*step[i])] for i in live]).flatten(1).to(dev) for j in range(3))
            o = impl.forward(None, q.half(), k.half(), v.half(), pool, m)
            for n, i in enumerate(live):
                outs[i].append(o[qs[n] : qs[n + 1]].float().cpu())
        results.append(torch.cat([torch.cat(x) for x in outs]))
    err = float((results[1] - results[0]).abs().max())
    return {"layout": f"{hk * grp}q/{hk}kv D={d} {preset}", "max_abs_vs_cpu": err, "pass": err <= 2e-3}


@part("engine")
def engine(a: argparse.Namespace) -> dict:
    from qconv.engine import load_model
    from qconv.engine.generate import GenerationConfig, generate_tokens
    from qconv.engine.spec import SpecConfig
    from tests.tiny import make_tiny_model, parity

    dev, root, out = a.device, Path(tempfile.mkdtemp()), {}
    for fam in ("llama", "qwen3", "qwen3_5"):
        pre, dec = parity(make_tiny_model(fam, root / fam), device=dev)
        out[f"parity_{fam}"] = {"prefill_max_abs": pre, "decode_max_abs": dec, "pass": max(pre, dec) <= 1e-3}
    for fam, modes in (("llama", ("lookup",)), ("qwen3_5", ("mtp", "hybrid"))):
        model = load_model(root / fam).to(dev)
        model.config.eos_token_ids = []  # random weights say eos early: run every token
        g = torch.Generator().manual_seed(2)
        for mode in modes:
            same = 0
            for _ in range(4):
                base = torch.randint(3, 300, (6,), generator=g).tolist()
                ids = base * 3 + base[:2]
                ref = list(generate_tokens(model, ids, GenerationConfig(max_tokens=32)))
                same += ref == list(generate_tokens(model, ids, GenerationConfig(max_tokens=32, spec=SpecConfig(mode))))
            out[f"spec_{fam}_{mode}_equal"] = f"{same}/4"
    out["pass"] = all(r["pass"] for n, r in out.items() if n.startswith("parity_")) and all(
        r == "4/4" for n, r in out.items() if n.startswith("spec_")
    )
    return out


@part("bench")
def bench(a: argparse.Namespace) -> dict:
    from gpu_day_bench import bench_model, run_bench, unpack_wheels

    root = Path(tempfile.mkdtemp())
    site = unpack_wheels(root / "site")
    model = bench_model(root / "model", small=a.small)
    levels = "1,2" if a.small else "1,4,16"
    report = run_bench(model, site, a.device, levels, prompts=2 if a.small else 16, max_tokens=16 if a.small else 96)
    cells = {
        f"{c['workload']}_c{c['concurrency']}": {
            "output_tok_s": c["output_throughput"],
            "per_request_tok_s": c["per_request_output_throughput"],
            "ttft_p50_ms": c["ttft_ms"]["median"],
            "itl_p50_ms": c["itl_ms"]["median"],
            "tokens_per_step": c["spec_decode_acceptance_length"],
            "failed": c["failed"],
        }
        for c in report["cells"]
    }
    return {
        "model": model.name,
        "command": report["command"],
        "cells": cells,
        "pass": bool(cells) and all(c["failed"] == 0 and c["output_tok_s"] > 0 for c in cells.values()),
    }


@part("build")
def build(a: argparse.Namespace) -> dict:
    return {
        "skipped": "llm-compressor's dependency chain is not installed and does not fit the 40 MiB of carried "
        "wheels; run bench/gpu_build.py where it is installed",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny shapes (the CPU check of this script)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--fetch-wheels", action="store_true", help="download the carried wheels here, then stop")
    a = ap.parse_args()
    if a.fetch_wheels:
        from gpu_day_bench import fetch_wheels

        print(json.dumps({"bench": "gpu_day", "wheels": [w.name for w in fetch_wheels()]}))
        return
    names = [p for p in a.parts.split(",") if p]
    unknown = [p for p in names if p not in PARTS]
    if unknown:
        print(json.dumps({"bench": "gpu_day", "error": f"unknown part(s) {unknown}; parts: {list(PARTS)}"}))
        raise SystemExit(2)
    if a.device == "cuda" and not torch.cuda.is_available():
        print(
            json.dumps(
                {
                    "bench": "gpu_day",
                    "error": "no CUDA device (a lent GPU runs this; --device cpu --small checks the script here)",
                }
            )
        )
        raise SystemExit(2)
    gpu = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    failed = False
    for name in names:
        t0 = time.perf_counter()
        try:
            row = {"part": name, **PARTS[name](a)}
        except Exception as e:  # noqa: BLE001 - one line per part, the others still run
            row, failed = (
                {"part": name, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-1500:]},
                True,
            )
        failed |= row.get("pass") is False
        row.update(device=gpu, torch=torch.__version__, wall_s=round(time.perf_counter() - t0, 1))
        print(json.dumps(row), flush=True)
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
