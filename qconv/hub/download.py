"""Fetching one artifact file: safe names only, resumable HTTP, sha256-verified, one re-fetch on corruption.

Files land as `<name>.part` and are renamed to `<name>` only after their hash matches, so a folder of completed
names is always trustworthy and a killed download resumes from its `.part` with an HTTP Range request.
"""

from __future__ import annotations

import http.client
import logging
import os
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Callable

from qconv.errors import QconvError
from qconv.fsutil import CHUNK, sha256_file

log = logging.getLogger(__name__)

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
READ_CHUNK = 1 << 16


class IntegrityError(QconvError):
    """Downloaded or stored bytes do not match their recorded sha256. Exit code 1, like a failed gate."""

    exit_code = 1


@dataclass
class Want:
    name: str
    sha256: str
    size: int


def check_file_name(name: str, where: str) -> str:
    """Refuse names that could write outside the artifact folder, and pickle weights (they execute code on load)."""
    parts = PurePosixPath(name).parts
    if (not name or "\\" in name or "\0" in name or name.startswith("/") or ":" in name
            or any(p in ("..", ".") for p in parts) or name != PurePosixPath(name).as_posix()):
        raise QconvError(f"refusing file name {name!r}: it escapes the artifact folder", where=where,
                         fix="the artifact or index is malformed or malicious; do not use it")
    if name.lower().endswith(PICKLE_SUFFIXES):
        raise QconvError(f"refusing pickle weights {name!r}", where=where,
                         fix="qconv only loads safetensors; ask the publisher for a safetensors artifact")
    return name


def http_fetch(url: str, part: Path, size: int | None, *, retries: int = 3, backoff: float = 0.2,
               progress: bool = True) -> None:
    """Download `url` into `part`, resuming from its current length with a Range request; retry cut connections."""
    from tqdm.auto import tqdm

    attempt = 0
    while True:
        have = part.stat().st_size if part.exists() else 0
        if size is not None and have > size:
            part.unlink()
            have = 0
        if size is not None and have == size:
            return
        req = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                if have and r.status != 206:  # server ignored the Range: start over
                    have = 0
                expect = int(r.headers.get("Content-Length", -1))
                got = 0
                with open(part, "ab" if have else "wb") as f, tqdm(
                        total=size, initial=have, unit="B", unit_scale=True, desc=part.name[:-5],
                        disable=None if progress else True, leave=False) as bar:
                    while chunk := r.read1(READ_CHUNK):  # whatever has arrived, so a kill loses little
                        f.write(chunk)
                        f.flush()
                        got += len(chunk)
                        bar.update(len(chunk))
                if 0 <= expect != got:
                    raise http.client.IncompleteRead(b"", expect - got)
                return
        except urllib.error.HTTPError as e:
            if e.code == 416 and have:  # our .part is stale (longer than the file): start over
                part.unlink()
                continue
            raise QconvError(f"download failed: HTTP {e.code} {e.reason}", where=url,
                             fix="check the index location or URL") from e
        except (OSError, http.client.HTTPException) as e:
            attempt += 1
            if attempt > retries:
                raise QconvError(f"download interrupted: {e!r}", where=url,
                                 fix="run `qconv pull` again: it resumes from the partial file") from e
            log.warning("download of %s interrupted (%r); resuming (%d/%d)", url, e, attempt, retries)
            time.sleep(backoff * attempt)


def local_fetch(src: Path, part: Path) -> None:
    if not src.is_file():
        raise QconvError(f"missing file {src.name}", where=str(src), fix="the source folder is incomplete")
    with open(src, "rb") as fi, open(part, "wb") as fo:
        shutil.copyfileobj(fi, fo, CHUNK)


def hf_fetch(repo_id: str, revision: str | None, name: str, staging: Path, part: Path, *, force: bool) -> None:
    """One file of a Hugging Face repo via huggingface_hub (it resumes and caches itself), placed at `part`."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HFValidationError

    try:
        got = hf_hub_download(repo_id, name, revision=revision, local_dir=staging, force_download=force)
    except (OSError, EntryNotFoundError, HFValidationError) as e:  # HTTP and offline errors are OSErrors
        raise QconvError(f"cannot download {name} from Hugging Face repo {repo_id}: {e}",
                         where=f"{repo_id}@{revision or 'main'}",
                         fix="check the repo id, --revision, your network and HF token") from e
    os.replace(got, part)


def fetch_verified(fetch: Callable[[Path, bool], None], dest: Path, want: Want) -> None:
    """fetch(part, refetch) fills `part`; accept it only if its sha256 and size match, re-fetching once if not."""
    if dest.is_file() and dest.stat().st_size == want.size and sha256_file(dest) == want.sha256:
        return  # completed by an earlier, interrupted pull
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    for attempt in (0, 1):
        fetch(part, attempt > 0)
        got = sha256_file(part)
        if got == want.sha256 and part.stat().st_size == want.size:
            os.replace(part, dest)
            return
        part.unlink()
        if attempt == 0:
            log.warning("%s: sha256 %s does not match the expected %s; fetching it again", want.name, got, want.sha256)
    raise IntegrityError(f"{want.name}: downloaded sha256 {got} != expected {want.sha256} (fetched twice)",
                         where=str(dest), fix="the published file is corrupt or was tampered with; do not use it "
                                              "and tell the publisher")


def join_url(base: str, name: str) -> str:
    return base.rstrip("/") + "/" + urllib.parse.quote(name)
