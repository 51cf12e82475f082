"""Where the source model comes from: a local HF folder, a Hugging Face id, or a .gguf file.

Every source resolves to a local HF folder plus a record of what it was (kind, id, revision, file hashes) so the
manifest can say exactly which bytes an artifact was made from.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from qconv.errors import QconvError
from qconv.fsutil import sha256_file, sha256_json
from qconv.manifest import SourceInfo
from qconv.modelfiles import read_model_config, safetensors_header
from qconv.paths import qconv_home

log = logging.getLogger(__name__)

HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


@dataclass
class ResolvedSource:
    path: Path  # local HF folder
    kind: str  # "hf_dir" | "hub" | "gguf"
    id: str
    revision: str | None = None
    config: dict = field(default_factory=dict, repr=False)  # its config.json, read once when resolved

    def info(self) -> SourceInfo:
        files = source_files(self.path)
        return SourceInfo(
            kind=self.kind,
            id=self.id,
            revision=self.revision,
            files=files,
            sha256=sha256_json(files),
            architecture=(self.config or read_config(self.path)).get("model_type", ""),
        )


def _looks_like_path(s: str) -> bool:
    """Hub ids are `name` or `org/name`; anything else path-shaped is a local path."""
    return s.startswith((".", "/", "~")) or s.count("/") > 1 or s.endswith((".gguf", "/"))


def read_config(folder: Path) -> dict:
    return read_model_config(folder)


def source_files(folder: Path) -> dict[str, dict]:
    """sha256 + size of the files that define the model (weights, configs, tokenizer)."""
    out = {}
    for p in sorted(folder.iterdir()):
        if p.is_file() and (p.suffix in {".safetensors", ".json", ".model", ".txt", ".jinja"}):
            out[p.name] = {"sha256": sha256_file(p), "size": p.stat().st_size}
    return out


def check_model_dir(folder: Path, *, weights: bool = True) -> dict:
    """Validate a local HF folder; returns its config."""
    cfg = read_config(folder)
    if weights:
        shards = sorted(folder.glob("*.safetensors"))
        if not shards:
            pickles = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
            hint = f" (found pickle weights {pickles}: convert them to safetensors first)" if pickles else ""
            raise QconvError(
                f"no *.safetensors weights in {folder}{hint}",
                where=str(folder),
                fix="pass a folder saved with save_pretrained(safe_serialization=True)",
            )
        for s in shards:
            safetensors_header(s)  # fail early and clearly on a truncated or corrupt file
    return cfg


def _download_hub(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_PATTERNS))
    except RepositoryNotFoundError as e:
        raise QconvError(
            f"Hugging Face repo {repo_id!r} not found (or private)",
            where="--model",
            fix="check the id, log in with `hf auth login`, or pass a local folder",
        ) from e
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        raise QconvError(
            f"cannot fetch {repo_id!r} from the Hugging Face Hub and it is not in the local cache ({type(e).__name__})",
            where="--model",
            fix=f"on a connected machine run `hf download {repo_id} --local-dir DIR`, copy DIR here, and pass --model DIR",
        ) from e


def resolve_source(model: str, *, revision: str | None = None, weights: bool = True) -> ResolvedSource:
    """Turn what the user passed to --model into a local, validated HF folder."""
    p = Path(model).expanduser()
    if p.is_dir():
        cfg = check_model_dir(p, weights=weights)
        return ResolvedSource(path=p.resolve(), kind="hf_dir", id=str(p.resolve()), config=cfg)
    if p.suffix == ".gguf":
        if not p.is_file():
            raise QconvError(f"GGUF file not found: {p}", where="--model", fix="check the path")
        folder = import_cached(p)
        return ResolvedSource(path=folder, kind="gguf", id=str(p.resolve()), config=read_config(folder))
    if p.exists():
        raise QconvError(
            f"--model {model} is a file but not a .gguf",
            where="--model",
            fix="pass a model folder, a Hugging Face id, or a .gguf file",
        )
    if _looks_like_path(model):
        raise QconvError(f"model path does not exist: {model}", where="--model", fix="check the path")
    local = _download_hub(model, revision)
    cfg = check_model_dir(local, weights=weights)
    return ResolvedSource(path=local, kind="hub", id=model, revision=revision or "main", config=cfg)


def import_cached(gguf_file: Path) -> Path:
    """Import a GGUF once per content hash under QCONV_HOME/imports."""
    from qconv.convert.gguf import import_gguf

    digest = sha256_file(gguf_file)
    out = qconv_home() / "imports" / f"{gguf_file.stem}-{digest[:16]}"
    if (out / "config.json").is_file():
        log.info("using imported GGUF %s", out)
        return out
    return import_gguf(gguf_file, out, force=True)
