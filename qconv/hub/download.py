"""Fetching one artifact file: safe names only, resumable HTTP, sha256-verified, one re-fetch on corruption.

Files land as `<name>.part` and are renamed to `<name>` only after their hash matches, so a folder of completed
names is always trustworthy and a killed download resumes from its `.part` with an HTTP Range request.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import os
import re
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from qconv.disk import is_disk_error, os_error
from qconv.errors import QconvError
from qconv.fsutil import CHUNK, open_nofollow, sha256_file

log = logging.getLogger(__name__)

LINK_FIX = (
    "remove the link (not the file it points to) and pull again; a link there is damage, or was planted by "
    "someone who can write to the cache"
)
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
    if (
        not name
        or "\\" in name
        or "\0" in name
        or name.startswith("/")
        or ":" in name
        or any(p in ("..", ".") for p in parts)
        or name != PurePosixPath(name).as_posix()
    ):
        raise QconvError(
            f"refusing file name {name!r}: it escapes the artifact folder",
            where=where,
            fix="the artifact or index is malformed or malicious; do not use it",
        )
    if name.lower().endswith(PICKLE_SUFFIXES):
        raise QconvError(
            f"refusing pickle weights {name!r}",
            where=where,
            fix="qconv only loads safetensors; ask the publisher for a safetensors artifact",
        )
    return name


MANIFEST_CAP = 8 << 20  # an unhashed qconv.json larger than this is refused, not read whole


def check_scheme(url: str, insecure: bool, remote: bool = False) -> str:
    """Plain http:// lets anyone on the path swap bytes and the hashes that vouch for them: opt in explicitly.
    `remote`: `url` is fetched over the network, so https:// (or http:// opted in) is all it may be: urllib would
    also open file:// (through links) and ftp:// (plain text) URLs, or follow a redirect to one."""
    if remote and not url.startswith(("https://", "http://")):
        raise QconvError(
            f"refusing URL {url[:120]}: artifacts are fetched over https:// only",
            where=url[:200],
            fix="serve the artifact over https://, or pull a local folder by its path",
        )
    if url.startswith("http://") and not insecure:
        raise QconvError(
            f"refusing plain http:// URL {url}",
            where=url,
            fix="use https://, or pass --insecure if this network is trusted (e.g. a local mirror)",
        )
    return url


def _content_range(r) -> tuple[int, int | None]:
    """(first byte of the body, total size or None) of a response: 0 for a 200, Content-Range's start for a 206."""
    if r.status != 206:
        return 0, None
    m = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", (r.headers.get("Content-Range") or "").strip())
    if not m:
        raise http.client.HTTPException(f"206 without a usable Content-Range: {r.headers.get('Content-Range')!r}")
    return int(m[1]), None if m[3] == "*" else int(m[3])


def _end(size: int | None, start: int, content_length: int) -> int | None:
    """Where the body must end: the declared size, and never past what the response says it carries."""
    ends = [x for x in (size, start + content_length if content_length >= 0 else None) if x is not None]
    return min(ends) if ends else None


def http_fetch(
    url: str,
    part: Path,
    size: int | None,
    *,
    cap: int | None = None,
    insecure: bool = False,
    retries: int = 3,
    backoff: float = 0.2,
    progress: bool = True,
) -> None:
    """Download `url` into `part`, resuming from its current length with a Range request; retry cut connections.

    Writes never pass the declared `size` (or `cap` when the size is unknown) nor the response's Content-Length; a
    206 is placed where its Content-Range says. Local write failures (disk full, permission) are not retried.
    """
    from tqdm.auto import tqdm

    check_scheme(url, insecure, remote=True)
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
                check_scheme(r.geturl(), insecure, remote=True)  # a redirect must not downgrade to http (or ftp)
                start, total = _content_range(r)
                if start > have or (total is not None and size is not None and total != size):
                    part.unlink(missing_ok=True)  # a gap, or another file than the one declared: start over
                    raise http.client.HTTPException(f"unusable range answer (start {start}, total {total})")
                end = _end(size, start, int(r.headers.get("Content-Length", -1)))
                unhashed_cap = cap if size is None else None
                if unhashed_cap is not None and end is not None and end > unhashed_cap:
                    _too_big(part, url, unhashed_cap)
                stop = end if unhashed_cap is None else min(end or unhashed_cap, unhashed_cap)
                pos = _write_body(
                    r,
                    part,
                    start,
                    stop,
                    tqdm(
                        total=size,
                        initial=start,
                        unit="B",
                        unit_scale=True,
                        desc=part.name[:-5],
                        leave=False,
                        disable=None if progress else True,
                    ),
                )
                if unhashed_cap is not None and pos >= unhashed_cap and r.read1(1):
                    _too_big(part, url, unhashed_cap)
                if end is not None and pos < end:
                    raise http.client.IncompleteRead(b"", end - pos)
                return
        except urllib.error.HTTPError as e:
            if e.code == 416 and have:  # our .part is stale (longer than the file): start over
                part.unlink()
                continue
            raise QconvError(
                f"download failed: HTTP {e.code} {e.reason}", where=url, fix="check the index location or URL"
            ) from e
        except (OSError, http.client.HTTPException) as e:  # network only: local write errors raised QconvError
            if not isinstance(e, (urllib.error.URLError, http.client.HTTPException)) and is_disk_error(e):
                raise os_error(e, f"writing {part.name.removesuffix('.part')}", part.parent) from e  # not a retry
            attempt += 1
            if attempt > retries:
                raise QconvError(
                    f"download interrupted: {e!r}",
                    where=url,
                    fix="run `qconv pull` again: it resumes from the partial file",
                ) from e
            log.warning("download of %s interrupted (%r); resuming (%d/%d)", url, e, attempt, retries)
            time.sleep(backoff * attempt)


def _too_big(part: Path, url: str, cap: int):
    part.unlink(missing_ok=True)
    raise QconvError(
        f"refusing a {part.name.removesuffix('.part')} larger than {cap / 1e6:.0f} MB that no trusted hash vouches for",
        where=url,
        fix="this location does not serve a qconv artifact",
    )


def _write_body(r, part: Path, start: int, stop: int | None, bar) -> int:
    """Copy the response body into `part` from offset `start` up to `stop`; returns the end offset.

    Socket errors propagate as they are (the caller retries them); file errors become one QconvError.
    """
    pos = start
    with _local(part, stop and stop - start):
        f = os.fdopen(open_nofollow(part, os.O_RDWR | os.O_CREAT, "pulling", LINK_FIX), "r+b")
        f.seek(start)
        f.truncate()
    with f, bar:
        while stop is None or pos < stop:
            chunk = r.read1(READ_CHUNK if stop is None else min(READ_CHUNK, stop - pos))  # a kill loses little
            if not chunk:
                break
            with _local(part, stop and stop - pos):
                f.write(chunk)
                f.flush()
            pos += len(chunk)
            bar.update(len(chunk))
        with _local(part, None):
            os.fsync(f.fileno())
    return pos


@contextlib.contextmanager
def _local(part: Path, needed: int | None):
    """File operations on `part`: an OSError here is the disk's, not the network's."""
    try:
        yield
    except OSError as e:
        if isinstance(e, (ConnectionError, TimeoutError)):
            raise
        raise os_error(
            e,
            f"writing {part.name.removesuffix('.part')}",
            part.parent,
            needed=needed or None,
            retry_hint="run `qconv pull` again: the finished part of the file is kept",
        ) from e


def local_fetch(root: Path, name: str, part: Path, *, size: int | None = None, cap: int | None = None) -> None:
    """Copy `root/name` into `part`: a regular file inside the folder (no link anywhere on its way), never linked.
    Its size is checked before a byte is copied: `size` the one listed, `cap` the most an unhashed file may hold."""
    src = root / name
    for p in [src, *src.relative_to(root).parents][:-1]:
        if (root / p).is_symlink():
            raise QconvError(
                f"refusing {name}: {root / p} is a symbolic link; an artifact's files are regular files inside it",
                where=str(root),
                fix="copy the real files into the artifact folder",
            )
    if not src.is_file():
        raise QconvError(f"missing file {name}", where=str(src), fix="the source folder is incomplete")
    have = src.stat().st_size
    if cap is not None and have > cap:
        raise QconvError(
            f"refusing a {name} of {have / 1e6:.0f} MB (more than {cap / 1e6:.0f} MB) that no trusted hash vouches for",
            where=str(src),
            fix="this folder does not hold a qconv artifact",
        )
    if size is not None and have != size:
        raise IntegrityError(
            f"{name}: {have} bytes, but {size} are listed",
            where=str(src),
            fix="the folder's files do not match its index entry or qconv.json; rebuild or re-copy it",
        )
    fd = open_nofollow(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "pulling", LINK_FIX)
    with open(src, "rb") as fi, os.fdopen(fd, "wb") as fo:
        shutil.copyfileobj(fi, fo, CHUNK)


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
    raise IntegrityError(
        f"{want.name}: downloaded sha256 {got} != expected {want.sha256} (fetched twice)",
        where=str(dest),
        fix="the published file is corrupt or was tampered with; do not use it and tell the publisher",
    )


def join_url(base: str, name: str) -> str:
    return base.rstrip("/") + "/" + urllib.parse.quote(name)
