"""A bench report for people: the terminal table, bench.md (the same table plus the command, host and targets)
and one PNG per workload of output tok/s and tokens per verify step by concurrency, the targets side by side."""

from __future__ import annotations

from pathlib import Path

from qconv.bench.schema import BenchReport, Cell
from qconv.errors import QconvError

COLUMNS = (
    "workload",
    "conc",
    "target",
    "tok/s",
    "tok/s/req",
    "TTFT p50 ms",
    "TTFT p99 ms",
    "ITL p50 ms",
    "ITL p99 ms",
    "tok/step",
    "ok/failed",
)


def _f(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{x:,.{digits}f}"


def row(c: Cell) -> list[str]:
    return [
        c.workload,
        str(c.concurrency),
        c.target,
        _f(c.output_throughput),
        _f(c.per_request_output_throughput),
        _f(c.ttft_ms.median, 0),
        _f(c.ttft_ms.p99, 0),
        _f(c.itl_ms.median, 1),
        _f(c.itl_ms.p99, 1),
        _f(c.spec_decode_acceptance_length, 2),
        f"{c.completed}/{c.failed}",
    ]


def rows(report: BenchReport) -> list[list[str]]:
    order = {t.label: i for i, t in enumerate(report.targets)}
    wl = list(report.workloads)
    cells = sorted(report.cells, key=lambda c: (wl.index(c.workload), c.concurrency, order[c.target]))
    return [row(c) for c in cells]


def terminal_table(report: BenchReport):
    from rich.table import Table

    t = Table(title=f"qconv bench: {report.max_tokens} tokens per answer, greedy", title_justify="left")
    for i, col in enumerate(COLUMNS):
        t.add_column(col, justify="left" if i in (0, 2) else "right")
    for r in rows(report):
        t.add_row(*r)
    return t


def markdown(report: BenchReport, charts: list[Path]) -> str:
    h = report.host
    lines = [
        "# qconv bench",
        "",
        f"Command: `{report.command}`  ",
        f"Date: {report.date}; host: {h.get('cpu', '?')} ({h.get('isa') or 'no AVX2'}), {h.get('cores', '?')} cores; "
        f"qconv {report.qconv_version}; "
        f"{report.max_tokens} tokens per answer, greedy"
        + ("; targets interleaved cell by cell" if report.interleaved else ""),
        "",
        "| target | model | server |",
        "|---|---|---|",
    ]
    for t in report.targets:
        server = f"`{' '.join(t.serve_command)}`" if t.serve_command else f"{t.url} (running)"
        lines.append(f"| {t.label} | {t.model} | {server} |")
    lines += ["", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(r) + " |" for r in rows(report)]
    lines += [
        "",
        "tok/s: output tokens per second of all requests together; tok/s/req: each request's own decode rate, "
        "(tokens - 1) / (latency - TTFT), averaged; tok/step: tokens per verify step from the server's spec-decode "
        "counters, 1 + accepted / drafts (– : nothing was drafted).",
        "",
    ]
    lines += [f"![{p.stem}]({p.name})" for p in charts]
    return "\n".join(lines) + "\n"


def require_matplotlib() -> None:
    """Checked before a run, so that a missing chart library does not waste one."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise QconvError(
            "the charts need matplotlib", where="qconv bench", fix="pip install 'qconv[eval]', or pass --no-charts"
        )


def charts(report: BenchReport, folder: Path) -> list[Path]:
    """One PNG per workload: output tok/s (bars) and tokens per verify step (bars on the right) by concurrency, one
    colour per target."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = []
    labels = [t.label for t in report.targets]
    concs = sorted({c.concurrency for c in report.cells})
    width = 0.8 / len(labels)
    for w in report.workloads:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.6))
        for i, lab in enumerate(labels):
            cells = [report.cell(lab, w, c) for c in concs]
            xs = [j + i * width for j in range(len(concs))]
            a1.bar(xs, [c.output_throughput if c else 0 for c in cells], width, label=lab)
            a2.bar(xs, [(c.spec_decode_acceptance_length or 0) if c else 0 for c in cells], width, label=lab)
        for ax, title in ((a1, "output tok/s"), (a2, "tokens per verify step")):
            ax.set_xticks([j + width * (len(labels) - 1) / 2 for j in range(len(concs))], [f"c={c}" for c in concs])
            ax.set_title(title)
        a1.legend(fontsize=8)
        fig.suptitle(f"{w}: {report.workloads[w].does}")
        fig.tight_layout()
        path = folder / f"bench-{w}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        out.append(path)
    return out
