"""CLI verb of the bundled engine: `generate` (streaming, optionally speculative). A thin layer over
qconv.engine.generate; the speculative decoding benchmark is bench/spec_bench.py."""

from __future__ import annotations

import json
from dataclasses import replace

import click

from qconv.engine.config import model_dir
from qconv.engine.generate import GenerationConfig
from qconv.engine.sampling import SamplingParams
from qconv.engine.spec import SPEC_MODES, SpecConfig
from qconv.errors import QconvError


def _gen_config(path, max_tokens, temperature, top_p, top_k, seed, spec, max_block, stop=()) -> GenerationConfig:
    """Sampling from the options; speculation from the artifact's `speculative` block, --spec / --max-block over it."""
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0 or max_tokens < 1:
        raise QconvError(
            "bad sampling settings", fix="need temperature >= 0, 0 < top-p <= 1, top-k >= 0, max-tokens >= 1"
        )
    if max_block is not None and not 0 <= max_block <= 15:
        raise QconvError(f"--max-block {max_block} out of range", fix="use 0..15")
    sc = SpecConfig.of_artifact(path)
    sc = replace(sc, method=spec or sc.method, max_block=sc.max_block if max_block is None else max_block)
    return GenerationConfig(
        max_tokens=max_tokens, sampling=SamplingParams(temperature, top_p, top_k), seed=seed, stop=tuple(stop), spec=sc
    )


@click.command("generate")
@click.argument("model")
@click.option("--prompt", help="Raw text prompt.")
@click.option("--chat", "chat_text", help="One user message, through the model's chat template.")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--stats", is_flag=True, help="Print tokens/step, acceptance and speed to stderr at the end.")
@click.option(
    "--dequantize",
    is_flag=True,
    help="Artifact: dequantize on load (float32, or bf16 with --dtype bfloat16) instead of running its "
    "int4 Linears through the CPU int kernels (bf16).",
)
@click.option(
    "--dtype",
    type=click.Choice(["auto", "float32", "bfloat16"]),
    default="auto",
    show_default=True,
    help="auto: bf16 for an artifact with the CPU int kernels, else float32.",
)
@click.option("--max-tokens", default=256, show_default=True, help="Most new tokens.")
@click.option("--temperature", default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--top-k", default=0, show_default=True, help="0 = off.")
@click.option("--seed", default=0, show_default=True)
@click.option(
    "--spec",
    type=click.Choice(list(SPEC_MODES)),
    default=None,
    help="Speculative decoding [default: the artifact's speculative config, else lookup].",
)
@click.option(
    "--max-block",
    type=int,
    default=None,
    help="Most draft tokens verified per step [default: the artifact's, else 15].",
)
def generate(
    model,
    prompt,
    chat_text,
    stop,
    stats,
    dequantize,
    dtype,
    max_tokens,
    temperature,
    top_p,
    top_k,
    seed,
    spec,
    max_block,
):
    """Generate from MODEL (a qconv artifact or HF folder), streaming to the terminal."""
    from qconv.engine.generate import GenerationStats, encode_prompt, generate_tokens, stream_text
    from qconv.engine.loader import load_for_engine, load_tokenizer

    if (prompt is None) == (chat_text is None):
        raise QconvError("give exactly one of --prompt and --chat")
    path = model_dir(model)
    cfg = _gen_config(path, max_tokens, temperature, top_p, top_k, seed, spec, max_block, stop)
    tok = load_tokenizer(path)
    ids = encode_prompt(tok, chat_text if chat_text is not None else prompt, chat=chat_text is not None)
    m = load_for_engine(path, dequantize, dtype)
    cfg = replace(cfg, spec=cfg.spec.for_model(m) if spec is None else cfg.spec)
    st = GenerationStats()
    for piece in stream_text(tok, generate_tokens(m, ids, cfg, st), cfg.stop):
        click.echo(piece, nl=False)
    click.echo()
    if stats:
        click.echo(json.dumps({"spec": cfg.spec.method, **st.to_dict()}), err=True)


COMMANDS = [generate]
