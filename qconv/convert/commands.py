"""CLI verbs of the convert area: convert gguf / quantized, recipes list/show (`qconv build` is qconv.build)."""

from __future__ import annotations

from pathlib import Path

import click


@click.group()
def convert():
    """Convert model formats."""


@convert.command("gguf")
@click.argument("gguf_file", type=click.Path(path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--dtype", default="bfloat16", show_default=True, type=click.Choice(["bfloat16", "float16", "float32"]))
@click.option("--force", is_flag=True, help="Replace an existing OUT.")
@click.option("-v", "--verbose", is_flag=True, help="Show the libraries' output (progress bars, logs) as it comes.")
def convert_gguf(gguf_file, out, dtype, force, verbose):
    """Import a GGUF file into a Hugging Face safetensors folder with its tokenizer."""
    import logging

    from qconv import progress
    from qconv.convert.gguf import import_gguf

    with progress.JobView(
        verbose=verbose, quantizer=False
    ):  # one stage line; transformers' bars and warnings stay off the terminal
        logging.getLogger(__name__).info(
            f"gguf import: {Path(gguf_file).name} -> {dtype}", extra={**progress.stage("gguf import"), **progress.SHOW}
        )
        import_gguf(gguf_file, out, dtype=dtype, force=force)
    click.echo(str(out))


@convert.command("quantized")
@click.argument("src")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--revision", help="Hub revision (branch, tag or commit) to pin.")
@click.option("--force", is_flag=True, help="Replace an existing OUT.")
def convert_quantized(src, out, revision, force):
    """Import a GPTQ / AWQ / AutoRound / compressed-tensors checkpoint losslessly into compressed-tensors
    pack-quantized (codes, scales and zero points repacked, never requantized)."""
    from qconv.convert.imported import convert_quantized as run

    m = run(src, out, force=force, revision=revision)
    click.echo(
        f"{out}: {len(m.build.kept)} quantized modules from {m.source.quantization['method']} "
        f"({m.total_size() / 1e9:.3f} GB)"
    )


@click.group()
def recipes():
    """List and show recipes."""


@recipes.command("list")
def recipes_list():
    """Built-in recipes."""
    from qconv.recipes import builtin_recipes, load_recipe

    for name in builtin_recipes():
        r = load_recipe(name)
        click.echo(f"{name:10s} {r.card.name:12s} {r.description.split(';')[0][:90]}")


@recipes.command("show")
@click.argument("name")
def recipes_show(name):
    """Print a recipe (built-in name or YAML path), validated and with defaults filled in."""
    import yaml

    from qconv.recipes import load_recipe

    r = load_recipe(name)
    click.echo(f"# sha256 {r.sha256}")
    click.echo(yaml.safe_dump(r.to_dict(), sort_keys=False))


COMMANDS = [convert, recipes]
