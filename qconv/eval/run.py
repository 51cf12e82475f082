"""The three entry points: `qconv eval`, `qconv check`, and the build's `quality_report`."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from qconv.artifact import Artifact
from qconv.errors import GateFailure, QconvError
from qconv.eval.forward import Forward
from qconv.eval.gates import apply_gates, regressions, tier_info, write_junit
from qconv.eval.measure import Source, cached_source, measure, resolve_reference, safetensors_stats
from qconv.eval.record import REPORT_JSON, EvalReport, EvalSettings, Verdict
from qconv.eval.report import summary, write_reports
from qconv.manifest import QualityReport, verify_files
from qconv.modelfiles import check_weight_files
from qconv.recipes.recipe import Recipe, load_recipe

log = logging.getLogger(__name__)


def auto_kv(recipe: Recipe) -> str | None:
    """The most aggressive (fewest bytes per token) non-bf16 KV scheme among the recipe's profiles that we can
    simulate; the first such profile wins a tie."""
    from qconv.eval.kvsim import get_scheme
    from qconv.kv.schemes import get_kv_scheme

    found = None
    for p in recipe.profiles.values():
        if p.kv_cache == "bf16":
            continue
        try:
            get_scheme(p.kv_cache)
        except QconvError:
            log.info("KV scheme %s not available for simulation yet; skipped", p.kv_cache)
            continue
        size = get_kv_scheme(p.kv_cache).bytes_per_token_per_head(128)
        if found is None or size < get_kv_scheme(found).bytes_per_token_per_head(128):
            found = p.kv_cache
    return found


def with_profile(settings: EvalSettings, recipe: Recipe, profile: str | None) -> EvalSettings:
    """The settings with `profile`'s W4A8 roles simulated (its `w4a8`); unchanged for None."""
    if profile is None:
        return settings
    if profile not in recipe.profiles:
        raise QconvError(
            f"unknown profile {profile!r} in recipe {recipe.name}",
            where="--profile",
            fix=f"use one of {', '.join(recipe.profiles)}",
        )
    return replace(settings, a8_roles=tuple(recipe.profiles[profile].w4a8))


def _judge(report: EvalReport, recipe: Recipe, extra: list[Verdict] = ()) -> EvalReport:
    report.tier = tier_info(recipe.quality, report.source.num_parameters)
    tier = recipe.quality.tier_for(report.source.num_parameters)
    report.verdicts = list(extra) + apply_gates(report, tier)
    report.passed = all(v.passed for v in report.verdicts)
    return report


def _tasks_need_model(source: Source, tasks) -> None:
    if tasks and source.cache:
        raise QconvError(
            "--tasks compare against the reference model, and a reference cache has none",
            where="--reference",
            fix="pass the full-precision model as --reference to run tasks",
        )


def _with_tasks(
    report: EvalReport, artifact: Path, source: Source, tasks, limit, task_data, max_gen_toks=None
) -> EvalReport:
    if tasks:
        from qconv.eval.tasks import run_tasks

        report.tasks = run_tasks(
            source.path, artifact, tasks, limit=limit, task_data=task_data, max_gen_toks=max_gen_toks
        )
    return report


def evaluate(
    artifact: str | Path,
    settings: EvalSettings,
    *,
    reference: str | None = None,
    recipe: str | None = None,
    tasks: list[str] | None = None,
    limit: int | None = None,
    task_data: dict[str, str] | None = None,
    max_gen_toks: int | None = None,
    out: str | Path | None = None,
    fwd: Forward | None = None,
    profile: str | None = None,
) -> EvalReport:
    """`qconv eval`: measure, judge by the recipe's tier gates (reported, not raised), write reports to `out`."""
    artifact = Path(artifact)
    art = Artifact.open(artifact)
    check_weight_files(artifact)
    if tasks:
        from qconv.eval.tasks import resolve_tasks

        resolve_tasks(tasks, task_data)  # fail on an unknown task before minutes of measuring
    source = resolve_reference(reference, art.manifest)
    _tasks_need_model(source, tasks)
    rec = load_recipe(recipe) if recipe else art.require_recipe()
    if settings.kv == "auto":
        settings = replace(settings, kv=auto_kv(rec))
    settings = with_profile(settings, rec, profile)
    report, klds = measure(artifact, source, settings, fwd)
    report = _judge(_with_tasks(report, artifact, source, tasks, limit, task_data, max_gen_toks), rec)
    if out:
        write_reports(out, report, klds)
    return report


def load_recorded(against: str | Path | None, art: Artifact) -> QualityReport | None:
    """A report to regress against: a report.json, an artifact folder (its report.json, else its qconv.json
    quality), or by default this artifact's own recorded quality."""
    if against is None:
        return art.quality if art.quality and art.quality.measured else None
    p = Path(against)
    if p.is_dir():
        if (p / REPORT_JSON).is_file():
            p = p / REPORT_JSON
        else:
            other = Artifact.open(p)
            if not (other.quality and other.quality.measured):
                raise QconvError(
                    f"{against} records no quality report",
                    where="--against",
                    fix="pass an artifact built with quality gates, or its report.json",
                )
            return other.quality
    if not p.is_file():
        raise QconvError(
            f"--against not found: {against}", where="--against", fix="pass an artifact folder or a report.json"
        )
    return summary(EvalReport.read(p))


def check(
    artifact: str | Path,
    *,
    against: str | None = None,
    junit: str | None = None,
    reference: str | None = None,
    recipe: str | None = None,
    text: str | None = None,
    window: int | None = None,
    max_tokens: int | None = None,
    kv: str | None = None,
    out: str | Path | None = None,
    fwd: Forward | None = None,
    profile: str | None = None,
) -> EvalReport:
    """`qconv check`: verify files, re-measure with the recorded settings, apply gates and regression tolerances.
    Raises GateFailure (exit 1) naming every failed gate with its measured value."""
    artifact = Path(artifact)
    art = Artifact.open(artifact)
    check_weight_files(artifact)
    manifest = art.manifest
    rec = load_recipe(recipe) if recipe else art.require_recipe()
    recorded_settings = art.quality.settings if art.quality else {}
    settings = EvalSettings(
        **{
            **recorded_settings,
            **{k: v for k, v in dict(text=text, window=window, max_tokens=max_tokens, kv=kv).items() if v is not None},
        }
    )
    if not settings.text:
        settings = replace(settings, text=rec.quality.text)
    if not settings.text:
        raise QconvError(
            "no held-out text to measure on: the artifact records none and the recipe sets none",
            where="--text",
            fix="pass --text FILE_OR_HF_DATASET_ID",
        )
    if settings.kv == "auto":
        settings = replace(settings, kv=auto_kv(rec))
    settings = with_profile(settings, rec, profile)
    recorded = load_recorded(against, art)
    problems = verify_files(artifact, manifest)
    files = Verdict(
        "files",
        "files match qconv.json",
        not problems,
        message="files: " + ("all match qconv.json" if not problems else "; ".join(problems[:5]) + " — FAILED"),
    )
    source = resolve_reference(reference, manifest)
    report, klds = measure(artifact, source, settings, fwd)
    extra = [files] + (regressions(report, recorded, rec.quality.regression) if recorded else [])
    report = _judge(report, rec, extra)
    if out:
        write_reports(out, report, klds)
    if junit:
        write_junit(junit, report.verdicts or [])
    failed = [v.message for v in report.verdicts or () if not v.passed]
    if failed:
        tier = report.tier.name if report.tier else None
        err = GateFailure(
            f"quality check failed for {artifact} ({tier} tier):\n  " + "\n  ".join(failed),
            fix="inspect report.md; rebuild or relax the recipe's gates",
        )
        err.report = report
        raise err
    return report


def quality_report(
    source_dir: str | Path,
    artifact_dir: str | Path,
    recipe: Recipe,
    *,
    text: str | None = None,
    kv: str | None = "auto",
    source_sha256: str | None = None,
    num_parameters: int | None = None,
    tasks: list[str] | None = None,
    limit: int | None = None,
    fwd: Forward | None = None,
    final: str | Path | None = None,
    annotate=None,
) -> QualityReport:
    """For `qconv build`: measure the fresh artifact, write report.json/report.md/kld.png into it, return the
    summary for qconv.json (`passed` False when a gate failed; the caller marks the manifest and exits 1).
    `final`: the folder the build's temp folder becomes, the path the reports name; `annotate(report)` adds the
    caller's notes before the reports are written (once). Call it before hashing the artifact's files: the reports
    are part of the artifact."""
    text = text or recipe.quality.text
    if not text:
        return QualityReport(passed=None, note="no held-out text (recipe quality.text or --eval-text): not measured")
    q = recipe.quality
    settings = EvalSettings(
        text=text, window=q.window, max_tokens=q.max_tokens, kv=auto_kv(recipe) if kv == "auto" else kv
    )
    source = cached_source(source_dir, num_parameters)
    if source is None:
        if not source_sha256:
            from qconv.convert.sources import source_files
            from qconv.fsutil import sha256_json

            source_sha256 = sha256_json(source_files(Path(source_dir)))
        source = Source(
            path=Path(source_dir),
            sha256=source_sha256,
            num_parameters=num_parameters or safetensors_stats(source_dir)[0],
        )
    _tasks_need_model(source, tasks)
    report, klds = measure(artifact_dir, source, settings, fwd)
    report = _judge(_with_tasks(report, Path(artifact_dir), source, tasks, limit, None), recipe)
    if final is not None:
        report.artifact = str(Path(final).resolve())
    if annotate is not None:
        annotate(report)
    write_reports(artifact_dir, report, klds)
    return summary(report)


def gate_failure(quality_summary: QualityReport) -> GateFailure:
    """The error `qconv build` raises after marking the manifest failed."""
    msgs = [v["message"] for v in quality_summary.verdicts]
    return GateFailure(
        "quality gates failed:\n  " + "\n  ".join(msgs),
        fix="see report.md in the artifact; pass --no-gates to keep it anyway",
    )
