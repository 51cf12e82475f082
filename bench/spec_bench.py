"""Speculative decoding benchmark on SmolLM2 (or any model folder / artifact): per workload, our tokens/step and
speedup over our own plain decode (same run, interleaved per prompt), transformers' prompt-lookup drafter
replayed on our output, and with --transformers transformers' own prompt lookup (same weights, prompts, block size)
vs its own greedy. Prints one JSON line.

    .venv/bin/python bench/spec_bench.py --model .cache/models/smollm2-135m-instruct --threads 1
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from spec_workloads import FILES, run_bench  # noqa: E402

from qconv.engine.config import load_config  # noqa: E402
from qconv.engine.generate import GenerationConfig  # noqa: E402
from qconv.engine.loader import engine_dtype  # noqa: E402
from qconv.engine.spec import SpecConfig  # noqa: E402

DATA = REPO.parent / "shared" / "data"


def transformers_lookup_replay(
    prompts: list[list[int]], outputs: list[list[int]], max_tokens: int, block: int, eos: list[int]
) -> dict:
    """transformers' prompt-lookup drafter (PromptLookupCandidateGenerator, as `generate` sets it up) replayed on
    our greedy outputs: under greedy verification its forwards depend on the token sequence alone, so the drafters
    compare on the same text even where the engines' bf16 numerics make their greedy texts differ."""
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    tokens = forwards = 0
    for prompt, out in zip(prompts, outputs):
        limit = len(prompt) + max_tokens
        gen = PromptLookupCandidateGenerator(
            eos_token_id=torch.tensor(eos), num_output_tokens=block, max_matching_ngram_size=2, max_length=limit
        )
        seq, pos = list(prompt), 0
        while pos < len(out):
            cand = gen.get_candidates(torch.tensor([seq]))[0][0, len(seq) :].tolist()
            n = 0
            while n < len(cand) and pos + n < len(out) and cand[n] == out[pos + n]:
                n += 1
            if n == len(cand) > 0 and len(seq) + len(cand) >= limit:  # generate's is_done_candidate rule
                n -= 1
            take = min(n + 1, len(out) - pos)
            seq += out[pos : pos + take]
            pos += take
            forwards += 1
        tokens += len(out)
    return {"tokens_per_forward": round(tokens / max(forwards, 1), 4), "forwards": forwards, "new_tokens": tokens}


def transformers_run(path: Path, prompts: list[list[int]], max_tokens: int, block: int, eos: list[int], dtype) -> dict:
    """transformers' greedy vs its prompt lookup on the same prompts; forwards counted with a hook."""
    from qconv.convert.hfmodel import load_causal_lm

    hf = load_causal_lm(path, dtype=dtype).eval()
    calls = [0]
    hf.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    res = {"greedy": [0, 0.0, 0], "lookup": [0, 0.0, 0]}  # tokens, seconds, forwards
    for ids in prompts:
        x = torch.tensor([ids])
        for mode, extra in (("greedy", {}), ("lookup", {"prompt_lookup_num_tokens": block})):
            calls[0] = 0
            t = time.perf_counter()
            with torch.inference_mode():
                out = hf.generate(
                    x,
                    attention_mask=torch.ones_like(x),
                    max_new_tokens=max_tokens,
                    do_sample=False,
                    eos_token_id=eos,
                    pad_token_id=eos[0],
                    **extra,
                )
            r = res[mode]
            r[0] += out.shape[1] - x.shape[1]
            r[1] += time.perf_counter() - t
            r[2] += calls[0]
    g, lk = res["greedy"], res["lookup"]
    return {
        "tokens_per_forward": round(lk[0] / lk[2], 4),
        "greedy_tok_s": round(g[0] / g[1], 2),
        "lookup_tok_s": round(lk[0] / lk[1], 2),
        "speedup": round((lk[0] / lk[1]) / (g[0] / g[1]), 3),
        "new_tokens": lk[0],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(REPO / ".cache" / "models" / "smollm2-135m-instruct"))
    ap.add_argument("--workloads", default="copy,code,chat")
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--spec", default="lookup")
    ap.add_argument("--max-block", type=int, default=15)
    ap.add_argument("--ngram", default="1,4", help="prompt lookup's n-gram range min,max")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--transformers", action="store_true", help="also run transformers' prompt lookup")
    ap.add_argument("--fixed-blocks", action="store_true", help="always draft max-block tokens (no acceptance EMA)")
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument(
        "--dequantize",
        action="store_true",
        help="artifact: dense weights (float32, or bf16 with --dtype bfloat16) instead of the int kernels",
    )
    ap.add_argument("--device", default=None, help="run our engine on this device (e.g. cuda)")
    ap.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="both engines' dtype (default: the CLI's, float32 for a plain folder)",
    )
    ap.add_argument(
        "--save-outputs",
        default=None,
        help="write {workload: [[prompt ids, our output ids], ...]} as JSON (bench/spec_replay.py)",
    )
    a = ap.parse_args()
    lo, hi = (int(x) for x in a.ngram.split(","))
    spec = SpecConfig(a.spec, max_block=a.max_block, ngram_min=lo, ngram_max=hi, adaptive=not a.fixed_blocks)
    eos = load_config(a.model).eos_token_ids
    out = {
        "bench": "runtime_spec",
        "model": a.model,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "workloads": {},
    }
    saved: dict[str, list] = {}
    for w in a.workloads.split(","):
        r, ids, outputs = run_bench(
            a.model,
            w,
            Path(a.data) / FILES[w],
            prompts=a.prompts,
            cfg=GenerationConfig(max_tokens=a.max_tokens, spec=spec),
            threads=a.threads,
            dequantize=a.dequantize,
            device=a.device,
            dtype=a.dtype,
            keep_spec=True,
        )
        replay = transformers_lookup_replay(ids, outputs, a.max_tokens, spec.max_block, eos)
        r["transformers_drafter_on_our_output"] = replay
        r["tokens_per_step_vs_transformers_drafter"] = round(
            r["ours"]["tokens_per_step"] / replay["tokens_per_forward"], 3
        )
        if a.transformers:
            dtype = engine_dtype(a.model, a.dequantize, a.dtype)
            t = transformers_run(Path(a.model), ids, a.max_tokens, spec.max_block, eos, dtype)
            r["transformers"] = t
            r["tokens_per_step_vs_transformers"] = round(r["ours"]["tokens_per_step"] / t["tokens_per_forward"], 3)
        out["workloads"][w] = r
        saved[w] = [[p, o] for p, o in zip(ids, outputs)]
        if a.save_outputs:
            Path(a.save_outputs).write_text(json.dumps(saved))
        print(json.dumps({w: r}), file=sys.stderr, flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
