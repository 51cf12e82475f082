"""The eval report (report.json) as typed records: one definition of what `qconv eval`, `check` and the build's
quality stage write, and of what gates, the markdown and the manifest summary read, instead of string keys spread
over every consumer. `EvalReport.data` is the JSON written; `EvalReport.of` reads it back, checked."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qconv.manifest import metric_problems
from qconv.modelfiles import read_json_object
from qconv.recipes.schema import read_record

REPORT_JSON = "report.json"
SECTIONS = ("weights", "weights_kv", "weights_a8")  # weights only, + simulated KV cache, + int8 activations


def jsonable(obj: Any) -> Any:
    """The JSON form of a record: dataclasses become mappings in field order, leaving out the fields named in their
    `_SOMETIMES` while None (keys a writer adds only when it has something to say); tuples become lists."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        omit = getattr(obj, "_SOMETIMES", ())
        return {
            f.name: jsonable(getattr(obj, f.name))
            for f in dataclasses.fields(obj)
            if not (f.name in omit and getattr(obj, f.name) is None)
        }
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    return obj


@dataclass
class EvalSettings:
    text: str
    window: int = 2048
    max_tokens: int | None = 8192
    stride: int | None = None
    kv: str | None = None  # KV scheme simulated for the weights+KV section
    kv_form: str = "decode"  # decode: the runtime's decode-time tiles; prefill: every full tile quantized
    ref_topk: int | None = None  # None: auto (full for small vocabularies), 0: full, k: top-k
    a8_roles: tuple[str, ...] = ()  # a profile's W4A8 roles, simulated for the weights+A8 section (actsim.py)


@dataclass(frozen=True)
class MetricSummary:
    """One measured section, as qconv.eval.metrics.summarize computes it (llama.cpp's `--kl-divergence` set). The
    manifest keeps a subset (qconv.manifest.KldStats, qconv.eval.report.SUMMARY_KEYS)."""

    tokens: int
    kld_mean: float
    kld_se: float
    kld_median: float
    kld_p90: float
    kld_p99: float
    kld_p999: float
    kld_max: float
    kld_min: float
    kld_bound: float  # exact mean KLD lies in [kld_mean, kld_mean + kld_bound] (0 for a full reference)
    top1: float
    top1_se: float
    ppl_base: float
    ppl_base_se: float
    ppl_q: float
    ppl_q_se: float
    ln_ppl_ratio: float
    ln_ppl_ratio_se: float
    ppl_ratio: float
    ppl_ratio_se: float
    cor_ln_ppl: float
    dp_mean: float
    dp_se: float
    dp_rms: float

    def validate(self):
        return metric_problems(self)


@dataclass
class MeasuredSource:
    path: str
    sha256: str
    num_parameters: int
    kind: str | None = None  # "model" | "cached reference log-probs" (reports before caches had none)

    _SOMETIMES = ("kind",)


@dataclass
class TextInfo:
    label: str
    sha256: str
    tokens_scored: int
    windows: int
    window: int
    stride: int


@dataclass
class ReferenceInfo:
    storage: str  # "full" | "topk"
    topk: int | None
    vocab_size: int
    describe: str
    cache: str  # the reference cache folder
    given_as_cache: bool | None = None  # read from a cache passed as --reference (no reference model run)

    _SOMETIMES = ("given_as_cache",)


@dataclass
class ForwardInfo:
    streamed: bool
    device: str
    compute_dtype: str | None = None  # bfloat16, or float32 where bf16 is emulated

    _SOMETIMES = ("compute_dtype",)


@dataclass
class TierInfo:
    """Which gate tier judged the model (qconv.eval.gates.tier_info)."""

    name: str | None
    min_params: float | None
    num_parameters: int
    in_target_class: bool
    note: str | None = None

    _SOMETIMES = ("note",)


@dataclass
class TaskResult:
    metric: str
    higher_is_better: bool
    base: float
    quantized: float
    recovery: float | None  # quantized / base (base / quantized where lower is better)
    samples: int | None = None


@dataclass
class TaskResults:
    limit: int | None
    max_gen_toks: int | None
    backend: str
    results: dict[str, TaskResult] = field(default_factory=dict)


@dataclass
class Verdict:
    kind: str  # "gate" | "regression" | "files"
    name: str  # e.g. "weights.max_mean_kld"
    passed: bool
    measured: float | None = None
    limit: float | None = None
    message: str = ""


@dataclass
class ReferenceModel:
    """A build from a quantized checkpoint: what it was measured against (qconv.build.quantized)."""

    kind: str  # "original" | "source checkpoint"
    path: str
    cached: bool
    note: str


@dataclass(kw_only=True)
class EvalReport:
    """report.json. Fields in the order they are written; `_SOMETIMES` are left out while None (before judging, or
    in reports from an older qconv)."""

    schema: int = 1
    artifact: str
    source: MeasuredSource
    settings: EvalSettings
    text: TextInfo
    reference: ReferenceInfo
    bits_per_weight: float
    artifact_bytes: int
    kv_scheme: str | None = None
    kv_form: str | None = None
    forward: ForwardInfo | None = None
    weights: MetricSummary
    weights_kv: MetricSummary | None = None
    weights_a8: MetricSummary | None = None
    machine: str
    date: str
    elapsed_s: float
    tasks: TaskResults | None = None
    tier: TierInfo | None = None
    verdicts: list[Verdict] | None = None  # None: not judged yet
    passed: bool | None = None
    reference_model: ReferenceModel | None = None

    _SOMETIMES = ("forward", "weights_kv", "weights_a8", "tasks", "tier", "verdicts", "passed", "reference_model")

    @property
    def data(self) -> dict[str, Any]:
        """The JSON object report.json holds."""
        return jsonable(self)

    def sections(self) -> dict[str, MetricSummary]:
        """The measured sections, by name (SECTIONS order)."""
        return {s: getattr(self, s) for s in SECTIONS if getattr(self, s) is not None}

    @classmethod
    def of(cls, d: Any, where: str = REPORT_JSON) -> EvalReport:
        """The typed report; a wrong type, a missing or unknown key is one error naming `where` and the key path."""
        fix = "the report is damaged or was written by another qconv; measure again with `qconv eval --out`"
        return read_record(cls, d, where, "eval report", fix)

    @classmethod
    def read(cls, path: str | Path) -> EvalReport:
        fix = "measure again with `qconv eval --out`"
        return cls.of(read_json_object(path, f"eval report {Path(path).name}", fix), str(path))
