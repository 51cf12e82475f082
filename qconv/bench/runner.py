"""One `qconv bench` run: start (or reach) each target's server, then every workload at every concurrency on every
target, the targets taking turns cell by cell (so machine load hits them alike), each cell bracketed by reads of the
server's own spec-decode counters."""

from __future__ import annotations

import contextlib
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from qconv.bench import counters, workloads
from qconv.bench.client import Endpoint, RequestResult, run_load
from qconv.bench.launch import ServerProcess, check_port, free_port
from qconv.bench.schema import BenchReport, Cell, Target, WorkloadInfo
from qconv.errors import QconvError
from qconv.version import __version__

WARMUP_TOKENS = 8
LONG_MARGIN = 64  # tokens kept free beside a long prompt and its answer (template, rounding)


@dataclass
class Side:
    """One target: a server to start with `qconv serve ARGS`, or one already running at `url`."""

    label: str
    serve_args: list[str] = field(default_factory=list)
    url: str | None = None
    artifact: str | None = None
    backend: str | None = None
    profile: str | None = None


@dataclass
class Plan:
    sides: list[Side]
    workloads: list[str]
    concurrency: list[int]
    prompts: int
    max_tokens: int
    data: dict[str, Path]
    out: Path
    port: int = 0  # the first started server's port (0: a free one)
    api_key: str | None = None
    command: str = ""


class Console:
    """Where progress goes: `line(text)` for a finished step, `request()` per finished request of the cell."""

    def __init__(self, line: Callable[[str], None], request: Callable[[RequestResult], None] | None = None):
        self.line, self.request = line, request


ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8")  # what decides a CPU's class for these kernels


def host_info() -> dict[str, str]:
    """lscpu's model name, the cores and the vector / matrix extensions the CPU has."""
    cpu, flags = platform.processor() or platform.machine(), set()
    with contextlib.suppress(OSError):
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name"):
                cpu = ln.split(":", 1)[1].strip()
            elif ln.startswith("flags"):
                flags = set(ln.split(":", 1)[1].split())
                break
    isa = " ".join(f for f in ISA_FLAGS if f in flags)
    return {"cpu": cpu, "isa": isa, "cores": str(os.cpu_count() or 0), "python": platform.python_version()}


def _connect(side: Side, plan: Plan, stack: contextlib.ExitStack, first: bool, console: Console) -> Endpoint:
    if side.url:
        return Endpoint(side.url.rstrip("/").removesuffix("/v1"), api_key=plan.api_key).connect()
    port = plan.port if first and plan.port else free_port()
    check_port(port)
    plan.out.mkdir(parents=True, exist_ok=True)
    log = plan.out / f"server-{side.label}.log"
    srv = ServerProcess(side.serve_args, port, log=log, env={"QCONV_API_KEY": plan.api_key} if plan.api_key else {})
    console.line(f"starting {side.label}: qconv serve {' '.join(side.serve_args)} --port {port}  (log: {log})")
    t = time.monotonic()
    stack.enter_context(srv)
    console.line(f"  {side.label} ready in {time.monotonic() - t:.0f} s")
    side.url = srv.root
    return Endpoint(srv.root, api_key=plan.api_key).connect()


def _target(side: Side, ep: Endpoint, started: bool) -> Target:
    cmd = ["qconv", "serve", *side.serve_args] if started else []
    return Target(side.label, ep.base, ep.model, ep.max_model_len, side.artifact, side.backend, side.profile, cmd)


def _spec(ep: Endpoint) -> counters.SpecCounters:
    """The server's spec-decode counters now (none from a server without /metrics, e.g. llama-server's default)."""
    try:
        return counters.parse(ep.get_text("/metrics"))
    except OSError:
        return counters.SpecCounters()


def _cell(ep: Endpoint, side: Side, workload: str, conc: int, prompts: list[str], plan: Plan, console: Console) -> Cell:
    before = _spec(ep)
    results, wall = run_load(ep, prompts, conc, plan.max_tokens, console.request)
    spec = _spec(ep) - before
    return Cell.measure(side.label, workload, conc, results, wall, spec)


def _summary(c: Cell) -> str:
    tps = "" if c.spec_decode_acceptance_length is None else f", {c.spec_decode_acceptance_length:.2f} tok/step"
    bad = f", {c.failed} FAILED ({c.errors[0][:120]})" if c.failed else ""
    return (
        f"  {c.workload:5} c={c.concurrency:<3} {c.target}: {c.output_throughput:7.1f} tok/s, "
        f"{c.per_request_output_throughput:6.1f} tok/s per request, TTFT p50 {c.ttft_ms.median:.0f} ms{tps}{bad}"
    )


def run(plan: Plan, console: Console) -> BenchReport:
    """Measure every (workload, concurrency) on every side; the report (not yet written)."""
    with contextlib.ExitStack() as stack:
        eps: list[Endpoint] = []
        targets: list[Target] = []
        for i, side in enumerate(plan.sides):
            started = side.url is None
            eps.append(_connect(side, plan, stack, i == 0, console))
            targets.append(_target(side, eps[-1], started))
        context = min(ep.max_model_len or 4096 for ep in eps) - plan.max_tokens - LONG_MARGIN
        texts = {w: workloads.texts(w, plan.data[w], plan.prompts, context) for w in plan.workloads}
        for ep in eps:  # warm-up: the first request pays one-time costs (compilation, allocation)
            r = ep.chat(texts[plan.workloads[0]][0], WARMUP_TOKENS)
            if not r.ok:
                raise QconvError(f"the warm-up request to {ep.base} failed: {r.error}", where=ep.base)
        cells: list[Cell] = []
        total = len(plan.workloads) * len(plan.concurrency) * len(eps)
        for w in plan.workloads:
            for conc in plan.concurrency:
                order = list(zip(plan.sides, eps))
                if len(cells) // max(len(eps), 1) % 2:
                    order.reverse()  # A B, then B A: neither side always goes first
                for side, ep in order:
                    console.line(f"[{len(cells) + 1}/{total}] {w} at concurrency {conc} on {side.label} ...")
                    cells.append(_cell(ep, side, w, conc, texts[w], plan, console))
                    console.line(_summary(cells[-1]))
    return BenchReport(
        date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        qconv_version=__version__,
        command=plan.command,
        host=host_info(),
        max_tokens=plan.max_tokens,
        workloads={
            w: WorkloadInfo(workloads.WORKLOADS[w].does, str(plan.data[w]), len(texts[w])) for w in plan.workloads
        },
        targets=targets,
        cells=cells,
        interleaved=len(eps) > 1,
    )
