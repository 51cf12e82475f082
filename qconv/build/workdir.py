"""The build's work dir: every stage's result stored under a key hashed from everything that feeds it.

Stages: import (source file hashes), calibration (token ids), sensitivity (scores), quantization (the compressed
model folder), quality (the report files); packaging always runs and only copies. A stage whose key is already
in the work dir is reused and the log says so, which is what makes a killed build resumable and a rerun cheap.
Results are written to a temp name and renamed, so a kill never leaves a half stage that looks finished; a stage
folder's DONE marker holds its file table, checked before the folder is reused. One build at a time holds a work
dir (flock on its `.lock`); a second waits for it, then reuses what the first finished.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from qconv import progress
from qconv.fsutil import file_table, fsync_path, fsync_tree, owned_temp_dir, sha256_json, sweep_stale, write_json_atomic
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
            log.info(
                "stage %s: reusing finished result %s from %s",
                stage,
                key,
                self.root,
                extra=progress.stage(stage, reused=True),
            )
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
            if self._intact(path):
                self._note(stage, key, True)
                return path
            log.warning("stage %s: cached folder %s does not match its DONE file table; recomputing", stage, path.name)
        self._note(stage, key, False)
        return None

    @staticmethod
    def _intact(path: Path) -> bool:
        """The folder holds exactly the files (sha256 and size) its DONE marker recorded when the stage finished."""
        try:
            want = json.loads((path / DONE).read_text())["files"]
        except (OSError, ValueError, KeyError, TypeError):
            return False  # a marker without a file table (older qconv) proves nothing
        return file_table(path, exclude=(DONE,)) == want

    @contextlib.contextmanager
    def new_dir(self, stage: str, key: str) -> Iterator[Path]:
        """A temp folder that becomes the stage's result only when the block finishes, with its file table in DONE."""
        final = self.root / f"{stage}-{key}"
        with owned_temp_dir(self.root, final.name) as tmp:
            yield tmp
            write_json_atomic(tmp / DONE, {"files": file_table(tmp, exclude=(DONE,))})
            fsync_tree(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            fsync_path(self.root)
            self._made.add(str(final))

    def latest(self, stage: str) -> dict | None:
        """The newest cached JSON result of a stage, whatever its key (for --dry-run, which cannot compute keys
        that need the weights)."""
        files = sorted(self.root.glob(f"{stage}-*.json"), key=lambda p: p.stat().st_mtime)
        for p in reversed(files):
            with contextlib.suppress(OSError, json.JSONDecodeError):
                return json.loads(p.read_text())
        return None

    @contextlib.contextmanager
    def locked(self) -> Iterator[WorkDir]:
        """Hold the work dir for one build: a second build of the same source waits here instead of deleting the
        first one's stage folders, then reuses its finished stages."""
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                log.warning(
                    "work dir %s is in use by another build (pid %s); waiting for it to finish",
                    self.root,
                    holder,
                    extra=progress.now(),
                )
                fcntl.flock(fd, fcntl.LOCK_EX)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            yield self
        finally:
            os.close(fd)

    def clean_partials(self) -> None:
        """Remove what killed runs left half-written: temp folders and files whose owner is gone, and the shared
        offload folder older builds used (callers hold the lock, so no other build is using it)."""
        sweep_stale(self.root, "*")
        shutil.rmtree(self.root / "offload", ignore_errors=True)
