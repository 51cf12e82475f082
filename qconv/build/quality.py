"""Stage `quality` of `qconv build`: measure the fresh artifact against its source, write the reports into it once,
and record the verdict in the manifest (one place for both kinds of build: from full precision, pipeline.py, and
from a quantized checkpoint, quantized.py)."""

from __future__ import annotations

import logging
import shutil
from dataclasses import asdict, replace
from pathlib import Path

from qconv.build.workdir import WorkDir, stage_key
from qconv.errors import GateFailure
from qconv.eval.forward import Forward
from qconv.eval.record import EvalReport
from qconv.eval.report import REPORT_JSON, REPORT_MD, REPORT_PNG, render_md
from qconv.eval.report import summary as summary_of
from qconv.eval.run import gate_failure, quality_report
from qconv.fsutil import sha256_file, write_json_atomic, write_text_atomic
from qconv.manifest import Manifest, QualityReport
from qconv.recipes.recipe import Recipe

log = logging.getLogger(__name__)

REPORTS = (REPORT_JSON, REPORT_MD, REPORT_PNG)  # part of the artifact, added after its weights are hashed


def eval_text(opts, recipe: Recipe) -> str | None:
    """The held-out text of the quality report, or None (and a warning: the artifact stays unchecked)."""
    text = opts.eval_text or recipe.quality.text
    if not text:
        log.warning(
            "quality report skipped: no held-out text (pass --eval-text FILE_OR_HF_ID, or set quality.text "
            "in the recipe); the artifact is marked unchecked"
        )
    return text or None


def record(manifest: Manifest, summary: QualityReport, gates: bool) -> GateFailure | None:
    """The quality summary into the manifest (its `quality` and `status`); the gate failure to raise, if any."""
    manifest.quality = summary
    passed = summary.passed
    manifest.status = "ok" if passed else ("failed" if passed is False else "unchecked")
    return gate_failure(summary) if passed is False and gates else None


def measure(
    opts,
    recipe: Recipe,
    source: Path,
    artifact: Path,
    manifest: Manifest,
    work: WorkDir,
    final: Path,
    streamed: bool = False,
) -> GateFailure | None:
    """Stage `quality` of a build from full precision: cached by the weight files' hashes and the evaluation
    settings. `artifact` is the build's temp folder; `final` is where it ends up, the path the reports name. A
    streamed build measures with the layer-streamed forward too; otherwise it streams only when a model does not
    fit in free memory."""
    text = eval_text(opts, recipe)
    if not text:
        return None
    weights = {k: v.sha256 for k, v in manifest.files.items() if k.endswith(".safetensors")}
    text_id = sha256_file(Path(text)) if Path(text).is_file() else text
    fwd = Forward(streamed=True if streamed else None, device=opts.device, compute_dtype=opts.compute_dtype)
    key = stage_key("quality", weights, text_id, asdict(recipe.quality), manifest.source.sha256, str(fwd.dtype()))
    qdir = work.cached_dir("quality", key)
    if qdir is None:
        with work.new_dir("quality", key) as tmp:
            summary = quality_report(
                source,
                artifact,
                recipe,
                text=text,
                source_sha256=manifest.source.sha256,
                num_parameters=manifest.source.num_parameters,
                fwd=fwd,
                final=final,
            )
            _copy_files(artifact, tmp, REPORTS)
    else:
        _copy_files(qdir, artifact, REPORTS)
        summary = summary_of(_name_final_path(artifact, final))
    sel = manifest.selection
    if sel is not None and sel.predicted_kld is not None and summary.weights is not None:
        selection = {"method": sel.method, "predicted_kld": sel.predicted_kld, "measured_kld": summary.weights.kld_mean}
        summary = replace(summary, selection=selection)
    return record(manifest, summary, opts.gates)


def _copy_files(src: Path, dst: Path, names) -> None:
    for name in names:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


def _name_final_path(artifact: Path, final: Path) -> EvalReport:
    """A reused quality stage's reports name the folder of the build that made them: point them at this one."""
    path = artifact / REPORT_JSON
    report = EvalReport.read(path)
    if report.artifact != str(Path(final).resolve()):
        report.artifact = str(Path(final).resolve())
        write_json_atomic(path, report.data)
        write_text_atomic(artifact / REPORT_MD, render_md(report))
    return report
