"""The build's work dir: every stage's result stored under a key hashed from everything that feeds it.

Stages: import (source file hashes), calibration (token ids), sensitivity (scores), quantization (the compressed
model folder), quality (the report files); packaging always runs and only copies. A stage whose key is already
in the work dir is reused and the log says so, which is what makes a killed build resumable and a rerun cheap.
Results are written to a temp name and renamed, so a kill never leaves a half stage that looks finished.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from qconv import progress
from qconv.fsutil import sha256_json, write_json_atomic
from qconv.paths import qconv_home

log = logging.getLogger(__name__)

DONE = ".qconv-stage-done"


def stage_key(*parts) -> str:
    return sha256_json([str(p) if isinstance(p, Path) else p for p in parts])[:20]


def default_work_dir(source_id: str, revision: str | None) -> Path:
    """One work dir per source (path or hub id + revision); stage keys inside tell contents apart."""
    return qconv_home() / "work" / stage_key(source_id, revision or "")


@dataclass
class WorkDir:
    root: Path
    fresh: bool = False  # ignore results from earlier runs (this run's own results are still used)
    record: dict[str, dict] = field(default_factory=dict)  # stage -> {key, reused}; goes into the manifest
    _made: set[str] = field(default_factory=set)

    def __post_init__(self):
        self.root = Path(self.root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _usable(self, path: Path) -> bool:
        return path.exists() and (not self.fresh or str(path) in self._made)

    def _note(self, stage: str, key: str, reused: bool) -> None:
        self.record[stage] = {"key": key, "reused": reused}
        if reused:
            log.info("stage %s: reusing finished result %s from %s", stage, key, self.root,
                     extra=progress.stage(stage, reused=True))
        else:
            log.info("stage %s: running (key %s)", stage, key, extra=progress.stage(stage))

    def load_json(self, stage: str, key: str) -> dict | None:
        path = self.root / f"{stage}-{key}.json"
        if not self._usable(path):
            self._note(stage, key, False)
            return None
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            log.warning("stage %s: cached result %s unreadable; recomputing", stage, path.name)
            self._note(stage, key, False)
            return None
        self._note(stage, key, True)
        return data

    def save_json(self, stage: str, key: str, obj) -> None:
        path = self.root / f"{stage}-{key}.json"
        write_json_atomic(path, obj)
        self._made.add(str(path))

    def cached_dir(self, stage: str, key: str) -> Path | None:
        path = self.root / f"{stage}-{key}"
        if self._usable(path) and (path / DONE).is_file():
            self._note(stage, key, True)
            return path
        self._note(stage, key, False)
        return None

    @contextlib.contextmanager
    def new_dir(self, stage: str, key: str) -> Iterator[Path]:
        """A temp folder that becomes the stage's result only when the block finishes."""
        final = self.root / f"{stage}-{key}"
        tmp = Path(tempfile.mkdtemp(dir=self.root, prefix=f".{final.name}.", suffix=".partial"))
        try:
            yield tmp
            (tmp / DONE).write_text("ok\n")
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            self._made.add(str(final))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def latest(self, stage: str) -> dict | None:
        """The newest cached JSON result of a stage, whatever its key (for --dry-run, which cannot compute keys
        that need the weights)."""
        files = sorted(self.root.glob(f"{stage}-*.json"), key=lambda p: p.stat().st_mtime)
        for p in reversed(files):
            with contextlib.suppress(OSError, json.JSONDecodeError):
                return json.loads(p.read_text())
        return None

    def clean_partials(self) -> None:
        """Remove what a killed run left half-written (temp folders of unfinished stages)."""
        for p in self.root.glob(".*.partial"):
            shutil.rmtree(p, ignore_errors=True)
