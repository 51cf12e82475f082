"""Plain greedy decode speed: our runtime vs transformers.generate on the same weights, dtype and prompt.

Prints one JSON line: {"ours_tok_s", "hf_tok_s", "ratio", ...}. Both sides decode the same number of new tokens
(EOS ignored) after the same prompt; time includes the prefill; best of `--repeats` runs each, interleaved.
`ratio` is wall-clock tokens/s (ours / transformers); `cpu_time_ratio` the same from process CPU time, which is
steadier when other jobs share the cores."""

from __future__ import annotations

import argparse
import json
import time

import torch


def ours_generate(model, prompt: torch.Tensor, new: int, cache) -> list[int]:
    cache.reset([0])
    logits = model(prompt, cache)
    out = [int(logits[0, -1].argmax())]
    tok = torch.tensor([[out[-1]]])
    for _ in range(new - 1):
        tok[0, 0] = int(model(tok, cache)[0, -1].argmax())
        out.append(int(tok[0, 0]))
    return out


def hf_generate(model, prompt: torch.Tensor, new: int) -> list[int]:
    ids = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, num_beams=1)
    return ids[0, prompt.shape[1]:].tolist()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None, help="HF folder (default: the imported SmolLM2-135M)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from qconv.runtime import load_model, load_tokenizer

    path = Path(a.model) if a.model else Path(__file__).resolve().parents[1] / ".cache/models/smollm2-135m-instruct"
    dtype = getattr(torch, a.dtype)
    tok = load_tokenizer(path)
    text = tok.apply_chat_template([{"role": "user", "content": "Write a short story about a lighthouse keeper."}],
                                   tokenize=False, add_generation_prompt=True)
    prompt = torch.tensor([tok(text)["input_ids"]])
    ours = load_model(path, dtype=dtype)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    cache = ours.new_cache(1, prompt.shape[1] + a.new + 1)
    best = {"ours": float("inf"), "hf": float("inf")}
    cpu = {"ours": float("inf"), "hf": float("inf")}  # process CPU seconds: steadier on a shared machine
    outs = {}
    with torch.inference_mode():
        ours_generate(ours, prompt, 4, cache), hf_generate(ref, prompt, 4)  # warm-up
        for _ in range(a.repeats):
            for name, fn in (("ours", lambda: ours_generate(ours, prompt, a.new, cache)),
                             ("hf", lambda: hf_generate(ref, prompt, a.new))):
                t0, c0 = time.perf_counter(), time.process_time()
                outs[name] = fn()
                best[name] = min(best[name], time.perf_counter() - t0)
                cpu[name] = min(cpu[name], time.process_time() - c0)
    ours_tps, hf_tps = a.new / best["ours"], a.new / best["hf"]
    print(json.dumps({"model": path.name, "dtype": a.dtype, "threads": torch.get_num_threads(),
                      "prompt_tokens": prompt.shape[1], "new_tokens": a.new, "ours_tok_s": round(ours_tps, 2),
                      "hf_tok_s": round(hf_tps, 2), "ratio": round(ours_tps / hf_tps, 3),
                      "cpu_time_ratio": round(cpu["hf"] / cpu["ours"], 3),
                      "same_tokens": outs["ours"] == outs["hf"]}))


if __name__ == "__main__":
    main()
