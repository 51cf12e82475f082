"""The model folder our engine loads, checked before anything reads its weights, and its EngineConfig
(qconv.models.config) from the folder's ModelSpec."""

from __future__ import annotations

from pathlib import Path

from qconv.errors import QconvError
from qconv.modelfiles import check_weight_files
from qconv.models.config import EngineConfig, engine_config
from qconv.models.spec import ModelSpec


def model_spec(path: str | Path) -> ModelSpec:
    """The ModelSpec of a model folder or artifact, its weight files' headers checked against it (damaged files are
    one clear error here, not a traceback from the loader)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise QconvError(
            "not a model folder or qconv artifact (no config.json)",
            where=str(path),
            fix="pass the folder written by `qconv build` or an HF model folder",
        )
    spec = ModelSpec.read(path)
    check_weight_files(path, spec.config)
    return spec


def as_spec(path: str | Path | ModelSpec) -> ModelSpec:
    """A caller's model: its ModelSpec as given, or read from the folder."""
    return path if isinstance(path, ModelSpec) else model_spec(path)


def model_dir(path: str | Path) -> Path:
    return model_spec(path).folder


def load_config(path: str | Path | ModelSpec, *, has_mtp: bool = False) -> EngineConfig:
    """The EngineConfig of a model folder (or of its ModelSpec); an architecture no family covers is one
    QconvError listing the families."""
    return engine_config(as_spec(path), has_mtp=has_mtp)
