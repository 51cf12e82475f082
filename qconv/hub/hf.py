"""Hugging Face Hub pulls through huggingface_hub: pinned to the commit a revision resolved to, and every file checked
against the Hub's own metadata (the LFS sha256 of each LFS object, the git blob id of every other file).

HF_ENDPOINT (mirrors) and HF_TOKEN are read on each call, so setting them after import counts too. huggingface_hub
resumes a cut connection with a Range request and keeps completed files in its cache (QCONV_HOME/artifacts/.hf)
across a killed pull; a file cut by a killed process restarts (1.x writes it under a per-process temp name).
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from qconv.disk import is_disk_error
from qconv.errors import QconvError
from qconv.fsutil import CHUNK, sha256_file
from qconv.hub.cache import hf_cache_dir
from qconv.hub.download import IntegrityError, Want

COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


@dataclass
class HubFile:
    name: str
    size: int | None
    blob_id: str | None  # git sha1 of the blob (for an LFS file: of its pointer)
    lfs_sha256: str | None  # sha256 of the content, LFS files only


def endpoint() -> str | None:
    return os.environ.get("HF_ENDPOINT") or None


def git_blob_sha1(path: Path) -> str:
    h = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _hub_error(e: Exception, repo: str, rev: str | None) -> QconvError:
    from huggingface_hub.errors import (
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo}@{rev or 'main'} on {endpoint() or 'huggingface.co'}"
    if isinstance(e, RevisionNotFoundError):
        return QconvError(f"no revision {rev!r} in Hugging Face repo {repo}", where=where, fix="check --revision")
    if isinstance(e, (RepositoryNotFoundError, GatedRepoError)):
        return QconvError(
            f"Hugging Face repo {repo} not found or not accessible",
            where=where,
            fix="check the repo id; for a private or gated repo set HF_TOKEN (or `hf auth login`)",
        )
    return QconvError(
        f"cannot download from Hugging Face repo {repo}: {e}",
        where=where,
        fix="check the network, HF_ENDPOINT and HF_TOKEN, then run `qconv pull` again: completed files are kept",
    )


def resolve(repo: str, revision: str | None) -> tuple[str, dict[str, HubFile]]:
    """(commit sha the revision points at now, the Hub's metadata of every file at that commit)."""
    from huggingface_hub import HfApi

    try:
        info = HfApi(endpoint=endpoint()).model_info(repo, revision=revision, files_metadata=True)
    except Exception as e:
        raise _hub_error(e, repo, revision) from e
    if not COMMIT_RE.match(info.sha or ""):
        raise QconvError(
            f"the Hub answered revision {revision or 'main'} with no commit sha ({info.sha!r})",
            where=repo,
            fix="HF_ENDPOINT does not point at a Hub-compatible server",
        )
    return info.sha, {
        s.rfilename: HubFile(s.rfilename, s.size, s.blob_id, s.lfs.sha256 if s.lfs else None)
        for s in info.siblings or []
    }


def _quiet_tqdm():
    from tqdm.auto import tqdm

    class Quiet(tqdm):
        def __init__(self, *a, **kw):
            super().__init__(*a, **{**kw, "disable": True})

    return Quiet


def download(repo: str, commit: str, names: list[str], *, force: bool = False, progress: bool = True) -> Path:
    """snapshot_download of exactly `names` at `commit` into our Hub cache; returns the snapshot folder."""
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                repo,
                revision=commit,
                cache_dir=hf_cache_dir(),
                endpoint=endpoint(),
                allow_patterns=[glob.escape(n) for n in names],
                force_download=force,
                tqdm_class=None if progress else _quiet_tqdm(),
            )
        )
    except Exception as e:
        if isinstance(e, OSError) and is_disk_error(e):
            raise
        raise _hub_error(e, repo, commit) from e


def check_metadata(want: dict[str, Want], hub: dict[str, HubFile], where: str) -> None:
    """Before any weight is fetched: every file the manifest lists is on the Hub with the same size and LFS hash."""
    problems = []
    for w in want.values():
        h = hub.get(w.name)
        if h is None:
            problems.append(f"{w.name}: not in the repo at this commit")
        elif h.size is not None and h.size != w.size:
            problems.append(f"{w.name}: the Hub says {h.size} bytes, qconv.json says {w.size}")
        elif h.lfs_sha256 is not None and h.lfs_sha256 != w.sha256:
            problems.append(f"{w.name}: the Hub's LFS sha256 {h.lfs_sha256} != qconv.json's {w.sha256}")
    if problems:
        raise IntegrityError(
            "the Hub's file metadata and qconv.json disagree:\n  " + "\n  ".join(problems),
            where=where,
            fix="the artifact's qconv.json does not describe this commit; do not use it",
        )


def file_problem(path: Path, want: Want, hub: HubFile) -> str | None:
    """Why the downloaded file is not the one the Hub (and qconv.json, when it is known) vouch for, or None."""
    size = path.stat().st_size
    if size != want.size:
        return f"{want.name}: {size} bytes, expected {want.size}"
    if hub.lfs_sha256 is None and hub.blob_id and (got := git_blob_sha1(path)) != hub.blob_id:
        return f"{want.name}: git blob id {got} != the Hub's {hub.blob_id}"
    if want.sha256 and (got := sha256_file(path)) != want.sha256:
        return f"{want.name}: sha256 {got} != expected {want.sha256}"
    return None


def forget(snapshot: Path, names: list[str]) -> None:
    """Drop bad downloads from huggingface_hub's cache (blob and snapshot link) so the next try fetches them anew."""
    for n in names:
        link = snapshot / n
        blob = link.resolve()
        blob.unlink(missing_ok=True)
        link.unlink(missing_ok=True)


def fetch_checked(
    repo: str, commit: str, want: dict[str, Want], hub: dict[str, HubFile], where: str, *, progress: bool = True
) -> Path:
    """Download `want` at `commit`, check each file, re-fetch the bad ones once; IntegrityError if still bad."""
    snap = download(repo, commit, list(want), progress=progress)
    bad = {n: p for n in want if (p := file_problem(snap / n, want[n], hub[n]))}
    if bad:
        forget(snap, list(bad))
        snap = download(repo, commit, list(bad), force=True, progress=progress)
        bad = {n: p for n in bad if (p := file_problem(snap / n, want[n], hub[n]))}
    if bad:
        forget(snap, list(bad))
        raise IntegrityError(
            "downloaded bytes do not match the Hub's own hashes (fetched twice):\n  " + "\n  ".join(bad.values()),
            where=where,
            fix="the server (or HF_ENDPOINT mirror) serves altered files; do not use them",
        )
    return snap


def link_into(snapshot: Path, names: list[str], dest: Path) -> None:
    """Place the checked files in `dest`: hard links to huggingface_hub's blobs (a copy across filesystems)."""
    for n in names:
        src = (snapshot / n).resolve()
        (dest / n).parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(src, dest / n)
        except OSError:
            shutil.copyfile(src, dest / n)


def drop_download_cache(repo: str) -> None:
    """Once the revision folder holds the files (hard links), huggingface_hub's copy and locks are not needed."""
    folder = "models--" + repo.replace("/", "--")
    for d in (hf_cache_dir() / folder, hf_cache_dir() / ".locks" / folder):
        shutil.rmtree(d, ignore_errors=True)
