"""Verdicts: the recipe tier's quality gates, regressions against a recorded report, and JUnit XML for CI."""

from __future__ import annotations

import math
from dataclasses import fields
from pathlib import Path

from qconv.eval.record import EvalReport, TierInfo, Verdict
from qconv.manifest import QualityReport
from qconv.recipes.sections import Gates, GateTier, Quality, Regression

TIER_GATES = {"weights": "weights", "weights_kv": "weights_kv", "weights_a8": "weights_kv"}  # runtime quantization
# of activations (W4A8) is gated like the KV cache's
# gate field -> (summary metric, "max" or "min")
GATE_METRICS = {
    "max_mean_kld": ("kld_mean", "max"),
    "max_p99_kld": ("kld_p99", "max"),
    "min_top1": ("top1", "min"),
    "max_ppl_ratio": ("ppl_ratio", "max"),
    "min_task_recovery": ("task_recovery", "min"),
}


def tier_info(quality: Quality, num_params: int) -> TierInfo:
    """Which tier judges this model, and whether the model is in the recipe's target class (the largest tier)."""
    tier = quality.tier_for(num_params)
    target = max(quality.tiers, key=lambda t: t.min_params) if quality.tiers else None
    info = TierInfo(
        name=tier.name if tier else None,
        min_params=tier.min_params if tier else None,
        num_parameters=num_params,
        in_target_class=tier is not None and tier is target,
    )
    if tier is None:
        info.note = "the recipe defines no gate tier for this model size: no gates applied"
    elif target is not None and tier is not target:
        info.note = (
            f"{num_params / 1e6:.0f}M parameters is outside this recipe's target class "
            f"({target.name}); judged by the {tier.name!r} tier"
        )
    return info


def _compare(name: str, measured: float, limit: float, how: str, kind: str = "gate") -> Verdict:
    ok = math.isfinite(measured) and math.isfinite(limit) and (measured <= limit if how == "max" else measured >= limit)
    rel = "<=" if how == "max" else ">="
    msg = f"{name}: measured {measured:.4f}, needs {rel} {limit:.4f}" + ("" if ok else " — FAILED")
    return Verdict(kind, name, ok, measured, limit, msg)


def _task_recovery(report: EvalReport) -> float | None:
    results = report.tasks.results.values() if report.tasks else ()
    vals = [t.recovery for t in results if t.recovery is not None]
    return min(vals) if vals else None


def apply_gates(report: EvalReport, tier: GateTier | None) -> list[Verdict]:
    if tier is None:
        return []
    out = []
    for section, summary in report.sections().items():
        gates: Gates = getattr(tier, TIER_GATES[section])
        for f in fields(Gates):
            limit = getattr(gates, f.name)
            metric, how = GATE_METRICS[f.name]
            if metric == "task_recovery":
                value = _task_recovery(report) if section == "weights" else None
            else:
                value = getattr(summary, metric)
            if limit is not None and value is not None:
                out.append(_compare(f"{section}.{f.name}", value, limit, how))
    return out


def regressions(report: EvalReport, recorded: QualityReport, tol: Regression) -> list[Verdict]:
    """Worse than the recorded summary beyond tolerance? Only sections both sides have count."""
    out = []
    for section, new in report.sections().items():
        old = getattr(recorded, section)
        if old is None:
            continue
        checks = (
            ("kld_mean", "max", old.kld_mean * (1 + tol.mean_kld_rel)),
            ("kld_p99", "max", old.kld_p99 * (1 + tol.p99_kld_rel)),
            ("top1", "min", old.top1 - tol.top1_abs),
            ("ppl_ratio", "max", old.ppl_ratio + tol.ppl_ratio_abs),
        )
        for metric, how, limit in checks:
            was = getattr(old, metric)
            out.append(
                _compare(f"{section}.{metric} vs recorded {was:.4f}", getattr(new, metric), limit, how, "regression")
            )
    return out


def write_junit(path: str | Path, verdicts: list[Verdict], suite: str = "qconv.check") -> None:
    """One testcase per verdict; a failed one carries <failure message=...>."""
    import xml.etree.ElementTree as ET

    from qconv.fsutil import write_text_atomic

    failures = sum(not v.passed for v in verdicts)
    root = ET.Element("testsuites")
    ts = ET.SubElement(
        root, "testsuite", name=suite, tests=str(len(verdicts)), failures=str(failures), errors="0", skipped="0"
    )
    for v in verdicts:
        tc = ET.SubElement(ts, "testcase", classname=f"{suite}.{v.kind}", name=v.name)
        if not v.passed:
            ET.SubElement(tc, "failure", message=v.message, type=v.kind).text = v.message
        else:
            ET.SubElement(tc, "system-out").text = v.message
    ET.indent(root)
    write_text_atomic(path, ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n")
