"""bench.json: the typed record of one `qconv bench` run (read back with `load`, like the manifest), and the
arithmetic that turns timed requests into a cell. Field names and definitions are `vllm bench serve`'s where it
has them (output_throughput, ttft/tpot/itl/e2el in ms with mean, median and p99, spec_decode_acceptance_length)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from qconv.bench.client import RequestResult
from qconv.bench.counters import SpecCounters
from qconv.errors import QconvError
from qconv.recipes.schema import read_record, to_dict

SCHEMA_VERSION = 1
JSON_NAME = "bench.json"


@dataclass
class Stat:
    """Milliseconds over the requests of a cell (vLLM's: mean, median, 99th percentile by linear interpolation)."""

    mean: float
    median: float
    p99: float

    @classmethod
    def of(cls, seconds: list[float]) -> Stat:
        a = np.asarray(seconds or [0.0], dtype=float) * 1000
        return cls(round(float(a.mean()), 3), round(float(np.median(a)), 3), round(float(np.percentile(a, 99)), 3))


@dataclass
class Cell:
    """One target on one workload at one concurrency."""

    target: str
    workload: str
    concurrency: int
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s over the whole run (all requests together)
    per_request_output_throughput: float  # mean over requests of (output tokens - 1) / (latency - TTFT)
    ttft_ms: Stat
    tpot_ms: Stat  # per request: (latency - TTFT) / (output tokens - 1)
    itl_ms: Stat  # gaps between streamed chunks
    e2el_ms: Stat
    spec_decode_source: str  # whose counters: "vllm" | "qconv" | "" (none exported, or nothing drafted)
    spec_decode_num_drafts: int = 0
    spec_decode_draft_tokens: int = 0
    spec_decode_accepted_tokens: int = 0
    spec_decode_acceptance_length: float | None = None  # tokens per verify step: 1 + accepted / drafts
    spec_decode_acceptance_rate: float | None = None  # percent of draft tokens accepted
    spec_decode_per_position_acceptance_rates: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # the first few failed requests' errors

    @classmethod
    def measure(
        cls, target: str, workload: str, concurrency: int, results: list[RequestResult], wall: float, spec: SpecCounters
    ) -> Cell:
        ok = [r for r in results if r.ok]
        tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
        out_tokens = sum(r.output_tokens for r in ok)
        rate = spec.acceptance_rate
        return cls(
            target,
            workload,
            concurrency,
            len(ok),
            len(results) - len(ok),
            round(wall, 3),
            sum(r.prompt_len for r in ok),
            out_tokens,
            round(len(ok) / wall, 4) if wall else 0.0,
            round(out_tokens / wall, 3) if wall else 0.0,
            round(float(np.mean([1 / t for t in tpots if t > 0] or [0.0])), 3),
            Stat.of([r.ttft for r in ok]),
            Stat.of(tpots),
            Stat.of([x for r in ok for x in r.itl]),
            Stat.of([r.latency for r in ok]),
            spec.source if spec.drafts else "",
            spec.drafts,
            spec.draft_tokens,
            spec.accepted,
            None if spec.acceptance_length is None else round(spec.acceptance_length, 4),
            None if rate is None else round(100 * rate, 3),
            [round(x, 4) for x in spec.per_position()],
            [r.error for r in results if not r.ok][:3],
        )


@dataclass
class Target:
    """What was measured: a server qconv started (`serve_command`) or one given by --url."""

    label: str
    url: str
    model: str
    max_model_len: int
    artifact: str | None = None
    backend: str | None = None
    profile: str | None = None
    serve_command: list[str] = field(default_factory=list)


@dataclass
class WorkloadInfo:
    does: str
    data: str  # the file the prompts came from
    prompts: int


@dataclass
class BenchReport:
    date: str  # UTC, ISO 8601
    qconv_version: str
    command: str
    host: dict[str, str]  # cpu (lscpu's model name), cores, torch threads, device
    max_tokens: int
    workloads: dict[str, WorkloadInfo]
    targets: list[Target]
    cells: list[Cell]
    interleaved: bool = False  # two targets measured turn about, cell by cell
    schema_version: int = SCHEMA_VERSION

    def save(self, folder: Path) -> Path:
        path = folder / JSON_NAME
        path.write_text(json.dumps(to_dict(self), indent=1) + "\n")
        return path

    def cell(self, target: str, workload: str, concurrency: int) -> Cell | None:
        return next(
            (c for c in self.cells if (c.target, c.workload, c.concurrency) == (target, workload, concurrency)), None
        )


def load(path: str | Path) -> BenchReport:
    """A bench.json back as a BenchReport; a wrong type, a missing or unknown key is one error."""
    path = Path(path)
    fix = "pass a bench.json written by this qconv version"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise QconvError(f"cannot read a bench report: {e}", where=str(path), fix=fix) from e
    if not isinstance(data, dict) or data.get("schema_version") != SCHEMA_VERSION:
        version = data.get("schema_version") if isinstance(data, dict) else None
        raise QconvError(
            f"unsupported bench schema_version {version!r} (this qconv reads {SCHEMA_VERSION})",
            where=str(path),
            fix=fix,
        )
    return read_record(BenchReport, data, str(path), "bench report", fix)
