"""What one `qconv build` was asked to do (BuildOptions) and the checks made on it before any work: the recipe with
its budget override, whether to stream, and whether --out is safe to write."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path

from qconv.build.workdir import default_work_dir
from qconv.convert.layout import Layout
from qconv.disk import check_out_folder
from qconv.errors import QconvError
from qconv.manifest import MANIFEST
from qconv.paths import qconv_home
from qconv.recipes.recipe import Recipe, load_recipe

log = logging.getLogger(__name__)


@dataclass
class BuildOptions:
    model: str
    recipe: str = "3090"
    out: Path | None = None
    dataset: str | None = None
    samples: int | None = None
    seq_len: int | None = None
    seed: int | None = None
    revision: str | None = None
    force: bool = False
    gates: bool = True
    eval_text: str | None = None
    eval_tokens: int | None = None  # overrides the recipe's quality.max_tokens (tokens of the text scored)
    work_dir: Path | None = None  # default: QCONV_HOME/work/<hash of the source>
    fresh: bool = False  # ignore cached stages
    stream: bool | None = None  # None: stream when the model is large against free RAM
    upgrade_budget: str | None = (
        None  # overrides the recipe's selection.budget (bytes for int4 g64/g32 or INT8 upgrades)
    )
    bpw: float | None = None  # a bits-per-weight target: the upgrade budget is what it leaves over the uniform plan
    sensitivity: str = "proxy"  # "proxy" (per-layer, cheap) | "kld" (model-level, one forward per unit)
    reference: str | None = None  # quantized --model: the full-precision original for the quality report
    device: str = "auto"  # where layers are calibrated and quantized, and the quality report runs (convert.device)
    compute_dtype: str = "auto"  # what the build's forwards compute in (qconv.compute.resolve)
    card: str | None = None  # --dry-run's device-memory plan: the card to plan for (default: the recipe's)


MAX_BPW = 32.0  # float32 weights: no artifact stores more bits per weight


def check_bpw(bpw: float) -> float:
    """A bits-per-weight target must be a finite number of bits a weight can take (nan and inf are floats too)."""
    if not (math.isfinite(bpw) and 0 < bpw <= MAX_BPW):
        raise QconvError(
            f"bits-per-weight target {bpw} is not a number of bits a weight can take",
            where="--bpw",
            fix=f"pass a number above 0 and at most {MAX_BPW:g} (e.g. --bpw 4.5)",
        )
    return bpw


def recipe_for(opts: BuildOptions) -> Recipe:
    """The recipe with the command line's overrides applied (the selection's budget, the quality report's size):
    qconv.json records the recipe as built."""
    if opts.bpw is not None:
        check_bpw(opts.bpw)
    recipe = load_recipe(opts.recipe)
    if opts.bpw is not None and opts.upgrade_budget is not None:
        raise QconvError(
            "--bpw and --upgrade-budget both set the selection's budget", where="--bpw", fix="pass one of them"
        )
    if opts.upgrade_budget is not None:
        recipe.selection = replace(recipe.selection, budget=str(opts.upgrade_budget))
    if opts.eval_tokens is not None:
        window = recipe.quality.window
        if opts.eval_tokens < window:
            raise QconvError(
                f"--eval-tokens {opts.eval_tokens} is less than one window of the quality report "
                f"({window} tokens, the recipe's quality.window)",
                where="--eval-tokens",
                fix=f"pass --eval-tokens {window} or more (whole windows of {window} are scored)",
            )
        recipe.quality = replace(recipe.quality, max_tokens=opts.eval_tokens)
    return recipe


def calibration_choice(opts: BuildOptions, recipe: Recipe) -> tuple[str | None, int, int]:
    """(dataset or None for the recipe's default, samples, seq_len): the command line's, else the recipe's."""
    cal = recipe.calibration
    return opts.dataset or cal.dataset, opts.samples or cal.samples, opts.seq_len or cal.seq_len


def eval_text(opts: BuildOptions, recipe: Recipe) -> str | None:
    """The held-out text of the quality report, or None (and a warning: the artifact stays unchecked)."""
    text = opts.eval_text or recipe.quality.text
    if not text:
        log.warning(
            "quality report skipped: no held-out text (pass --eval-text FILE_OR_HF_ID, or set quality.text "
            "in the recipe); the artifact is marked unchecked"
        )
    return text or None


def work_root(opts: BuildOptions, src_id: str) -> Path:
    return Path(opts.work_dir) if opts.work_dir else default_work_dir(src_id, opts.revision)


def use_streaming(opts: BuildOptions, layout: Layout, algorithm: str, dtype) -> bool:
    """Whether the build streams its layers from disk (`dtype`: what its forwards compute in, which sets what a
    whole model takes in memory); an algorithm that cannot stream is refused here, before any work."""
    stream = _streams(opts, layout, dtype)
    if stream and algorithm == "autoround":
        raise QconvError(
            "algorithm autoround cannot run on a streamed build: llmcompressor 0.14's AutoRoundModifier walks every "
            "parameter of the model when it starts, which its disk-offload cache cannot serve"
            + (
                ""
                if opts.stream
                else f" (streaming was chosen: {layout.source_bytes / 2**30:.1f} GiB against free RAM)"
            ),
            where="--stream" if opts.stream else "quantizer.algorithm",
            fix="build in memory (drop --stream) on a host with the RAM for the model, or use algorithm gptq "
            "(recipe 3090)",
        )
    return stream


def _streams(opts: BuildOptions, layout: Layout, dtype) -> bool:
    from qconv.convert.stream import should_stream

    stream = should_stream(layout.source_bytes, dtype) if opts.stream is None else opts.stream
    if stream and (layout.untie_embeddings or layout.tied_embeddings):
        if opts.stream:
            raise QconvError(
                "--stream cannot build tied embeddings (the disk-offloaded lm_head shares the embedding's storage)",
                where="--stream",
                fix="build this model in memory (drop --stream); tied embeddings come with small models",
            )
        log.warning("tied embeddings: building in memory although RAM is short (streaming cannot tie them)")
        return False
    return stream


def _protected(opts: BuildOptions) -> dict:
    """What --out must neither be, sit inside, nor contain: the user's inputs and every folder a source resolves to
    or a work dir is made in (known before the source is resolved: a Hub model lands in the Hugging Face cache, an
    imported GGUF under QCONV_HOME/imports, a default work dir under QCONV_HOME/work)."""
    from huggingface_hub.constants import HF_HUB_CACHE

    local = lambda v: Path(v).expanduser() if v and Path(v).expanduser().exists() else None  # noqa: E731
    home = qconv_home()
    return {
        "source model": local(opts.model),
        "Hugging Face cache": HF_HUB_CACHE,
        "work dir": opts.work_dir,
        "work dirs root": home / "work",
        "reference cache": home / "reference",
        "GGUF import cache": home / "imports",
        "calibration dataset": local(opts.dataset),
        "evaluation text": local(opts.eval_text),
    }


def check_out(opts: BuildOptions) -> Path:
    """--out refused before any work when it is missing, unsafe to write or to --force (see check_out_folder)."""
    if opts.out is None:
        raise QconvError("no output folder", where="--out", fix="pass --out DIR")
    return check_out_folder(opts.out, force=opts.force, marker=MANIFEST, protected=_protected(opts))
