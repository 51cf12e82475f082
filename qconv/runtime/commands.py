"""CLI verbs of the bundled runtime: `generate` (streaming, optionally speculative) and `bench` (speculative
decoding workloads). Thin layers over qconv.runtime.generate / qconv.runtime.bench."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import click

from qconv.errors import QconvError
from qconv.runtime.bench import WORKLOADS
from qconv.runtime.config import model_dir
from qconv.runtime.generate import GenerationConfig
from qconv.runtime.sampling import SamplingParams
from qconv.runtime.spec import SPEC_MODES, SpecConfig

SPEC_CHOICES = click.Choice(list(SPEC_MODES))


def _gen_config(path, max_tokens, temperature, top_p, top_k, seed, spec, max_block, stop=()) -> GenerationConfig:
    """Sampling from the options; speculation from the artifact's `speculative` block, --spec / --max-block over it."""
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0 or max_tokens < 1:
        raise QconvError("bad sampling settings", fix="need temperature >= 0, 0 < top-p <= 1, top-k >= 0, "
                                                      "max-tokens >= 1")
    if max_block is not None and not 0 <= max_block <= 15:
        raise QconvError(f"--max-block {max_block} out of range", fix="use 0..15")
    sc = SpecConfig.of_artifact(path)
    sc = replace(sc, method=spec or sc.method, max_block=sc.max_block if max_block is None else max_block)
    return GenerationConfig(max_tokens=max_tokens, sampling=SamplingParams(temperature, top_p, top_k), seed=seed,
                            stop=tuple(stop), spec=sc)


def _sampling_options(f):
    for opt in reversed([
        click.option("--max-tokens", default=256, show_default=True, help="Most new tokens."),
        click.option("--temperature", default=0.0, show_default=True, help="0 = greedy."),
        click.option("--top-p", default=1.0, show_default=True),
        click.option("--top-k", default=0, show_default=True, help="0 = off."),
        click.option("--seed", default=0, show_default=True),
        click.option("--spec", type=SPEC_CHOICES, default=None,
                     help="Speculative decoding [default: the artifact's speculative config, else lookup]."),
        click.option("--max-block", type=int, default=None,
                     help="Most draft tokens verified per step [default: the artifact's, else 15]."),
    ]):
        f = opt(f)
    return f


_dtype_option = click.option(
    "--dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto", show_default=True,
    help="auto: bf16 for an artifact with the CPU int kernels, else float32.")
_dequantize_option = click.option(
    "--dequantize", is_flag=True,
    help="Artifact: dequantize on load (float32, or bf16 with --dtype bfloat16) instead of running its int4 "
         "Linears through the CPU int kernels (bf16).")


def _load(path: Path, dequantize: bool, dtype: str):
    from qconv.runtime.loader import load_model, runtime_dtype

    return load_model(path, dtype=runtime_dtype(path, dequantize, dtype), int_kernels=False if dequantize else None)


@click.command("generate")
@click.argument("model")
@click.option("--prompt", help="Raw text prompt.")
@click.option("--chat", "chat_text", help="One user message, through the model's chat template.")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--stats", is_flag=True, help="Print tokens/step, acceptance and speed to stderr at the end.")
@_dequantize_option
@_dtype_option
@_sampling_options
def generate(model, prompt, chat_text, stop, stats, dequantize, dtype, max_tokens, temperature, top_p, top_k, seed,
             spec, max_block):
    """Generate from MODEL (a qconv artifact or HF folder), streaming to the terminal."""
    from qconv.runtime.generate import GenerationStats, encode_prompt, generate_tokens, stream_text
    from qconv.runtime.loader import load_tokenizer

    if (prompt is None) == (chat_text is None):
        raise QconvError("give exactly one of --prompt and --chat")
    path = model_dir(model)
    cfg = _gen_config(path, max_tokens, temperature, top_p, top_k, seed, spec, max_block, stop)
    tok = load_tokenizer(path)
    ids = encode_prompt(tok, chat_text if chat_text is not None else prompt, chat=chat_text is not None)
    m = _load(path, dequantize, dtype)
    cfg = replace(cfg, spec=cfg.spec.for_model(m) if spec is None else cfg.spec)
    st = GenerationStats()
    for piece in stream_text(tok, generate_tokens(m, ids, cfg, st), cfg.stop):
        click.echo(piece, nl=False)
    click.echo()
    if stats:
        click.echo(json.dumps({"spec": cfg.spec.method, **st.to_dict()}), err=True)


@click.command("bench")
@click.argument("model")
@click.option("--workload", type=click.Choice(list(WORKLOADS)), required=True,
              help="copy: passages of a text file to repeat; code: HumanEval-style jsonl ('prompt'); "
                   "chat: MT-Bench-style jsonl ('turns'); math: GSM8K-style jsonl ('question').")
@click.option("--data", type=click.Path(), required=True, help="The workload's input file.")
@click.option("--prompts", default=5, show_default=True)
@click.option("--threads", default=0, help="torch CPU threads (0 = torch default).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@_dequantize_option
@_dtype_option
@_sampling_options
def bench(model, workload, data, prompts, threads, as_json, dequantize, dtype, max_tokens, temperature, top_p, top_k,
          seed, spec, max_block):
    """Speculative decoding on MODEL: tokens/step, acceptance per draft position, tok/s, and the speedup over
    plain decoding measured in the same run."""
    from qconv.runtime.bench import run_bench

    path = model_dir(model)
    cfg = _gen_config(path, max_tokens, temperature, top_p, top_k, seed, spec, max_block)
    r, _, _ = run_bench(path, workload, data, prompts=prompts, cfg=cfg, threads=threads, dequantize=dequantize,
                        dtype=dtype, keep_spec=spec is not None)
    if as_json:
        click.echo(json.dumps(r))
        return
    o = r["ours"]
    click.echo(f"{workload}: {r['prompts']} prompts, {o['new_tokens']} tokens, spec={r['spec']}")
    click.echo(f"  tokens/step            {o['tokens_per_step']:.2f}")
    click.echo(f"  tok/s spec | plain     {o['decode_tok_s']:.2f} | {o['plain_decode_tok_s']:.2f}  "
               f"(speedup {o['speedup']:.2f}x, identical to plain: {o['identical_to_plain']})")
    click.echo("  acceptance/position    " + " ".join(f"{a:.2f}" for a in o["acceptance_per_position"]))


COMMANDS = [generate, bench]
