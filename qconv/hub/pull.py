"""`qconv pull`: fetch a prebuilt artifact into the cache; it becomes visible only once every file verifies.

Targets: an index name, a Hugging Face id (`org/name`), an http(s) URL of an artifact folder, or a local folder /
file:// URL. Trust flows from the index (it lists the sha256 of qconv.json and of every file); without an index
entry, qconv.json is taken from the location and its file table binds every other file.
"""

from __future__ import annotations

import logging
import os
import shutil
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from qconv.errors import QconvError
from qconv.fsutil import atomic_dir, sha256_file
from qconv.hub import cache
from qconv.hub.download import IntegrityError, Want, check_file_name, fetch_verified, hf_fetch, http_fetch, \
    join_url, local_fetch
from qconv.hub.index import HF_ID_RE, NAME_RE, IndexEntry, Location, load_index
from qconv.manifest import MANIFEST, Manifest, read_manifest

log = logging.getLogger(__name__)

Fetch = Callable[[Path, bool], None]


@dataclass
class PullSource:
    name: str  # the cache name `qconv serve NAME` will use
    location: Location
    entry: IndexEntry | None = None


def _is_url(s: str) -> bool:
    return s.startswith(("http://", "https://"))


def target_name(target: str) -> str:
    """The cache name a target is stored under; needs no network (so `--offline` can use it)."""
    if _is_url(target):
        seg = urllib.parse.unquote(urllib.parse.urlparse(target).path.rstrip("/").rsplit("/", 1)[-1])
        if not NAME_RE.match(seg):
            raise QconvError(f"cannot name the artifact at {target}", where=target,
                             fix="the URL must end in the artifact folder's name, e.g. https://host/models/NAME/")
        return seg
    if target.startswith("file://") or Path(target).expanduser().is_dir():
        return Path(target.removeprefix("file://")).expanduser().resolve().name
    if NAME_RE.match(target) or HF_ID_RE.match(target):
        return target
    raise QconvError(f"{target!r} is not an artifact name, Hugging Face id (org/name), URL or folder",
                     fix="see `qconv list --remote` for available names")


def resolve_target(target: str, revision: str | None = None, index: str | None = None) -> PullSource:
    name = target_name(target)
    if _is_url(target) or target.startswith("file://") or Path(target).expanduser().is_dir():
        if revision:
            raise QconvError("--revision applies to Hugging Face repos only", where=target)
        loc = Location("url", target.rstrip("/")) if _is_url(target) else \
            Location("path", str(Path(target.removeprefix("file://")).expanduser().resolve()))
        return PullSource(name, loc)
    entry = load_index(index).get(target)
    if entry:
        loc = entry.location
        if revision:
            if loc.kind != "hf":
                raise QconvError("--revision applies to Hugging Face repos only", where=f"{target}: {loc.describe()}")
            loc = Location("hf", loc.uri, revision)
        return PullSource(name, loc, entry)
    if HF_ID_RE.match(target):
        return PullSource(name, Location("hf", target, revision))
    raise QconvError(f"unknown artifact {target!r}: not in the index and not a Hugging Face id",
                     fix="see `qconv list --remote`, pass --index URL_OR_PATH, or pull ORG/NAME, a URL or a folder")


def fetcher(loc: Location, staging: Path, *, progress: bool, retries: int) -> Callable[[Want], Fetch]:
    """For each wanted file, a function that fills a `.part` path from the location."""
    if loc.kind == "url":
        return lambda w: lambda part, _refetch: http_fetch(join_url(loc.uri, w.name), part, w.size or None,
                                                           retries=retries, progress=progress)
    if loc.kind == "path":
        return lambda w: lambda part, _refetch: local_fetch(Path(loc.uri) / w.name, part)
    return lambda w: lambda part, refetch: hf_fetch(loc.uri, loc.revision, w.name, staging, part, force=refetch)


def _expected_files(src: PullSource, manifest: Manifest) -> dict[str, Want]:
    want = {n: Want(n, f["sha256"], f["size"]) for n, f in manifest.files.items()}
    for n in want:
        check_file_name(n, f"{src.name}: {MANIFEST}")
    if src.entry:
        listed = {n: (f.sha256, f.size) for n, f in src.entry.files.items() if n != MANIFEST}
        if listed != {n: (w.sha256, w.size) for n, w in want.items()}:
            diff = sorted(set(listed.items()) ^ {(n, (w.sha256, w.size)) for n, w in want.items()})
            raise IntegrityError(f"the index and the artifact's {MANIFEST} disagree on files: {diff[:4]}",
                                 where=src.location.describe(), fix="the index is stale or the artifact was replaced")
    return want


def _fetch_manifest(src: PullSource, staging: Path, fetch_for: Callable[[Want], Fetch]) -> Manifest:
    dest = staging / MANIFEST
    listed = src.entry.files.get(MANIFEST) if src.entry else None
    if listed:
        fetch_verified(fetch_for(Want(MANIFEST, listed.sha256, listed.size)), dest, Want(MANIFEST, listed.sha256,
                                                                                         listed.size))
    else:  # no trusted hash: always take the current one
        part = dest.with_name(MANIFEST + ".part")
        part.unlink(missing_ok=True)
        fetch_for(Want(MANIFEST, "", 0))(part, False)
        os.replace(part, dest)
    return read_manifest(staging)


def pull(target: str, *, revision: str | None = None, offline: bool = False, index: str | None = None,
         progress: bool = True, retries: int = 3) -> Path:
    """Pull `target` into the cache and return the local artifact folder."""
    if offline:
        name = target_name(target)
        if hit := cache.cached(name):
            return hit
        raise QconvError(f"{name!r} is not in the cache and --offline forbids downloading",
                         where=str(cache.artifacts_root()), fix=f"run `qconv pull {target}` with network access first")
    src = resolve_target(target, revision, index)
    if src.entry:
        for n in src.entry.files:
            check_file_name(n, f"index entry {src.name}")
    with cache.artifact_lock(src.name):
        staging = cache.incoming_dir(src.name)
        staging.mkdir(parents=True, exist_ok=True)
        fetch_for = fetcher(src.location, staging, progress=progress, retries=retries)
        manifest = _fetch_manifest(src, staging, fetch_for)
        want = _expected_files(src, manifest)
        final = cache.artifact_dir(src.name)
        manifest_sha = sha256_file(staging / MANIFEST)
        if cache.cached(src.name) and sha256_file(final / MANIFEST) == manifest_sha:
            log.info("%s is already in the cache and up to date", src.name)
            shutil.rmtree(staging, ignore_errors=True)
            return final
        log.info("pulling %s from %s (%d files, %.1f MB)", src.name, src.location.describe(), len(want),
                 manifest.total_size() / 1e6)
        for w in want.values():
            fetch_verified(fetch_for(w), staging / w.name, w)
        with atomic_dir(final, force=True) as tmp:  # all-or-nothing: the folder appears complete and verified
            for n in [*want, MANIFEST]:
                (tmp / n).parent.mkdir(parents=True, exist_ok=True)
                os.replace(staging / n, tmp / n)
        shutil.rmtree(staging, ignore_errors=True)
        cache.write_meta(src.name, {"location": src.location.describe(), "revision": src.location.revision,
                                    "manifest_sha256": manifest_sha, "recipe": manifest.recipe.name})
    return final
