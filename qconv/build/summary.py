"""The closing summary of `qconv build`, read back from the artifact folder: what was made (path, size against the
source, bits per weight), what it costs (the quality table with and without KV quantization), whether it passed
(gate verdict and tier), where the details are and what to run next. Read from disk, so a build whose gates failed
summarizes the same way as one that passed, and `--json` prints the same facts."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from qconv.eval.report import REPORT_JSON, REPORT_MD, REPORT_PNG
from qconv.manifest import QualityReport, SelectionRecord, read_manifest

QUALITY_KEYS = ("kld_mean", "kld_p99", "top1", "ppl_ratio")
UPGRADE_ROWS = 5  # the summary's selection rows; all of them are in qconv.json `selection`


def artifact_summary(out: str | Path, log_path: Path | None = None) -> dict:
    """The facts of a finished build as one JSON-able dict."""
    out = Path(out).resolve()
    m = read_manifest(out)
    q = m.quality or QualityReport()
    sel = m.selection or SelectionRecord(budget="", budget_bytes=0, scheme="", method="none")
    size = m.total_size()
    source = m.build.source_bytes or sum(f.size for f in m.source.files.values())
    bpw = q.bits_per_weight
    if bpw is None and m.source.num_parameters:  # not measured: weight file bytes over the source's parameters
        bpw = 8 * sum(f.size for k, f in m.files.items() if k.endswith(".safetensors")) / m.source.num_parameters
    quality = {
        sec: {k: getattr(stats, k) for k in QUALITY_KEYS}
        for sec, stats in (("weights", q.weights), ("weights_kv", q.weights_kv))
        if stats
    }
    reports = {n: str(out / n) for n in (REPORT_MD, REPORT_PNG, REPORT_JSON) if (out / n).is_file()}
    return {
        "artifact": str(out),
        "status": m.status,
        "recipe": m.recipe.name,
        "size_bytes": size,
        "source_bytes": source,
        "bits_per_weight": bpw,
        "calibration": {k: getattr(m.calibration, k) for k in ("kind", "id", "samples", "seq_len", "tokens")}
        if m.calibration
        else None,
        "compute": {"dtype": m.build.compute_dtype, "device": m.build.device, "cpu_isa": m.build.cpu_isa},
        "quality": quality,
        "quality_text": {k: q.text.get(k) for k in ("label", "tokens_scored")} if q.text else None,
        "kv_scheme": q.kv_scheme,
        "passed": q.passed,
        "tier": (q.tier or {}).get("name"),
        "failed_gates": [v["message"] for v in q.verdicts if not v.get("passed")],
        "int8_units": sel.int8_units,
        "step_units": sum(sel.step_units.values()),
        "selection": asdict(m.selection) if m.selection else None,
        "predicted_kld": sel.predicted_kld,
        "reports": reports,
        "log": str(log_path) if log_path else None,
        "next": [f"qconv serve {out}", f"qconv check {out}", f'qconv generate {out} --chat "Hello"'],
    }


def _mb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def print_summary(s: dict, console=None) -> None:
    """The summary as a person reads it: a few labelled lines and one small table."""
    from rich import box
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    con = console or Console(soft_wrap=True, highlight=False)
    pct = f", {100 * s['size_bytes'] / s['source_bytes']:.1f}%" if s["source_bytes"] else ""
    bpw = f", {s['bits_per_weight']:.2f} bits per weight" if s["bits_per_weight"] else ""
    took = f" in {s['elapsed_s']:.0f} s" if s.get("elapsed_s") is not None else ""
    con.print(
        f"[bold]artifact[/bold]  {escape(s['artifact'])}  {_mb(s['size_bytes'])} "
        f"(source {_mb(s['source_bytes'])}{pct}){bpw}{took}"
    )
    c = s.get("compute") or {}
    if c.get("dtype"):
        isa = f" ({c['cpu_isa']})" if c.get("cpu_isa") else ""
        con.print(
            f"[bold]compute[/bold]   {c['dtype']} on {c['device']}{isa} (--compute-dtype; recorded in qconv.json)"
        )
    if s["int8_units"] or s.get("step_units"):
        from qconv.calibrate.select import Selection, format_table

        con.print(escape(format_table(Selection.from_dict(s["selection"]), limit=UPGRADE_ROWS)))
    if s["quality"]:
        t = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
        for col in ("quality vs source", "mean KLD", "p99 KLD", "top-1", "PPL ratio"):
            t.add_column(col, justify="left" if col.startswith("quality") else "right")
        labels = {"weights": "weights only", "weights_kv": f"weights + KV {s['kv_scheme'] or ''}".rstrip()}
        for sec, r in s["quality"].items():
            t.add_row(
                labels[sec],
                f"{r['kld_mean']:.4f}",
                f"{r['kld_p99']:.3f}",
                f"{100 * r['top1']:.1f}%",
                f"{r['ppl_ratio']:.3f}",
            )
        con.print(t)
    tier = f" ({escape(s['tier'].split(' (')[0])} tier)" if s["tier"] else ""
    text = s.get("quality_text") or {}
    if text.get("tokens_scored"):
        label = str(text["label"])  # a file: its name; an HF dataset id as given
        tier += escape(
            f" on {text['tokens_scored']:,} tokens of {Path(label).name if Path(label).is_file() else label}"
        )
    if s["passed"] is True:
        con.print(f"[bold]verdict[/bold]   [green]PASSED[/green] the recipe's quality gates{tier}")
    elif s["passed"] is False:
        con.print(f"[bold]verdict[/bold]   [red]FAILED[/red]{tier}: " + escape("; ".join(s["failed_gates"])))
    else:
        con.print(
            "[bold]verdict[/bold]   not measured: pass --eval-text FILE_OR_HF_ID for the quality report and gates"
        )
    if s["reports"]:
        con.print(
            "[bold]reports[/bold]   "
            + escape("  ".join(s["reports"][k] for k in s["reports"] if not k.endswith(".json")))
        )
    if s["log"]:
        con.print(f"[bold]log[/bold]       {escape(s['log'])}")
    con.print("[bold]next[/bold]      " + escape("   |   ".join(s["next"][:2])))
