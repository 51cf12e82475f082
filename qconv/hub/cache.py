"""The pulled-artifact cache: QCONV_HOME/artifacts/<key>/ holds only complete, verified artifacts.

Layout under QCONV_HOME/artifacts:
  <key>/              a verified artifact folder (appears by one atomic rename, never half-written)
  .incoming/<key>/    files being downloaded (`*.part` survive a killed pull so the next one resumes)
  .locks/<key>.lock   fcntl lock held for the whole pull so concurrent pulls of one artifact take turns
  .meta/<key>.json    where the cached copy came from (name, location, revision, time)
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from qconv.errors import QconvError
from qconv.fsutil import write_json_atomic
from qconv.manifest import MANIFEST
from qconv.paths import qconv_home

log = logging.getLogger(__name__)


def artifacts_root() -> Path:
    return qconv_home() / "artifacts"


def cache_key(name: str) -> str:
    """Folder name for an artifact name or hub id (`org/name` -> `org--name`, as huggingface_hub does)."""
    key = re.sub(r"[^A-Za-z0-9._-]", "-", name.strip("/").replace("/", "--"))
    if not key or key.startswith("."):
        raise QconvError(f"cannot derive a cache name from {name!r}", fix="pass an index name, hub id or URL")
    return key


def artifact_dir(name: str) -> Path:
    return artifacts_root() / cache_key(name)


def incoming_dir(name: str) -> Path:
    return artifacts_root() / ".incoming" / cache_key(name)


def cached(name: str) -> Path | None:
    """The cached artifact folder for `name`, if a complete one is there."""
    d = artifact_dir(name)
    return d if (d / MANIFEST).is_file() else None


@contextlib.contextmanager
def artifact_lock(name: str) -> Iterator[None]:
    """Exclusive lock per artifact; blocks (with a message) while another process or thread pulls it."""
    path = artifacts_root() / ".locks" / f"{cache_key(name)}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another pull of %s to finish (lock %s)", name, path)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write_meta(name: str, info: dict) -> None:
    write_json_atomic(artifacts_root() / ".meta" / f"{cache_key(name)}.json",
                      {"name": name, "pulled_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **info})


def read_meta(key: str) -> dict:
    path = artifacts_root() / ".meta" / f"{key}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


@dataclass
class CachedArtifact:
    name: str
    path: Path
    size: int
    meta: dict


def list_cached() -> list[CachedArtifact]:
    root = artifacts_root()
    out = []
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        if d.name.startswith(".") or not (d / MANIFEST).is_file():
            continue
        meta = read_meta(d.name)
        size = sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
        out.append(CachedArtifact(meta.get("name", d.name), d, size, meta))
    return out


def resolve_artifact(name_or_path: str | Path) -> Path:
    """A local artifact folder: the path itself if it is a folder, else the cached pull of that name (no network)."""
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        return p.resolve()
    if isinstance(name_or_path, str) and (hit := cached(name_or_path)):
        return hit
    raise QconvError(f"no artifact {str(name_or_path)!r}: not a folder and not in the cache ({artifacts_root()})",
                     fix=f"pull it first: `qconv pull {name_or_path}`, or pass the artifact folder")
