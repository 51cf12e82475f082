"""Plain greedy decode speed: our runtime vs transformers.generate on the same weights, dtype and prompt.

Prints one JSON line: {"ours_tok_s", "hf_tok_s", "ratio", ...}. Both sides decode the same number of new tokens after
the same prompt, EOS masked out (transformers by min_new_tokens, ours by the same mask); time includes the prefill;
best of `--repeats` runs each, interleaved (ours, theirs, ours, theirs, ...) so load changes on a shared machine hit
both. `ratio` is wall-clock tokens/s (ours / transformers); `cpu_time_ratio` the same from process CPU time, which is
steadier when other jobs share the cores.

MODEL may be a plain HF folder or a qconv artifact. For an artifact, transformers loads it with compressed-tensors'
`dequantize=True` (dense bf16 nn.Linear weights, decompressed once at load -- not CompressedLinear, which would
decompress on every forward), and ours runs its int4 Linears through torch's CPU int kernels (`--dequantize`: ours
dequantized on load too; `--also-dequantized`: time that as a third engine in the same run).

`--kernels` instead times the single matmuls behind the choice of kernels (SmolLM2's shapes, batch rows 1..64)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / ".cache/models/smollm2-135m-instruct"


def ours_generate(model, prompt: torch.Tensor, new: int, cache) -> list[int]:
    """Greedy, EOS masked out like transformers' min_new_tokens does (else the two diverge where EOS wins)."""
    eos = list(model.config.eos_token_ids)

    def pick(logits: torch.Tensor) -> int:
        logits[eos] = -float("inf")
        return int(logits.argmax())

    cache.reset([0])
    out = [pick(model(prompt, cache)[0, -1])]
    tok = torch.tensor([[out[-1]]])
    for _ in range(new - 1):
        tok[0, 0] = pick(model(tok, cache)[0, -1])
        out.append(int(tok[0, 0]))
    return out


def hf_generate(model, prompt: torch.Tensor, new: int) -> list[int]:
    ids = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        num_beams=1,
    )
    return ids[0, prompt.shape[1] :].tolist()


def load_hf(path: Path, dtype: torch.dtype):
    """transformers' model of the same weights. An artifact is decompressed by compressed-tensors at load
    (qconv's loader, `dequantize=True`) and its dense weights are moved into a fresh plain model of the same config: transformers'
    decompressed model keeps compressed-tensors' forward wrappers and parameter caches on every Linear."""
    from torch import nn
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    cfg = AutoConfig.from_pretrained(path)
    if getattr(cfg, "quantization_config", None) is None:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    else:
        from qconv.convert.hfmodel import load_causal_lm  # transformers alone cannot load a packed embed_tokens

        deq = load_causal_lm(path, dtype=dtype)
        dense = {k: v.detach().to(dtype) for k, v in deq.state_dict().items()}
        del cfg.quantization_config
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
        model.load_state_dict({k: dense[k] for k in model.state_dict()}, strict=True)
        model.generation_config = GenerationConfig.from_pretrained(path)
    for name, mod in model.named_modules():  # plain dense Linears: nothing of compressed-tensors left on them
        if isinstance(mod, nn.Linear) and (
            "forward" in vars(mod) or type(mod) is not nn.Linear or mod.weight.dtype != dtype
        ):
            raise SystemExit(f"transformers' {name} is not a plain dense {dtype} Linear: {type(mod).__name__}")
    return model


def divergence(a: list[int], b: list[int]) -> dict:
    diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    return {"same_tokens": a == b, "tokens_differ": len(diff), "first_divergence": diff[0] if diff else None}


def near_tie(path: Path, model, prompt: torch.Tensor, a: list[int], b: list[int]) -> dict:
    """Where two greedy runs first part: the fp32 dequantized model's logit gap between the two picks on the shared
    prefix, next to how far `model`'s (bf16) logits there are from fp32. gap < error: a near-tie that bf16 rounding
    decides, not a wrong computation."""
    from qconv.engine import load_model

    i = divergence(a, b)["first_divergence"]
    if i is None:
        return {}
    seq = torch.cat([prompt, torch.tensor([a[:i]], dtype=torch.long)], dim=1)
    ref = load_model(path, dtype=torch.float32)
    exact = ref(seq, ref.new_cache(1, seq.shape[1]))[0, -1]
    cache = model.new_cache(1, seq.shape[1])
    model(seq[:, :-1], cache)
    ours = model(seq[:, -1:], cache)[0, -1]  # a decode step, as in the run (int kernels at 1 row)
    return {
        "fp32_gap_at_divergence": round(abs(float(exact[a[i]] - exact[b[i]])), 4),
        "bf16_logit_error_there": round(float((ours - exact).abs().max()), 4),
    }


def decode_bench(a) -> dict:
    from qconv.engine import load_model, load_tokenizer
    from qconv.engine.int_linear import Int4Linear

    path = Path(a.model) if a.model else DEFAULT_MODEL
    dtype = getattr(torch, a.dtype)
    tok = load_tokenizer(path)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Write a short story about a lighthouse keeper."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    prompt = torch.tensor([tok(text)["input_ids"]])
    ours = load_model(path, dtype=dtype, int_kernels=False if a.dequantize else None)
    engines = {"ours": lambda: ours_generate(ours, prompt, a.new, cache)}
    ref = load_hf(path, dtype)
    engines["hf"] = lambda: hf_generate(ref, prompt, a.new)
    cache = ours.new_cache(1, prompt.shape[1] + a.new + 1)
    if a.also_dequantized:
        dense = load_model(path, dtype=dtype, int_kernels=False)
        engines["ours_dequantized"] = lambda: ours_generate(dense, prompt, a.new, cache)
    best = dict.fromkeys(engines, float("inf"))
    cpu = dict.fromkeys(engines, float("inf"))  # process CPU seconds: steadier on a shared machine
    outs = {}
    with torch.inference_mode():
        ours_generate(ours, prompt, 4, cache), hf_generate(ref, prompt, 4)  # warm-up
        for _ in range(a.repeats):
            for name, fn in engines.items():
                t0, c0 = time.perf_counter(), time.process_time()
                outs[name] = fn()
                best[name] = min(best[name], time.perf_counter() - t0)
                cpu[name] = min(cpu[name], time.process_time() - c0)
    tps = {k: a.new / v for k, v in best.items()}
    r = {
        "model": path.name,
        "dtype": a.dtype,
        "threads": torch.get_num_threads(),
        "int4_linears": sum(isinstance(m, Int4Linear) for m in ours.modules()),
        "embedding": type(ours.embed_tokens).__name__,
        "prompt_tokens": prompt.shape[1],
        "new_tokens": a.new,
        "ours_tok_s": round(tps["ours"], 2),
        "hf_tok_s": round(tps["hf"], 2),
        "ratio": round(tps["ours"] / tps["hf"], 3),
        "cpu_time_ratio": round(cpu["hf"] / cpu["ours"], 3),
        **divergence(outs["ours"], outs["hf"]),
        **near_tie(path, ours, prompt, outs["ours"], outs["hf"]),
    }
    if a.also_dequantized:
        r["ours_dequantized_tok_s"] = round(tps["ours_dequantized"], 2)
        r["dequantized_ratio"] = round(tps["ours_dequantized"] / tps["hf"], 3)
        r["dequantized_vs_hf"] = divergence(outs["ours_dequantized"], outs["hf"])
        r["int_vs_dequantized"] = divergence(outs["ours"], outs["ours_dequantized"])
    return r


def _time_us(fn, n: int = 10, rounds: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return round(best * 1e6, 1)


def kernel_bench(rows=(1, 2, 4, 16, 64)) -> dict:
    """µs per matmul, bf16 activations: plain bf16 GEMM, oneDNN-packed bf16, int4 kernel, int8 (per-channel) kernel;
    and the group-64 int8 lm_head as 9 per-group int8 calls summed."""
    from qconv.engine.cpu_pack import packing_available

    pack = packing_available(torch.device("cpu"), torch.bfloat16)  # an AVX2-only CPU has no oneDNN bf16 path
    g = torch.Generator().manual_seed(0)
    out = {}
    for N, K, group in ((960, 576, 64), (3072, 576, 64), (576, 576, 64), (576, 1536, 128), (49152, 576, 64)):
        w = torch.randn(N, K, generator=g).to(torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 1) if pack else None
        q4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (N, K), dtype=torch.int32), 1)
        sz = torch.stack([torch.rand(K // group, N), torch.zeros(K // group, N)], -1).to(torch.bfloat16)
        q8, s8 = torch.randint(-127, 128, (N, K), dtype=torch.int8), torch.rand(N, K // 64).to(torch.bfloat16)
        slices = [(q8[:, i : i + 64].contiguous(), s8[:, i // 64].contiguous()) for i in range(0, K, 64)]
        for M in rows if N < 49152 else rows[:3]:
            x = torch.randn(M, K, generator=g).to(torch.bfloat16)
            xs = [x[:, i : i + 64].contiguous() for i in range(0, K, 64)]
            row = {
                "plain_bf16": _time_us(lambda: torch.nn.functional.linear(x, w)),
                "packed_bf16": _time_us(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
                if pack
                else None,
                "int4": _time_us(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, q4, group, sz)),
                "int8_per_channel": _time_us(lambda: torch.ops.aten._weight_int8pack_mm(x, q8, s8[:, 0])),
            }
            if N == 49152:
                row["int8_group64_split"] = _time_us(
                    lambda: sum(
                        torch.ops.aten._weight_int8pack_mm(xi, qi, si).float() for xi, (qi, si) in zip(xs, slices)
                    )
                )
            out[f"{N}x{K} g{group} M={M}"] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None, help="HF folder or qconv artifact (default: imported SmolLM2)")
    ap.add_argument("--model", dest="model_opt", default=None, help="same as the positional MODEL")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    ap.add_argument("--dequantize", action="store_true", help="ours: dequantize an artifact on load (no int kernels)")
    ap.add_argument("--also-dequantized", action="store_true", help="also time ours dequantized, same run")
    ap.add_argument("--kernels", action="store_true", help="time the single matmuls instead (bf16, batch rows)")
    a = ap.parse_args()
    a.model = a.model_opt or a.model
    if a.threads:
        torch.set_num_threads(a.threads)
    r = {"threads": torch.get_num_threads(), "kernels_us": kernel_bench()} if a.kernels else decode_bench(a)
    print(json.dumps(r))


if __name__ == "__main__":
    main()
