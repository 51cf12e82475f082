"""The pulled-artifact cache: one slot per source location, one folder per revision, an atomic `current` pointer.

Layout under QCONV_HOME/artifacts:
  <key>/source.json       the location this slot mirrors; <key> = kind + last name + hash of the location, so a
                          folder, a URL and a Hub id with the same last name never share a slot
  <key>/revs/<rev>/       complete, verified artifact folders (each appears by one atomic rename)
  <key>/revs/<rev>.lock   readers (`qconv serve`) hold a shared flock on it while they use that revision
  <key>/current           symlink to revs/<rev>, switched by rename: readers see the old or the new, never a mix
  .incoming/<key>/        url/path downloads in progress (`*.part` survive a killed pull so the next one resumes)
  .hf/                    huggingface_hub's cache for Hub downloads in progress (removed once a revision is in)
  .locks/<key>.lock       exclusive flock held for the whole pull so concurrent pulls of one slot take turns
  .names/<NAME>.json      index name -> the location it was pulled from (`qconv serve NAME` works offline)

An old revision is removed once a newer one is current and no reader holds its lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from qconv.errors import QconvError
from qconv.fsutil import (
    atomic_dir,
    refuse_links,
    sha256_bytes,
    sweep_stale,
    switch_symlink,
    write_json_atomic,
)
from qconv.hub.download import LINK_FIX
from qconv.hub.index import HF_ID_RE, NAME_RE, Location, load_index, parse_location
from qconv.manifest import MANIFEST
from qconv.paths import qconv_home

log = logging.getLogger(__name__)


def artifacts_root() -> Path:
    return qconv_home() / "artifacts"


def _safe(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "-", s).strip(".-") or "x"


def slot_key(loc: Location) -> str:
    """`hf--ORG--NAME` for a Hub repo (as huggingface_hub names it); `url--NAME--H` / `path--NAME--H` otherwise,
    H a hash of the full location."""
    if loc.kind == "hf":
        return "hf--" + "--".join(_safe(p) for p in loc.uri.split("/"))
    last = loc.uri.rstrip("/").rsplit("/", 1)[-1]
    return f"{loc.kind}--{_safe(last)}--{sha256_bytes(loc.uri.encode())[:12]}"


def slot_dir(loc: Location) -> Path:
    return artifacts_root() / slot_key(loc)


def incoming_dir(loc: Location) -> Path:
    return artifacts_root() / ".incoming" / slot_key(loc)


def hf_cache_dir() -> Path:
    return artifacts_root() / ".hf"


CURRENT_RE = re.compile(r"revs/[A-Za-z0-9][A-Za-z0-9._-]*")


def check_slot(loc: Location) -> None:
    """Refuse a symbolic link planted where a pull writes (the slot, its `revs`, the download and lock folders):
    writing through one would put the artifact, or overwrite files, wherever it points. QCONV_HOME and its
    `artifacts` folder may be links (a cache moved to a bigger disk); nothing below them may be."""
    root = artifacts_root()
    slot, lock = slot_dir(loc), root / ".locks" / f"{slot_key(loc)}.lock"
    for p in (
        root / ".incoming",
        incoming_dir(loc),
        slot,
        slot / "revs",
        root / ".locks",
        lock,
        root / ".names",
        root / ".hf",
    ):
        if p.is_symlink():
            refuse_links(p, "the artifact cache is damaged", LINK_FIX)
    cur = slot_dir(loc) / "current"
    if cur.is_symlink() and not CURRENT_RE.fullmatch(os.readlink(cur)):
        raise QconvError(
            f"the artifact cache is damaged: {cur} points to {os.readlink(cur)}, outside the slot's revs/",
            where=str(slot_dir(loc)),
            fix=LINK_FIX,
        )


def _same(a: Location, b: Location) -> bool:
    return (a.kind, a.uri) == (b.kind, b.uri)


def read_source(slot: Path) -> tuple[Location, dict] | None:
    try:
        d = json.loads((slot / "source.json").read_text())
        return Location(d["kind"], d["uri"]), d
    except (OSError, ValueError, KeyError, TypeError):
        return None


def current(loc: Location) -> Path | None:
    """The current complete revision folder of the slot for `loc`, if it holds one that came from `loc`."""
    slot = slot_dir(loc)
    src = read_source(slot)
    if src is None or not _same(src[0], loc):
        return None
    link = slot / "current"
    if not link.is_symlink() or not CURRENT_RE.fullmatch(os.readlink(link)) or (slot / "revs").is_symlink():
        return None
    target = link.resolve()
    return target if (target / MANIFEST).is_file() else None


def revision_dir(loc: Location, rev: str) -> Path:
    return slot_dir(loc) / "revs" / rev


def have_revision(loc: Location, rev: str) -> bool:
    """Whether revs/<rev> is complete; a link inside it is damage, refused (a pulled artifact holds regular files)."""
    final = revision_dir(loc, rev)
    if not (final / MANIFEST).is_file():
        return False
    refuse_links(final, "the cached artifact is damaged", f"remove {final} and pull again")
    return True


@contextlib.contextmanager
def artifact_lock(loc: Location) -> Iterator[None]:
    """Exclusive lock per slot; blocks (with a message) while another process or thread pulls it."""
    path = artifacts_root() / ".locks" / f"{slot_key(loc)}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another pull of %s to finish (lock %s)", loc.describe(), path)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def sweep(loc: Location, name: str) -> None:
    """Crash leftovers of earlier pulls of this slot, and old revisions no reader holds any more.

    Call under artifact_lock: then no other process owns any of the leftovers. `.NAME.*.partial` / `.NAME.old-PID`
    in the root are what pulls before the per-source layout left (nothing writes them there now)."""
    slot = slot_dir(loc)
    gone = sweep_stale(artifacts_root(), _safe(name.replace("/", "--"))) + sweep_stale(slot / "revs", "*")
    stray = list(slot.glob(".current.tmp-*"))
    if loc.kind == "hf":  # huggingface_hub's per-process temp files of a download that was killed
        stray += hf_cache_dir().glob(f"models--{slot_key(loc)[4:]}/blobs/*.incomplete")
    for p in stray:
        p.unlink(missing_ok=True)
    for p in gone + stray:
        log.info("removed a leftover of an interrupted pull: %s", p)
    if (slot / "current").is_symlink():
        remove_old_revisions(slot)


def install(loc: Location, rev: str, fill: Callable[[Path], None], info: dict) -> Path:
    """Build revs/<rev> with fill(tmp) (all-or-nothing), point `current` at it, drop unheld old revisions."""
    slot = slot_dir(loc)
    final = slot / "revs" / rev
    if not (final / MANIFEST).is_file():
        with atomic_dir(final, force=True) as tmp:
            fill(tmp)
    write_json_atomic(
        slot / "source.json",
        {**asdict(loc), "revision": rev, "pulled_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **info},
    )
    switch_symlink(slot / "current", f"revs/{rev}")
    remove_old_revisions(slot)
    return final


def _rev_lock(rev_dir: Path) -> Path:
    return rev_dir.with_name(rev_dir.name + ".lock")


def remove_old_revisions(slot: Path) -> list[str]:
    """Remove every revision but the current one that no reader holds; returns the names kept because held."""
    cur = (slot / "current").resolve().name
    kept = []
    for d in sorted((slot / "revs").iterdir()) if (slot / "revs").is_dir() else []:
        if d.name.startswith(".") or d.name == cur or d.name == f"{cur}.lock":
            continue
        if d.suffix == ".lock":  # a lock whose revision is gone (a reader opened it after the removal)
            if not d.with_suffix("").exists():
                d.unlink(missing_ok=True)
            continue
        with open(_rev_lock(d), "a+") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.info("keeping old revision %s: a running process still uses it", d)
                kept.append(d.name)
                continue
            old = d.with_name(f".{d.name}.old-{os.getpid()}")
            os.replace(d, old)
            shutil.rmtree(old, ignore_errors=True)
            _rev_lock(d).unlink(missing_ok=True)
    return kept


def record_name(name: str, loc: Location) -> None:
    write_json_atomic(artifacts_root() / ".names" / f"{name}.json", {"name": name, **asdict(loc)})


def _named_location(name: str) -> Location | None:
    """Where NAME points: the index (if it can be read without the network), else the record of its last pull."""
    try:
        entry = load_index(offline=True).get(name)
    except QconvError:
        entry = None
    if entry:
        return entry.location
    try:
        d = json.loads((artifacts_root() / ".names" / f"{name}.json").read_text())
        return Location(d["kind"], d["uri"], d.get("revision"))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def target_location(target: str) -> Location | None:
    """The location a pull target names, with no network: URL, file:// / folder, index name, or Hub id."""
    if target.startswith(("http://", "https://", "file://")) or Path(target).expanduser().is_dir():
        return parse_location(target)
    if NAME_RE.match(target) and (loc := _named_location(target)):
        return loc
    if HF_ID_RE.match(target):
        return Location("hf", target)
    return None


def resolve_artifact(name_or_path: str | Path) -> Path:
    """A local artifact folder: the path itself if it is a folder, else the current cached revision (no network).

    For an index name the cached copy must come from the location the index names."""
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        return p.resolve()
    target = str(name_or_path)
    loc = target_location(target)
    hit = current(loc) if loc else None
    if hit:
        return hit
    if loc and (src := read_source(slot_dir(loc))) and not _same(src[0], loc):
        raise QconvError(
            f"the cached {target!r} came from {src[0].describe()}, not from {loc.describe()}",
            where=str(slot_dir(loc)),
            fix=f"pull it again: `qconv pull {target}`",
        )
    raise QconvError(
        f"no artifact {target!r}: not a folder and not in the cache ({artifacts_root()})",
        fix=f"pull it first: `qconv pull {target}`, or pass the artifact folder",
    )


@contextlib.contextmanager
def hold_artifact(name_or_path: str | Path) -> Iterator[Path]:
    """resolve_artifact plus a shared lock on the cached revision for the whole `with` block, so a re-pull never
    removes the folder a server is reading (a user's own folder is yielded as is)."""
    for _ in range(100):
        path = resolve_artifact(name_or_path)
        if path.parent.name != "revs" or artifacts_root().resolve() not in path.parents:
            yield path
            return
        with open(_rev_lock(path), "a+") as f:
            fcntl.flock(f, fcntl.LOCK_SH)
            if (path / MANIFEST).is_file():  # still there once locked: no pull can remove it now
                try:
                    yield path
                finally:
                    fcntl.flock(f, fcntl.LOCK_UN)
                return
    raise QconvError(
        f"{name_or_path}: the cached artifact kept changing while it was being opened",
        fix="wait for the running `qconv pull` to finish",
    )


@dataclass
class CachedArtifact:
    name: str
    path: Path
    size: int
    meta: dict


def list_cached() -> list[CachedArtifact]:
    root = artifacts_root()
    out = []
    for slot in sorted(root.iterdir()) if root.is_dir() else []:
        src = read_source(slot)
        if slot.name.startswith(".") or src is None or not (cur := current(src[0])):
            continue
        size = sum(p.stat().st_size for p in cur.rglob("*") if p.is_file())
        out.append(
            CachedArtifact(src[1].get("name") or slot.name, cur, size, {**src[1], "location": src[0].describe()})
        )
    return out
