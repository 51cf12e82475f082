"""`qconv build` on an already-quantized checkpoint: the lossless import (qconv.convert.imported) plus the recipe
applied to what is still high precision, measured against the true original when given."""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

from qconv.convert.imported import IMPORT_RECIPE, quantized_source, requant_args, write_imported
from qconv.convert.layout import Plan
from qconv.convert.quantized import detect_format
from qconv.convert.requires import requirements
from qconv.convert.sources import read_config
from qconv.errors import QconvError
from qconv.eval.reference import is_cache
from qconv.eval.report import REPORT_JSON, REPORT_MD, render_md
from qconv.eval.run import gate_failure, quality_report
from qconv.fsutil import write_json_atomic, write_text_atomic
from qconv.manifest import Manifest, QualityReport, RecipeInfo
from qconv.recipes.recipe import Recipe
from qconv.recipes.roles import family_of

log = logging.getLogger(__name__)


def build_from_quantized(opts, recipe: Recipe) -> Manifest:
    """`qconv build` on a quantized checkpoint (called by pipeline.build): keep its quantized tensors, requantize what
    the recipe asks of the rest, measure against `opts.reference` (the true original) or else the source itself."""
    src, fmt = quantized_source(opts.model, opts.revision)
    notes: dict[str, str] = {}
    reference = getattr(opts, "reference", None)
    family = family_of(read_config(src.path))

    def quality(tmp: Path, manifest: Manifest, final: Path):
        return _quality_vs(opts, recipe, src, fmt, reference, tmp, manifest, final)

    def requires(decisions):
        return requirements(recipe, Plan(family=family, modules=decisions, other_bytes=0, source_bytes=0))

    m = write_imported(src, fmt, Path(opts.out), opts.force,
               RecipeInfo(name=recipe.name, sha256=recipe.sha256, resolved=recipe.to_dict()),
               requant_args(recipe, notes), {"notes": notes, "streamed": True, "reference": reference},
               quality=quality, profiles=dict(recipe.profiles),
               speculative=recipe.speculative, requires=requires)
    return m


def _quality_vs(opts, recipe, src, fmt, reference, artifact: Path, manifest: Manifest, final: Path):
    """Quality report against the bf16 original when given, else against the source checkpoint (its lossless
    import, which our runtime reads), and the report says which."""
    text = opts.eval_text or recipe.quality.text
    if not text:
        log.warning("quality report skipped: no held-out text (--eval-text); the artifact is marked unchecked")
        manifest.build.quality_reference = None
        return None
    with tempfile.TemporaryDirectory(dir=artifact.parent, prefix=".qconv-ref-") as tmpd:
        cached = bool(reference) and is_cache(reference)
        if reference:
            ref, kind = Path(reference), "original"
            if not cached and fmt.layout != "compressed-tensors" and detect_format(read_config(ref)) is not None:
                raise QconvError(f"--reference {reference} is itself quantized", where="--reference",
                                 fix="pass the full-precision model the checkpoint was made from")
        elif fmt.layout == "compressed-tensors":
            ref, kind = src.path, "source checkpoint"
        else:
            ref, kind = Path(tmpd) / "source", "source checkpoint"
            write_imported(src, fmt, ref, True, RecipeInfo(name=IMPORT_RECIPE, sha256="", resolved={}), None, {})
        summary = quality_report(ref, artifact, recipe, text=text, num_parameters=manifest.source.num_parameters
                                 or None)
    path = artifact / REPORT_JSON
    report = json.loads(path.read_text())
    note = (f"against cached reference log-probs of the true original (source sha256 "
            f"{report['source']['sha256'][:16]}...) from {reference}" if cached else
            "against the true original model " + str(reference)) if kind == "original" else (
        "against the quantized checkpoint it started from (no --reference): the numbers measure only what this "
        "build changed, not the loss against the original full-precision model")
    report["artifact"] = str(final.resolve())
    report["reference_model"] = {"kind": kind, "path": str(reference or src.path), "cached": cached, "note": note}
    write_json_atomic(path, report)
    md = render_md(report)
    write_text_atomic(artifact / REPORT_MD, f"Reference: {note}.\n\n" + md)
    summary["reference"] = kind
    manifest.quality = QualityReport.of(summary)
    passed = summary.get("passed")
    manifest.status = "ok" if passed else ("failed" if passed is False else "unchecked")
    manifest.build.quality_reference = {"kind": kind, "cached": cached, "note": note}
    if passed is False and opts.gates:
        return gate_failure(summary)
    return None
