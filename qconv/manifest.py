"""The artifact manifest `qconv.json`: the one record every verb (check, serve, pull, verify) trusts.

vLLM and transformers ignore it; qconv reads it to know where an artifact came from, how it was made,
what it costs in quality, and what it needs at run time. Profiles, speculation, requirements and the quality
summary are typed here once, so no consumer re-parses dicts with its own defaults (qconv.artifact opens a folder).
"""

from __future__ import annotations

import json
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from qconv.errors import QconvError
from qconv.fsutil import file_table, write_json_atomic
from qconv.recipes.recipe import Profile, Speculative
from qconv.recipes.schema import SchemaError, from_dict

MANIFEST = "qconv.json"
SCHEMA_VERSION = 1
# `vllm_feature` tokens of `requires` entries: the qconv-vllm plugin announces the ones it provides.
QUANTIZED_EMBEDDINGS = "quantized-embeddings"
WNA16_8BIT_CPU = "wna16-8bit-cpu"
TIED_QUANTIZED_HEAD = "quantized-tied-head"
KV_PREFIX = "kv-cache:"


@dataclass(frozen=True)
class Requirement:
    """One `requires` entry: what the artifact needs beyond stock vLLM (see qconv.convert.requires)."""
    feature: str
    needs: str
    reason: str = ""
    vllm_feature: str | None = None  # the token a vLLM (plugin or --vllm-feature) declares to satisfy it
    profile: str | None = None  # applies to this serving profile only
    platform: str | None = None  # applies to a vLLM of this platform only ("cpu" | "cuda")

    @classmethod
    def from_dict(cls, d: dict, where: str = "requires") -> Requirement:
        r = from_dict(cls, d, where, MANIFEST)
        if r.vllm_feature is None:  # manifests written before tokens existed: read the token from the wording
            needs = r.needs.lower()
            token = (QUANTIZED_EMBEDDINGS if "quantized embeddings" in needs
                     else KV_PREFIX + "kvarn" if "kvarn" in needs else None)
            r = Requirement(**{**asdict(r), "vllm_feature": token})
        return r

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class QualityReport:
    """The quality summary in qconv.json (qconv.eval.report.summary): typed access over the recorded mapping,
    which is kept whole because `check --against` regresses against it section by section."""
    data: dict[str, Any]

    @property
    def measured(self) -> bool:
        """Whether weights-only numbers were recorded (a build without held-out text records only a note)."""
        return bool(self.data.get("weights"))

    @property
    def passed(self) -> bool | None:
        return self.data.get("passed")

    @property
    def settings(self) -> dict[str, Any]:
        return self.data.get("settings") or {}

    @property
    def verdicts(self) -> list[dict]:
        return self.data.get("verdicts") or []


@dataclass
class SourceInfo:
    kind: str  # "hf_dir" | "hub" | "gguf"
    id: str  # what the user passed (path or hub id)
    revision: str | None = None
    files: dict[str, dict] = field(default_factory=dict)  # name -> {sha256, size}
    sha256: str = ""  # hash over `files` (canonical JSON)
    architecture: str = ""
    num_parameters: int = 0
    quantization: dict[str, Any] = field(default_factory=dict)  # an already-quantized source's format (gptq, awq, ...)


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
    files: dict[str, dict] = field(default_factory=dict)  # rel path -> {sha256, size}; excludes qconv.json
    calibration: CalibrationInfo | None = None
    profiles: dict[str, Profile] = field(default_factory=dict)
    speculative: Speculative | None = None  # None: the artifact records no speculation ({} in the JSON)
    requires: list[Requirement] = field(default_factory=list)
    selection: dict[str, Any] = field(default_factory=dict)  # INT8 selection table (sensitivity issue)
    quality: QualityReport | None = None  # report summary + gate verdicts
    status: str = "ok"  # "ok" | "failed" (a quality gate failed) | "unchecked"
    tools: dict[str, str] = field(default_factory=dict)
    build: dict[str, Any] = field(default_factory=dict)  # seed, elapsed, sizes, stage hashes
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self):
        """Accept the JSON forms too (what older code and the reader pass); store the typed ones."""
        self.profiles = {k: v if isinstance(v, Profile) else from_dict(Profile, v, f"profiles.{k}", MANIFEST)
                         for k, v in self.profiles.items()}
        if isinstance(self.speculative, dict):
            self.speculative = from_dict(Speculative, self.speculative, "speculative", MANIFEST) \
                if self.speculative else None
        self.requires = [r if isinstance(r, Requirement) else Requirement.from_dict(r, f"requires[{i}]")
                         for i, r in enumerate(self.requires)]
        if isinstance(self.quality, dict):
            self.quality = QualityReport(self.quality)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["speculative"] = d["speculative"] or {}
        d["requires"] = [r.to_dict() for r in self.requires]
        d["quality"] = self.quality.data if self.quality is not None else None
        return d

    @classmethod
    def from_dict(cls, d: dict, where: str = MANIFEST) -> Manifest:
        try:
            if d.get("schema_version") != SCHEMA_VERSION:
                raise QconvError(
                    f"unsupported manifest schema_version {d.get('schema_version')!r} (this qconv reads {SCHEMA_VERSION})",
                    where=where, fix="rebuild or re-pull the artifact with this qconv version")
            d = dict(d)
            d["source"] = SourceInfo(**d["source"])
            d["recipe"] = RecipeInfo(**d["recipe"])
            d["modules"] = [ModuleDecision(**m) for m in d["modules"]]
            if d.get("calibration"):
                d["calibration"] = CalibrationInfo(**d["calibration"])
            return cls(**d)
        except SchemaError as e:
            raise QconvError(f"malformed manifest: {e.what}", where=where,
                             fix="the artifact is damaged or was written by another qconv; rebuild or re-pull it") from e
        except QconvError:
            raise
        except (KeyError, TypeError) as e:
            raise QconvError(f"malformed manifest: {e}", where=where,
                             fix="the artifact is damaged or not a qconv artifact; rebuild or re-pull it") from e

    def write(self, artifact_dir: str | Path) -> None:
        write_json_atomic(Path(artifact_dir) / MANIFEST, self.to_dict())

    def total_size(self) -> int:
        return sum(f["size"] for f in self.files.values())


def read_manifest(artifact_dir: str | Path) -> Manifest:
    path = Path(artifact_dir) / MANIFEST
    if not Path(artifact_dir).is_dir():
        raise QconvError(f"artifact folder not found: {artifact_dir}", fix="pass the folder `qconv build --out` wrote")
    if not path.is_file():
        raise QconvError(f"no {MANIFEST} in {artifact_dir}", where=str(path),
                         fix="this folder is not a qconv artifact; build one with `qconv build` or pass a source model instead")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise QconvError(f"{MANIFEST} is not valid JSON: {e}", where=str(path), fix="re-pull or rebuild the artifact") from e
    return Manifest.from_dict(data, where=str(path))


def hash_artifact_files(artifact_dir: str | Path) -> dict[str, dict]:
    return file_table(artifact_dir, exclude=(MANIFEST,))


def verify_files(artifact_dir: str | Path, manifest: Manifest) -> list[str]:
    """Problems found comparing the folder to the manifest's file table; empty means verified."""
    actual = hash_artifact_files(artifact_dir)
    problems = []
    for name, want in manifest.files.items():
        got = actual.get(name)
        if got is None:
            problems.append(f"{name}: missing")
        elif got["sha256"] != want["sha256"]:
            problems.append(f"{name}: sha256 {got['sha256']} != manifest {want['sha256']}")
        elif got["size"] != want["size"]:
            problems.append(f"{name}: size {got['size']} != manifest {want['size']}")
    for name in sorted(set(actual) - set(manifest.files)):
        problems.append(f"{name}: not in manifest")
    return problems


def tool_versions() -> dict[str, str]:
    import importlib.metadata as md

    import qconv

    out = {"qconv": qconv.__version__, "python": platform.python_version()}
    for pkg in ("torch", "transformers", "llmcompressor", "compressed-tensors", "safetensors", "gguf"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out
