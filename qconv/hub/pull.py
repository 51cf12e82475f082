"""`qconv pull`: fetch a prebuilt artifact into the cache; it becomes visible only once every file verifies.

Targets: an index name, a Hugging Face id (`org/name`), an https URL of an artifact folder, or a local folder /
file:// URL. Trust flows from the index (it lists the sha256 of qconv.json and of every file) and, for the Hub, from
the Hub's own file metadata (LFS sha256, git blob ids) at the commit the revision resolved to. A URL or folder with
no index entry has only its own qconv.json to go by: the pull says so, once, loudly.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from qconv.disk import check_space, is_disk_error, os_error
from qconv.errors import QconvError
from qconv.fsutil import refuse_links, refuse_shared, sha256_file
from qconv.hub import cache, hf
from qconv.hub.download import (
    LINK_FIX,
    MANIFEST_CAP,
    IntegrityError,
    Want,
    check_file_name,
    check_scheme,
    fetch_verified,
    http_fetch,
    join_url,
    local_fetch,
)
from qconv.hub.index import (
    HF_ID_RE,
    NAME_RE,
    IndexEntry,
    Location,
    load_index,
    parse_location,
)
from qconv.manifest import MANIFEST, Manifest, read_manifest

log = logging.getLogger(__name__)

Fetch = Callable[[Path, bool], None]


@dataclass
class PullSource:
    name: str  # what `qconv list` shows
    location: Location
    entry: IndexEntry | None = None


def _is_url(s: str) -> bool:
    return s.startswith(("http://", "https://"))


def _is_folder(s: str) -> bool:
    return s.startswith("file://") or Path(s).expanduser().is_dir()


def _index_names(target: str, index: str | None, insecure: bool) -> bool:
    """Whether `target`, a folder here, is also a name the index lists: then the index entry wins (its hashes are
    the trust root; a folder of that name in the working directory would silently replace them). `./NAME` or a path
    with a slash always means the folder."""
    if not NAME_RE.match(target) or target.startswith(".") or target != Path(target).name:
        return False
    try:
        entry = load_index(index, insecure=insecure).get(target)
    except QconvError:
        if index:
            raise
        return False  # the default index cannot be read: the folder is what the user named
    if entry:
        log.warning(
            "%s is both a folder here and an index entry: pulling the index entry (pull ./%s for the folder)",
            target,
            target,
        )
    return entry is not None


def resolve_target(
    target: str, revision: str | None = None, index: str | None = None, insecure: bool = False
) -> PullSource:
    if _is_url(target) or (_is_folder(target) and not _index_names(target, index, insecure)):
        if revision:
            raise QconvError("--revision applies to Hugging Face repos only", where=target)
        loc = parse_location(target)
        if loc.kind == "url":
            check_scheme(loc.uri, insecure)
        return PullSource(loc.uri.rsplit("/", 1)[-1], loc)
    entry = load_index(index, insecure=insecure).get(target) if NAME_RE.match(target) else None
    if entry:
        loc = entry.location
        if revision:
            if loc.kind != "hf":
                raise QconvError("--revision applies to Hugging Face repos only", where=f"{target}: {loc.describe()}")
            loc = Location("hf", loc.uri, revision)
        if loc.kind == "url":
            check_scheme(loc.uri, insecure)
        return PullSource(target, loc, entry)
    if HF_ID_RE.match(target):
        return PullSource(target, Location("hf", target, revision))
    raise QconvError(
        f"unknown artifact {target!r}: not in the index and not a Hugging Face id (org/name)",
        fix="see `qconv list --remote`, pass --index URL_OR_PATH, or pull ORG/NAME, a URL or a folder",
    )


def fetcher(loc: Location, *, progress: bool, retries: int, insecure: bool) -> Callable[[Want], Fetch]:
    """For each wanted file of a url/path location, a function that fills a `.part` path."""
    if loc.kind == "url":
        return lambda w: (
            lambda part, _refetch: http_fetch(
                join_url(loc.uri, w.name),
                part,
                w.size if w.sha256 else None,
                cap=None if w.sha256 else MANIFEST_CAP,
                insecure=insecure,
                retries=retries,
                progress=progress,
            )
        )
    return lambda w: (
        lambda part, _refetch: local_fetch(
            Path(loc.uri), w.name, part, size=w.size if w.sha256 else None, cap=None if w.sha256 else MANIFEST_CAP
        )
    )


def expected_files(src: PullSource, manifest: Manifest) -> dict[str, Want]:
    want = {n: Want(n, f.sha256, f.size) for n, f in manifest.files.items()}
    for n in want:
        check_file_name(n, f"{src.name}: {MANIFEST}")
    if src.entry:
        listed = {n: (f.sha256, f.size) for n, f in src.entry.files.items() if n != MANIFEST}
        if listed != {n: (w.sha256, w.size) for n, w in want.items()}:
            diff = sorted(set(listed.items()) ^ {(n, (w.sha256, w.size)) for n, w in want.items()})
            raise IntegrityError(
                f"the index and the artifact's {MANIFEST} disagree on files: {diff[:4]}",
                where=src.location.describe(),
                fix="the index is stale or the artifact was replaced",
            )
    return want


def _listed_manifest(src: PullSource) -> Want | None:
    listed = src.entry.files.get(MANIFEST) if src.entry else None
    return Want(MANIFEST, listed.sha256, listed.size) if listed else None


def _fetch_manifest(src: PullSource, staging: Path, fetch_for: Callable[[Want], Fetch]) -> Manifest:
    dest = staging / MANIFEST
    if listed := _listed_manifest(src):
        fetch_verified(fetch_for(listed), dest, listed)
    else:  # no trusted hash: always take the current one, capped in size
        part = dest.with_name(MANIFEST + ".part")
        part.unlink(missing_ok=True)
        fetch_for(Want(MANIFEST, "", 0))(part, False)
        os.replace(part, dest)
    try:
        return read_manifest(staging)
    except QconvError:
        dest.unlink()  # refused: nothing of it stays in the cache
        raise


def _warn_untrusted(src: PullSource) -> None:
    log.warning(
        "WARNING: %s has no trusted hash: no index entry and no Hub metadata vouch for %s. Its files match "
        "its own %s, which whoever serves it could have written. Pull it through an index (`qconv index "
        "add` writes one) or from the Hub to have it checked.",
        src.name,
        src.location.describe(),
        MANIFEST,
    )


def _space_needed(want: dict[str, Want], have: Callable[[str], int]) -> int:
    return sum(max(w.size - have(w.name), 0) for w in want.values())


def _partial_size(staging: Path) -> Callable[[str], int]:
    def have(name: str) -> int:
        for p in (staging / name, staging / f"{name}.part"):
            if p.is_file():
                return p.stat().st_size
        return 0

    return have


def _pull_files(src: PullSource, *, progress: bool, retries: int, insecure: bool) -> Path:
    loc = src.location
    staging = cache.incoming_dir(loc)
    staging.mkdir(parents=True, exist_ok=True)  # cache.check_slot refused a link in its place
    refuse_links(staging, "the download folder is damaged", LINK_FIX)
    for p in staging.rglob("*"):
        if not p.is_dir():
            refuse_shared(p, "the download folder is damaged", LINK_FIX)
    fetch_for = fetcher(loc, progress=progress, retries=retries, insecure=insecure)
    try:
        return _fill_from_staging(src, staging, fetch_for)
    except QconvError:
        (staging / MANIFEST).unlink(missing_ok=True)  # refused: its qconv.json stays nowhere (the data .parts resume)
        raise


def _fill_from_staging(src: PullSource, staging: Path, fetch_for: Callable[[Want], Fetch]) -> Path:
    loc = src.location
    manifest = _fetch_manifest(src, staging, fetch_for)
    want = expected_files(src, manifest)
    manifest_sha = sha256_file(staging / MANIFEST)
    rev = f"m-{manifest_sha[:16]}"
    if not src.entry:
        _warn_untrusted(src)
    info = {"name": src.name, "manifest_sha256": manifest_sha, "recipe": manifest.recipe.name}
    if cache.have_revision(loc, rev):
        log.info("%s is already in the cache and up to date", src.name)
        shutil.rmtree(staging, ignore_errors=True)
        return cache.install(loc, rev, lambda tmp: None, info)
    check_space(staging, _space_needed(want, _partial_size(staging)), f"pulling {src.name}")
    log.info("pulling %s from %s (%d files, %.1f MB)", src.name, loc.describe(), len(want), manifest.total_size() / 1e6)
    for w in want.values():
        fetch_verified(fetch_for(w), staging / w.name, w)

    def fill(tmp: Path) -> None:
        for n in [*want, MANIFEST]:
            (tmp / n).parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging / n, tmp / n)

    final = cache.install(loc, rev, fill, info)
    shutil.rmtree(staging, ignore_errors=True)
    return final


def _pull_hub(src: PullSource, *, progress: bool) -> Path:
    loc = src.location
    where = f"{loc.uri}@{loc.revision or 'main'}"
    commit, hub = hf.resolve(loc.uri, loc.revision)
    where = f"{where} (commit {commit})"
    if cache.have_revision(loc, commit):
        log.info("%s is already in the cache at commit %s", src.name, commit)
        return cache.install(loc, commit, lambda tmp: None, {"name": src.name, "requested": loc.revision})
    if MANIFEST not in hub:
        raise QconvError(
            f"Hugging Face repo {loc.uri} has no {MANIFEST} at commit {commit}",
            where=where,
            fix="it is not a qconv artifact; build one from it with `qconv build --model ORG/NAME`",
        )
    h = hub[MANIFEST]
    listed = _listed_manifest(src)
    mwant = Want(MANIFEST, listed.sha256 if listed else (h.lfs_sha256 or ""), h.size or 0)
    snap = hf.fetch_checked(loc.uri, commit, {MANIFEST: mwant}, hub, where, progress=progress)
    manifest = read_manifest(snap)
    want = expected_files(src, manifest)
    hf.check_metadata(want, hub, where)
    check_space(cache.hf_cache_dir(), _space_needed(want, lambda n: 0), f"pulling {src.name}")
    log.info("pulling %s from %s (%d files, %.1f MB)", src.name, where, len(want), manifest.total_size() / 1e6)
    snap = hf.fetch_checked(loc.uri, commit, want, hub, where, progress=progress)
    final = cache.install(
        loc,
        commit,
        lambda tmp: hf.link_into(snap, [*want, MANIFEST], tmp),
        {
            "name": src.name,
            "requested": loc.revision,
            "manifest_sha256": sha256_file(snap / MANIFEST),
            "recipe": manifest.recipe.name,
        },
    )
    hf.drop_download_cache(loc.uri)
    return final


def _offline(target: str) -> Path:
    try:
        return cache.resolve_artifact(target)
    except QconvError as e:
        raise QconvError(
            f"{target!r} is not in the cache and --offline forbids downloading",
            where=str(cache.artifacts_root()),
            fix=f"run `qconv pull {target}` with network access first",
        ) from e


def pull(
    target: str,
    *,
    revision: str | None = None,
    offline: bool = False,
    index: str | None = None,
    progress: bool = True,
    retries: int = 3,
    insecure: bool = False,
) -> Path:
    """Pull `target` into the cache and return its verified revision folder."""
    if offline:
        return _offline(target)
    src = resolve_target(target, revision, index, insecure)
    if src.entry:
        for n in src.entry.files:
            check_file_name(n, f"index entry {src.name}")
    cache.check_slot(src.location)
    try:
        with cache.artifact_lock(src.location):
            cache.sweep(src.location, src.name)
            if src.location.kind == "hf":
                final = _pull_hub(src, progress=progress)
            else:
                final = _pull_files(src, progress=progress, retries=retries, insecure=insecure)
            if src.entry:
                cache.record_name(src.name, src.location)
    except OSError as e:
        if not is_disk_error(e):
            raise
        raise os_error(
            e,
            f"pulling {src.name}",
            cache.artifacts_root(),
            retry_hint="run `qconv pull` again: finished files are kept",
        ) from e
    return final
