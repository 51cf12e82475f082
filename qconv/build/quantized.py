"""`qconv build` on an already-quantized checkpoint: the lossless import (qconv.convert.imported) plus the recipe
applied to what is still high precision, measured against the true original when given."""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from qconv.build.options import eval_text
from qconv.build.quality_stage import REPORTS, record
from qconv.convert.finish import finalize, write_manifest
from qconv.convert.imported import import_into, requant_args, write_import
from qconv.convert.layout import kept_layout
from qconv.convert.quantized import detect_format
from qconv.convert.requires import requirements
from qconv.convert.sources import ResolvedSource, read_config
from qconv.errors import QconvError
from qconv.eval.forward import Forward
from qconv.eval.record import EvalReport, ReferenceModel
from qconv.eval.reference import is_cache
from qconv.eval.run import quality_report
from qconv.fsutil import atomic_dir
from qconv.manifest import Manifest
from qconv.recipes.recipe import Recipe

log = logging.getLogger(__name__)


def build_from_quantized(opts, recipe: Recipe, src: ResolvedSource) -> Manifest:
    """`qconv build` on a quantized checkpoint (called by pipeline.build with the resolved source): keep its
    quantized tensors, requantize what the recipe asks of the rest, measure against `opts.reference` (the true
    original) or else the source itself."""
    fmt = detect_format(src.config, where=str(src.path / "config.json"))
    notes: dict[str, str] = {}
    reference = getattr(opts, "reference", None)
    out = Path(opts.out)
    t0 = time.time()
    with atomic_dir(out, force=opts.force) as tmp:
        imp = import_into(src, fmt, tmp, requant_args(recipe, notes))
        # the checkpoint's own rounding is kept: the recipe's rotation is not applied, the source's own is kept
        rotated = bool((src.config.get("quantization_config") or {}).get("transform_config"))
        requires = requirements(recipe, kept_layout(src.path, src.config, imp.decisions), rotated)
        build = {
            **imp.build,
            "elapsed_s": round(time.time() - t0, 1),
            "notes": notes,
            "streamed": True,
            "reference": reference,
        }
        manifest = write_manifest(tmp, imp.source, recipe, imp.decisions, requires=requires, build=build)
        gate_error = _quality_vs(opts, recipe, src, fmt, reference, tmp, manifest, out)
        finalize(tmp, manifest, changed=REPORTS)
    if gate_error is not None:
        raise gate_error
    return manifest


def _quality_vs(opts, recipe, src, fmt, reference, artifact: Path, manifest: Manifest, final: Path):
    """Quality report against the bf16 original when given, else against the source checkpoint (its lossless
    import, which our engine reads), and the report says which."""
    text = eval_text(opts, recipe)
    if not text:
        manifest.build.quality_reference = None
        return None
    cached = bool(reference) and is_cache(reference)
    model: dict = {}

    def annotate(report: EvalReport) -> None:
        note = (
            (
                f"against cached reference log-probs of the true original (source sha256 "
                f"{report.source.sha256[:16]}...) from {reference}"
                if cached
                else "against the true original model " + str(reference)
            )
            if model["kind"] == "original"
            else (
                "against the quantized checkpoint it started from (no --reference): the numbers measure only what this "
                "build changed, not the loss against the original full-precision model"
            )
        )
        model.update(path=str(reference or src.path), cached=cached, note=note)
        report.reference_model = ReferenceModel(**model)

    with tempfile.TemporaryDirectory(dir=artifact.parent, prefix=".qconv-ref-") as tmpd:
        if reference:
            ref, model["kind"] = Path(reference), "original"
            if not cached and fmt.layout != "compressed-tensors" and detect_format(read_config(ref)) is not None:
                raise QconvError(
                    f"--reference {reference} is itself quantized",
                    where="--reference",
                    fix="pass the full-precision model the checkpoint was made from",
                )
        elif fmt.layout == "compressed-tensors":
            ref, model["kind"] = src.path, "source checkpoint"
        else:
            ref, model["kind"] = Path(tmpd) / "source", "source checkpoint"
            write_import(src, fmt, ref, True)
        summary = quality_report(
            ref,
            artifact,
            recipe,
            text=text,
            num_parameters=manifest.source.num_parameters or None,
            final=final,
            annotate=annotate,
            fwd=Forward(device=opts.device),
        )
    manifest.build.quality_reference = {k: model[k] for k in ("kind", "cached", "note")}
    return record(manifest, replace(summary, reference=model["kind"]), opts.gates)
