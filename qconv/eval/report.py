"""report.json (machine), report.md (human: llama.cpp-style table + verdicts) and kld.png (distribution / CDF)."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import numpy as np

from qconv.eval.metrics import format_llamacpp
from qconv.eval.record import REPORT_JSON, EvalReport, MetricSummary, jsonable
from qconv.fsutil import write_json_atomic, write_text_atomic
from qconv.manifest import KldStats, QualityReport

REPORT_MD, REPORT_PNG = "report.md", "kld.png"
__all__ = ["REPORT_JSON", "REPORT_MD", "REPORT_PNG", "SUMMARY_KEYS", "render_md", "summary", "write_reports"]
SUMMARY_KEYS = tuple(f.name for f in fields(KldStats))  # what qconv.json keeps of each measured section


def summary(report: EvalReport) -> QualityReport:
    """The compact record that goes into qconv.json's `quality` (and that `check` regresses against)."""
    return QualityReport(
        report=REPORT_JSON,
        text=jsonable(report.text),
        settings=jsonable(report.settings),
        reference={"storage": report.reference.storage, "topk": report.reference.topk},
        kv_scheme=report.kv_scheme,
        kv_form=report.kv_form,
        tier=jsonable(report.tier),
        bits_per_weight=report.bits_per_weight,
        weights=_kept(report.weights),
        weights_kv=_kept(report.weights_kv),
        weights_a8=_kept(report.weights_a8),
        tasks=jsonable(report.tasks),
        verdicts=[jsonable(v) for v in report.verdicts or () if not v.passed],
        passed=report.passed,
    )


def _kept(m: MetricSummary | None) -> KldStats | None:
    return None if m is None else KldStats(**{k: getattr(m, k) for k in SUMMARY_KEYS})


def _row(name: str, s: MetricSummary) -> str:
    return (
        f"| {name} | {s.kld_mean:.4f} ± {s.kld_se:.4f} | {s.kld_median:.4f} | {s.kld_p90:.4f} | "
        f"{s.kld_p99:.4f} | {s.kld_p999:.4f} | {s.kld_max:.4f} | {100 * s.top1:.2f}% | "
        f"{s.ppl_base:.3f} | {s.ppl_q:.3f} | {s.ln_ppl_ratio:.4f} | {s.ppl_ratio:.4f} |"
    )


TABLE_HEAD = (
    "| model | mean KLD | median | p90 | p99 | p99.9 | max | same top | PPL base | PPL Q | "
    "ln(PPL_Q/PPL_base) | PPL ratio |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def render_md(report: EvalReport) -> str:
    t, ref, src = report.text, report.reference, report.source
    model = report.reference_model  # a build from a quantized checkpoint says what it measured against
    lines = [f"Reference: {model.note}.", ""] if model else []
    lines += [
        f"# Quality report: {Path(report.artifact).name}",
        "",
        f"- source: `{src.path}` ({src.num_parameters / 1e6:.1f}M parameters, sha256 {src.sha256[:16]}…)",
        f"- text: `{t.label}` — {t.tokens_scored} tokens scored in {t.windows} windows of {t.window}"
        f" (stride {t.stride}), sha256 {t.sha256[:16]}…",
        f"- reference: {ref.describe}"
        + (f"; read from the cache `{ref.cache}` (no reference model run)" if ref.given_as_cache else ""),
        f"- bits per weight: {report.bits_per_weight:.2f} (tensor bytes × 8 / source parameters)",
        f"- machine: {report.machine}, {report.date}, {report.elapsed_s} s",
        "",
    ]
    if report.tier:
        lines += [f"**Gate tier:** {report.tier.note or report.tier.name}", ""]
    lines += [TABLE_HEAD, _row("weights only", report.weights)]
    if report.weights_kv:
        lines.append(_row(f"weights + KV {report.kv_scheme} ({_kv_form(report)})", report.weights_kv))
    if report.weights_a8:
        roles = ", ".join(report.settings.a8_roles or ())
        lines.append(_row(f"weights + int8 activations ({roles})", report.weights_a8))
    if report.weights.kld_bound > 0:
        lines += [
            "",
            f"Top-k reference: the exact mean KLD lies in [mean, mean + {report.weights.kld_bound:.5f}]"
            " (per-token bracket, see qconv/eval/metrics.py).",
        ]
    if report.tasks:
        lines += ["", "| task | metric | original | quantized | recovery |", "|---|---|---|---|---|"]
        for name, r in report.tasks.results.items():
            rec = "n/a" if r.recovery is None else f"{r.recovery:.3f}"
            lines.append(f"| {name} | {r.metric} | {r.base:.4f} | {r.quantized:.4f} | {rec} |")
    if report.verdicts is not None:
        lines += ["", f"## Verdict: {'PASS' if report.passed else 'FAIL'}", ""]
        lines += [f"- {'✅' if v.passed else '❌'} {v.message}" for v in report.verdicts] or ["- no gates"]
    lines += ["", "## llama.cpp-style statistics (weights only)", "", "```", format_llamacpp(report.weights), "```"]
    if report.weights_kv:
        lines += [
            "",
            f"## weights + KV ({report.kv_scheme}, {_kv_form(report)})",
            "",
            "```",
            format_llamacpp(report.weights_kv),
            "```",
        ]
    return "\n".join(lines) + "\n"


def plot_kld(path: str | Path, klds: dict[str, np.ndarray]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, k in klds.items():
        k = np.clip(np.sort(k), 1e-6, None)
        bins = np.logspace(np.log10(k[0]), np.log10(max(k[-1], 1e-5)), 60)
        ax1.hist(k, bins=bins, histtype="step", label=name)
        ax2.plot(k, np.arange(1, len(k) + 1) / len(k), label=name)
    for ax in (ax1, ax2):
        ax.set_xscale("log")
        ax.set_xlabel("per-token KLD(original ‖ quantized), nats")
        ax.legend()
    ax1.set_ylabel("tokens")
    ax2.set_ylabel("fraction of tokens ≤ x")
    ax1.set_title("KLD distribution")
    ax2.set_title("KLD CDF")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_reports(out_dir: str | Path, report: EvalReport, klds: dict[str, np.ndarray]) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / REPORT_JSON, report.data)
    write_text_atomic(out / REPORT_MD, render_md(report))
    tmp = out / f".{REPORT_PNG}.tmp.png"
    plot_kld(tmp, klds)
    tmp.replace(out / REPORT_PNG)


def _kv_form(report: EvalReport) -> str:
    form = report.kv_form or "prefill"  # reports from before the decode-time form simulated the prefill one
    return {"decode": "runtime decode-time tiles", "prefill": "prefill form: every full tile quantized"}[form]
