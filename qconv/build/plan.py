"""The resolved build plan: every choice a build makes from its options, its recipe and the model, made ONCE
(`BuildPlan.make`) and handed to every stage. Nothing downstream resolves the device, the calibration size or the
rotated modules again.

Each field names the cached stages that read it (`reads(...)`): a stage's cache key is derived from exactly those
fields plus its inputs' identities (`BuildPlan.key`), so a new knob is one field here, keyed where it is declared,
and never a stale stage silently reused because a hand-written key forgot it."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qconv.build.budget import budget_label, selection_budget
from qconv.build.options import BuildOptions, calibration_choice, eval_text, use_streaming
from qconv.build.workdir import stage_key
from qconv.calibrate.units import Unit
from qconv.convert.layout import Layout, candidate_units
from qconv.convert.sources import ResolvedSource
from qconv.fsutil import sha256_file
from qconv.recipes.recipe import Recipe

log = logging.getLogger(__name__)

CALIBRATION, SENSITIVITY, QUANTIZATION, QUALITY = STAGES = ("calibration", "sensitivity", "quantization", "quality")
SENSITIVITY_SAMPLES = 8  # a few sequences rank the units; all of them feed GPTQ


def reads(*stages: str, **kw: Any) -> Any:
    """A plan field read by these cached stages (their keys include it)."""
    assert set(stages) <= set(STAGES), stages
    return field(metadata={"stages": stages}, **kw)


def keyed(value: Any) -> Any:
    """A field's value as the JSON a stage key hashes: dataclasses as dicts, dtypes and paths as text."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return keyed(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(k): keyed(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [keyed(v) for v in value]
    if isinstance(value, (torch.dtype, Path)):
        return str(value)
    return value


@dataclass(frozen=True)
class BuildPlan:
    """What one build does, resolved. The stage fields are keyed (see `reads`); the rest are not read by any cached
    stage (where the artifact goes, whether gates fail the build, how the layers are held in memory)."""

    source: ResolvedSource = field(compare=False, repr=False)
    recipe: Recipe = field(compare=False, repr=False)
    layout: Layout = field(compare=False, repr=False)  # the uniform per-module decisions before the selection
    # where and in what it computes
    device: str = reads(SENSITIVITY, QUANTIZATION, QUALITY)
    compute_dtype: torch.dtype = reads(CALIBRATION, SENSITIVITY, QUANTIZATION, QUALITY)
    cpu_isa: str | None = reads(CALIBRATION, SENSITIVITY, QUANTIZATION, QUALITY)  # the CPU's kernels (None on GPU)
    stream: bool = reads()  # layers streamed from disk: the same numbers, bounded memory
    # calibration
    dataset: str | None = reads(CALIBRATION)
    dataset_sha256: str | None = reads(CALIBRATION)  # of a dataset file (a Hub id is its own name)
    default_dataset: str = reads(CALIBRATION)
    split: str = reads(CALIBRATION)
    samples: int = reads(CALIBRATION)
    seq_len: int = reads(CALIBRATION)
    seed: int = reads(CALIBRATION, QUANTIZATION)
    # selection
    units: tuple[Unit, ...] = reads(SENSITIVITY)  # the candidates, scored as they will be rounded
    rotated: tuple[str, ...] = reads(SENSITIVITY, QUANTIZATION)  # Linears the recipe's rotation turns
    sensitivity: str = reads(SENSITIVITY)  # proxy | kld
    sensitivity_samples: int = reads(SENSITIVITY)
    budget_bytes: int = reads()  # the selection's: reaches quantization through the modules it chose
    budget_label: str = reads()
    budget_note: str = reads()  # how an `auto` budget was found
    # quantization
    quantizer: Any = reads(SENSITIVITY, QUANTIZATION)  # recipe.quantizer (rotation block included)
    schemes: dict = reads(QUANTIZATION)
    tied_embeddings: str = reads(QUANTIZATION)  # the recipe's tied_embeddings
    untie: bool = reads(QUANTIZATION)  # the layout unties a tied head
    tied: bool = reads(QUANTIZATION)  # the layout keeps the head tied
    tools: dict = reads(QUANTIZATION)
    max_shard_size: str = reads(QUANTIZATION)
    # quality
    eval_text: str | None = reads()  # what is read: `eval_text_id` keys it
    eval_text_id: str | None = reads(QUALITY)
    quality: Any = reads(QUALITY)  # recipe.quality
    gates: bool = reads()

    @classmethod
    def make(
        cls, opts: BuildOptions, recipe: Recipe, source: ResolvedSource, layout: Layout, dry_run: bool = False
    ) -> BuildPlan:
        """The plan of a build (or, `dry_run`, of the build `--dry-run` describes: a card planned for without one
        present). A build asking for a GPU it does not have is refused here, before anything is written."""
        from qconv import compute
        from qconv.convert.device import cuda_available, resolve_device
        from qconv.convert.rotation import rotated_modules
        from qconv.convert.stream import MAX_SHARD_SIZE
        from qconv.manifest import tool_versions

        if dry_run:
            asked = opts.device or "auto"
            device = "cuda" if asked == "cuda" or (asked == "auto" and (opts.card or cuda_available())) else "cpu"
        else:
            device = resolve_device(opts.device)
        dtype = compute.resolve(opts.compute_dtype, device)
        cal = recipe.calibration
        dataset, samples, seq_len = calibration_choice(opts, recipe)
        data_file = Path(dataset).expanduser() if dataset else None
        text = eval_text(opts, recipe)
        budget, note = selection_budget(opts, recipe, layout, source.config)
        return cls(
            source=source,
            recipe=recipe,
            layout=layout,
            device=device,
            compute_dtype=dtype,
            cpu_isa=torch.backends.cpu.get_cpu_capability() if device == "cpu" else None,
            stream=use_streaming(opts, layout, recipe.quantizer.algorithm, dtype),
            dataset=dataset,
            dataset_sha256=sha256_file(data_file) if data_file and data_file.is_file() and not dry_run else None,
            default_dataset=cal.default_dataset,
            split=cal.split,
            samples=samples,
            seq_len=seq_len,
            seed=cal.seed if opts.seed is None else opts.seed,
            units=tuple(candidate_units(layout, recipe)),
            rotated=tuple(rotated_modules(layout.modules, recipe)),
            sensitivity=opts.sensitivity,
            sensitivity_samples=SENSITIVITY_SAMPLES,
            budget_bytes=budget,
            budget_label=budget_label(opts, recipe),
            budget_note=note,
            quantizer=recipe.quantizer,
            schemes=dict(recipe.schemes),
            tied_embeddings=recipe.tied_embeddings,
            untie=layout.untie_embeddings,
            tied=layout.tied_embeddings,
            tools=tool_versions(),
            max_shard_size=MAX_SHARD_SIZE,
            eval_text=text,
            eval_text_id=(sha256_file(Path(text)) if Path(text).is_file() else text) if text and not dry_run else None,
            quality=recipe.quality,
            gates=opts.gates,
        )

    @property
    def scored(self) -> bool:
        """Whether the selection has anything to choose, so the sensitivity stage runs."""
        return self.budget_bytes > 0 and any(not u.refusal for u in self.units)

    def key(self, stage: str, **inputs: Any) -> str:
        """Stage `stage`'s cache key: the fields it reads (`reads`) and its inputs (earlier stages' results)."""
        assert stage in STAGES, stage
        read = {f.name: keyed(getattr(self, f.name)) for f in dataclasses.fields(self) if stage in stage_reads(f)}
        return stage_key(stage, read, {k: keyed(v) for k, v in inputs.items()})


def stage_reads(f: dataclasses.Field) -> tuple[str, ...]:
    return f.metadata.get("stages", ())


def fields_read_by(stage: str) -> list[str]:
    return [f.name for f in dataclasses.fields(BuildPlan) if stage in stage_reads(f)]
