"""The artifact manifest `qconv.json`: the one record every verb (check, serve, pull, verify) trusts.

vLLM and transformers ignore it; qconv reads it to know where an artifact came from, how it was made,
what it costs in quality, and what it needs at run time. Profiles, speculation, requirements and the quality
summary are typed here once, so no consumer re-parses dicts with its own defaults (qconv.artifact opens a folder).
"""

from __future__ import annotations

import math
import os
import platform
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from qconv.errors import QconvError
from qconv.fsutil import file_table, find_links, write_json_atomic
from qconv.modelfiles import read_json_object
from qconv.recipes.schema import coerce_fields, from_dict, read_record, shorten, version_problem
from qconv.recipes.sections import Profile, Speculative

# `vllm_feature` tokens of `requires` entries: the qconv-vllm plugin announces the ones it provides (defined there).
from qconv_vllm.features import KV_PREFIX as KV_PREFIX
from qconv_vllm.features import QUANTIZED_EMBEDDINGS as QUANTIZED_EMBEDDINGS
from qconv_vllm.features import ROTATIONS_CPU as ROTATIONS_CPU
from qconv_vllm.features import TIED_QUANTIZED_HEAD as TIED_QUANTIZED_HEAD
from qconv_vllm.features import WNA16_8BIT_CPU as WNA16_8BIT_CPU

MANIFEST = "qconv.json"
SCHEMA_VERSION = 1
SHA256_RE = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Requirement:
    """One `requires` entry: what the artifact needs beyond stock vLLM (see qconv.convert.requires)."""

    feature: str
    needs: str
    reason: str = ""
    vllm_feature: str | None = None  # the token a vLLM (plugin or --vllm-feature) declares to satisfy it
    profile: str | None = None  # applies to this serving profile only
    platform: str | None = None  # applies to a vLLM of this platform only ("cpu" | "cuda")

    def __post_init__(self):
        if self.vllm_feature is None and isinstance(self.needs, str):  # written before tokens existed: read the
            needs = self.needs.lower()  # token from the wording
            token = (
                QUANTIZED_EMBEDDINGS
                if "quantized embeddings" in needs
                else KV_PREFIX + "kvarn"
                if "kvarn" in needs
                else None
            )
            object.__setattr__(self, "vllm_feature", token)

    @classmethod
    def from_dict(cls, d: dict, where: str = "requires") -> Requirement:
        return from_dict(cls, d, where, MANIFEST)

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class FileEntry:
    """One file of an artifact or source: its sha256 and size in bytes."""

    sha256: str
    size: int

    def validate(self):
        if not SHA256_RE.fullmatch(self.sha256):
            yield "sha256", "expected 64 lowercase hex digits"
        if self.size < 0:
            yield "size", "expected a size in bytes (>= 0)"


# the metrics gates and `check --against` compare, and the range each can take: a recorded value outside it (JSON's
# Infinity, 1e308) would make every comparison against it pass, so the reader refuses it
METRIC_RANGES = {
    **{k: (0.0, 1e6) for k in ("kld_mean", "kld_median", "kld_p99", "kld_max", "kld_bound")},
    "top1": (0.0, 1.0),
    **{k: (0.0, 1e12) for k in ("ppl_base", "ppl_q", "ppl_ratio")},
    "ln_ppl_ratio": (-100.0, 100.0),
}


def metric_problems(stats: Any):
    """(field, problem) for each compared metric of `stats` that is not a finite number inside its range."""
    for name, (lo, hi) in METRIC_RANGES.items():
        v = getattr(stats, name, None)
        if isinstance(v, (int, float)) and not (math.isfinite(v) and lo <= v <= hi):
            yield name, f"{shorten(v)} is outside the range this metric can take [{lo:g}, {hi:g}]"


@dataclass(frozen=True)
class KldStats:
    """One measured section of the quality summary: the subset of report.json's section (qconv.eval.record.MetricSummary)
    that qconv.json keeps; its field names are qconv.eval.report.SUMMARY_KEYS."""

    tokens: int
    kld_mean: float
    kld_se: float
    kld_median: float
    kld_p99: float
    kld_max: float
    kld_bound: float
    top1: float
    ppl_base: float
    ppl_q: float
    ppl_ratio: float
    ln_ppl_ratio: float

    def validate(self):
        return metric_problems(self)


@dataclass(frozen=True)
class QualityReport:
    """The quality summary in qconv.json, as qconv.eval.report.summary writes it. `check --against` regresses
    against it section by section (`data`, the recorded mapping)."""

    report: str | None = None  # report.json beside it
    text: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    reference: dict[str, Any] | str | None = None  # {storage, topk}; a quantized-source build names the kind
    kv_scheme: str | None = None
    kv_form: str | None = None
    tier: dict[str, Any] | None = None
    bits_per_weight: float | None = None
    weights: KldStats | None = None
    weights_kv: KldStats | None = None
    weights_a8: KldStats | None = None  # int8 activations simulated (`check --profile`)
    tasks: dict[str, Any] | None = None
    verdicts: list[dict[str, Any]] = field(default_factory=list)  # the failed gates
    passed: bool | None = None
    selection: dict[str, Any] | None = None  # predicted vs measured KLD of the INT8 selection
    note: str | None = None  # why nothing was measured

    _SOMETIMES = ("weights", "weights_kv", "weights_a8", "tasks", "selection", "note")

    @classmethod
    def of(cls, d: dict, where: str = "quality") -> QualityReport:
        return from_dict(cls, d, where, MANIFEST)

    @property
    def measured(self) -> bool:
        """Whether weights-only numbers were recorded (a build without held-out text records only a note)."""
        return self.weights is not None

    @property
    def data(self) -> dict[str, Any]:
        """The JSON form: the keys summary() writes only when there is something to say are left out when empty."""
        return {k: v for k, v in asdict(self).items() if v is not None or k not in self._SOMETIMES}


# A selection row's decision for a unit moved to the selection's top scheme (`selection.scheme`, normally 8-bit). The
# word written into qconv.json is "int8" (older artifacts have it, and new ones stay byte-identical to them); the
# code calls it the upgrade.
UPGRADE = "int8"


@dataclass
class SelectionRow:
    """One unit of the selection table: qconv.calibrate.select.Row adds the arithmetic, UnitRecord what is recorded."""

    # qconv.json written before the fields were named for what they are (a unit's top option is not always 8-bit)
    RENAMED: ClassVar[dict[str, str]] = {"bytes4": "base_bytes", "bytes8": "top_bytes"}

    unit: str
    role: str
    modules: int
    base_bytes: int  # under the recipe's (4-bit) scheme
    top_bytes: int  # under the selection's top scheme
    score: float | None
    decision: str  # UPGRADE (the selection's top scheme) | "w4" (unchanged) | a step's scheme name | "refused: <why>"
    chosen_bytes: int | None = None  # the unit's bytes under its decision (None: base_bytes / top_bytes by decision)


@dataclass
class UnitRecord(SelectionRow):
    """A row as qconv.json records it."""

    extra_bytes: int = 0


@dataclass(frozen=True)
class SelectionRecord:
    """The INT8 / step selection as recorded (qconv.calibrate.select.Selection.to_dict)."""

    budget: str
    budget_bytes: int
    scheme: str
    method: str
    spent_bytes: int = 0
    int8_units: int = 0
    step_units: dict[str, int] = field(default_factory=dict)
    predicted_kld: float | None = None
    units: list[UnitRecord] = field(default_factory=list)


@dataclass
class BuildInfo:
    """How the artifact was made. A build from full precision records the plan and stages; one from an
    already-quantized checkpoint records what it kept, requantized and copied."""

    seed: int | None = None
    family: str | None = None
    untied_embeddings: bool | None = None
    tied_embeddings: bool | None = None
    untie_bytes: int | None = None
    estimated_bytes: int | None = None
    source_bytes: int | None = None
    warnings: list[str] = field(default_factory=list)
    streamed: bool | None = None
    work_dir: str | None = None
    device: str | None = None  # where the build computed ("cpu", "cuda", ...)
    compute_dtype: str | None = None  # what its forwards computed in (--compute-dtype; bfloat16 or float32)
    cpu_isa: str | None = None  # torch's CPU kernel class on a CPU build (AVX512, AVX2): float sums follow it
    stages: dict[str, dict[str, Any]] = field(default_factory=dict)
    elapsed_s: float | None = None
    source_format: dict[str, Any] | None = None
    kept: list[str] = field(default_factory=list)
    requantized: list[str] = field(default_factory=list)
    copied: list[str] = field(default_factory=list)
    notes: dict[str, str] = field(default_factory=dict)  # module -> why it was kept or copied as it was
    reference: str | None = None
    quality_reference: dict[str, Any] | None = None


@dataclass
class SourceInfo:
    kind: str  # "hf_dir" | "hub" | "gguf"
    id: str  # what the user passed (path or hub id)
    revision: str | None = None
    files: dict[str, FileEntry] = field(default_factory=dict)
    sha256: str = ""  # hash over `files` (canonical JSON)
    architecture: str = ""
    num_parameters: int = 0
    quantization: dict[str, Any] = field(default_factory=dict)  # an already-quantized source's format (gptq, awq, ...)

    def __post_init__(self):
        coerce_fields(self, MANIFEST, "source")


@dataclass
class RecipeInfo:
    name: str
    sha256: str
    resolved: dict[str, Any]


@dataclass
class CalibrationInfo:
    kind: str  # "file" | "hf" | "self"
    id: str
    sha256: str
    samples: int
    seq_len: int
    seed: int
    tokens: int = 0


@dataclass
class ModuleDecision:
    name: str
    role: str
    scheme: str  # e.g. "w4a16", "w8a16", "w8a8", "bf16"
    bits: int | None = None
    group_size: int | None = None
    shape: list[int] = field(default_factory=list)  # [out_features, in_features]
    note: str = ""
    symmetric: bool = True  # False: int codes with per-group zero points (the scheme's `symmetric: false`)


@dataclass
class Manifest:
    source: SourceInfo
    recipe: RecipeInfo
    modules: list[ModuleDecision]
    files: dict[str, FileEntry] = field(default_factory=dict)  # rel path -> entry; excludes qconv.json
    calibration: CalibrationInfo | None = None
    profiles: dict[str, Profile] = field(default_factory=dict)
    speculative: Speculative | None = None  # None: the artifact records no speculation ({} in the JSON)
    requires: list[Requirement] = field(default_factory=list)
    selection: SelectionRecord | None = None  # INT8 selection table (None: no selection ran)
    quality: QualityReport | None = None  # report summary + gate verdicts
    status: str = "ok"  # "ok" | "failed" (a quality gate failed) | "unchecked"
    tools: dict[str, str] = field(default_factory=dict)
    build: BuildInfo = field(default_factory=BuildInfo)
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self):
        """Writers may pass the JSON forms (dicts, lists); store the typed ones, checked like the reader checks them."""
        for name in ("speculative", "selection"):  # `{}` in the JSON: none recorded
            if getattr(self, name) == {}:
                setattr(self, name, None)
        coerce_fields(self, MANIFEST)

    def to_dict(self) -> dict:
        coerce_fields(self, MANIFEST)  # a field assigned after construction is checked like the rest
        d = asdict(self)
        d["speculative"] = d["speculative"] or {}
        d["requires"] = [r.to_dict() for r in self.requires]
        d["quality"] = self.quality.data if self.quality is not None else None
        d["build"] = {k: v for k, v in d["build"].items() if v is not None}
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str = MANIFEST) -> Manifest:
        """The typed manifest; a wrong type, a missing or unknown key is one error naming its key path."""
        if not isinstance(d, dict):
            raise QconvError(
                f"malformed manifest: expected a JSON object, got {type(d).__name__}",
                where=where,
                fix="the artifact is damaged or not a qconv artifact; rebuild or re-pull it",
            )
        if type(d.get("schema_version")) is not int or d["schema_version"] != SCHEMA_VERSION:  # not true, not 1.0
            raise QconvError(
                version_problem("manifest", d.get("schema_version"), SCHEMA_VERSION),
                where=where,
                fix="rebuild or re-pull the artifact with this qconv version",
            )
        d = {**d, **{k: None for k in ("speculative", "selection") if d.get(k) == {}}}  # `{}`: none recorded
        fix = "the artifact is damaged or was written by another qconv; rebuild or re-pull it"
        return read_record(cls, d, where, "manifest", fix)

    def write(self, artifact_dir: str | Path) -> None:
        write_json_atomic(Path(artifact_dir) / MANIFEST, self.to_dict())

    def total_size(self) -> int:
        return sum(f.size for f in self.files.values())


def read_manifest(artifact_dir: str | Path) -> Manifest:
    path = Path(artifact_dir) / MANIFEST
    if not Path(artifact_dir).is_dir():
        raise QconvError(f"artifact folder not found: {artifact_dir}", fix="pass the folder `qconv build --out` wrote")
    if not path.is_file():
        raise QconvError(
            f"no {MANIFEST} in {artifact_dir}",
            where=str(path),
            fix="this folder is not a qconv artifact; build one with `qconv build` or pass a source model instead",
        )
    data = read_json_object(path, MANIFEST, "re-pull or rebuild the artifact")
    return Manifest.from_dict(data, where=str(path))


def hash_artifact_files(artifact_dir: str | Path) -> dict[str, FileEntry]:
    return {k: FileEntry(**v) for k, v in file_table(artifact_dir, exclude=(MANIFEST,)).items()}


def verify_files(artifact_dir: str | Path, manifest: Manifest) -> list[str]:
    """Problems found comparing the folder to the manifest's file table; empty means verified."""
    actual = hash_artifact_files(artifact_dir)
    links = {p.relative_to(artifact_dir).as_posix(): p for p in find_links(artifact_dir) if p != Path(artifact_dir)}
    problems = [
        f"{name}: a symbolic link (to {os.readlink(p)}); an artifact's files are regular files inside it"
        for name, p in links.items()
    ]
    for name, want in manifest.files.items():
        if name in links:
            continue
        got = actual.get(name)
        if got is None:
            problems.append(f"{name}: missing")
        elif got.sha256 != want.sha256:
            problems.append(f"{name}: sha256 {got.sha256} != manifest {want.sha256}")
        elif got.size != want.size:
            problems.append(f"{name}: size {got.size} != manifest {want.size}")
    for name in sorted(set(actual) - set(manifest.files)):
        problems.append(f"{name}: not in manifest")
    return problems


def tool_versions() -> dict[str, str]:
    import importlib.metadata as md

    from qconv.version import __version__

    out = {"qconv": __version__, "python": platform.python_version()}
    for pkg in ("torch", "transformers", "llmcompressor", "compressed-tensors", "safetensors", "gguf"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out
