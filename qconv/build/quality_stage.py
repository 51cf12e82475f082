"""Stage `quality` of `qconv build`: measure the fresh artifact against its source, write the reports into it once,
and record the verdict in the manifest (one place for both kinds of build: from full precision, pipeline.py, and
from a quantized checkpoint, quantized.py)."""

from __future__ import annotations

import logging
import shutil
from dataclasses import replace
from pathlib import Path

from qconv.build.plan import QUALITY, BuildPlan
from qconv.build.workdir import WorkDir
from qconv.compute import dtype_name
from qconv.errors import GateFailure
from qconv.eval.forward import Forward
from qconv.eval.record import EvalReport
from qconv.eval.report import REPORT_JSON, REPORT_MD, REPORT_PNG, render_md
from qconv.eval.report import summary as summary_of
from qconv.eval.run import gate_failure, quality_report
from qconv.fsutil import write_json_atomic, write_text_atomic
from qconv.manifest import Manifest, QualityReport

log = logging.getLogger(__name__)

REPORTS = (REPORT_JSON, REPORT_MD, REPORT_PNG)  # part of the artifact, added after its weights are hashed


def record(manifest: Manifest, summary: QualityReport, gates: bool) -> GateFailure | None:
    """The quality summary into the manifest (its `quality` and `status`); the gate failure to raise, if any."""
    manifest.quality = summary
    passed = summary.passed
    manifest.status = "ok" if passed else ("failed" if passed is False else "unchecked")
    return gate_failure(summary) if passed is False and gates else None


def measure(plan: BuildPlan, artifact: Path, manifest: Manifest, work: WorkDir, final: Path) -> GateFailure | None:
    """Stage `quality` of a build from full precision: keyed by the weight files' hashes, the source and the plan's
    quality fields. `artifact` is the build's temp folder; `final` is where it ends up, the path the reports name.
    A streamed build measures with the layer-streamed forward too; otherwise it streams only when a model does not
    fit in free memory."""
    if not plan.eval_text:
        return None
    weights = {k: v.sha256 for k, v in manifest.files.items() if k.endswith(".safetensors")}
    fwd = Forward(
        streamed=True if plan.stream else None, device=plan.device, compute_dtype=dtype_name(plan.compute_dtype)
    )
    key = plan.key(QUALITY, weights=weights, source=manifest.source.sha256)
    qdir = work.cached_dir(QUALITY, key)
    if qdir is None:
        with work.new_dir(QUALITY, key) as tmp:
            summary = quality_report(
                plan.source.path,
                artifact,
                plan.recipe,
                text=plan.eval_text,
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
    return record(manifest, summary, plan.gates)


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
