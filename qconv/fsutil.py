"""Hashing and all-or-nothing writes: nothing half-written is ever left under a user's path."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from qconv.errors import QconvError

CHUNK = 1 << 20


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_json(obj) -> str:
    """Hash of a JSON-able object in canonical form (sorted keys, no spaces)."""
    return sha256_bytes(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode())


def file_table(root: str | os.PathLike, exclude: tuple[str, ...] = ()) -> dict[str, dict]:
    """{relative posix path: {sha256, size}} for every regular file below root, sorted."""
    root = Path(root)
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            rel = p.relative_to(root).as_posix()
            if rel in exclude:
                continue
            out[rel] = {"sha256": sha256_file(p), "size": p.stat().st_size}
    return out


def umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def normal_modes(root: str | os.PathLike) -> None:
    """Give every file below root the mode plain open() would (0644 under umask 022; exec bits kept). mkstemp and
    safetensors' writer make 0600 files, which another user or a container could not read."""
    mask = umask()
    for p in [Path(root), *Path(root).rglob("*")]:
        if p.is_symlink():
            continue
        mode = p.stat().st_mode
        full = 0o777 if p.is_dir() or mode & 0o111 else 0o666
        if mode & 0o777 != full & ~mask:
            p.chmod(full & ~mask)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~umask())
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike, *, force: bool = False) -> Iterator[Path]:
    """Yield a temp dir beside `final`; on success it replaces `final`, on any error it is removed."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.", suffix=".partial"))
    try:
        yield tmp
        normal_modes(tmp)
        if final.exists():
            if not force:
                raise FileExistsError(final)
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def switch_symlink(link: str | os.PathLike, target: str) -> None:
    """Point `link` at `target` atomically (a new symlink renamed over the old one): readers see old or new, never none."""
    link = Path(link)
    tmp = link.with_name(f".{link.name}.tmp-{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    os.symlink(target, tmp)
    os.replace(tmp, link)


def sweep_stale(parent: str | os.PathLike, name: str) -> list[Path]:
    """Remove the crash leftovers of atomic_dir(parent/name): `.name.*.partial` and `.name.old-PID`.

    Call it only while holding the lock every writer of parent/name holds: then no other process owns them.
    """
    parent = Path(parent)
    gone = [p for pattern in (f".{name}.*.partial", f".{name}.old-*") for p in parent.glob(pattern)]
    for p in gone:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
    return gone


DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS)


def is_disk_error(e: OSError) -> bool:
    """A local filesystem failure (full, not writable), as opposed to a network one that a retry may cure."""
    return e.errno in DISK_ERRNOS and not isinstance(e, ConnectionError)


def os_error(e: OSError, action: str, where: str | os.PathLike, *, needed: int | None = None,
             retry_hint: str | None = None):
    """One QconvError for a local filesystem failure (disk full, permission denied, read-only, other).

    `needed` (bytes) is stated for a full disk; `retry_hint` is added only where rerunning really helps.
    """
    where = str(where)
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        free = _free_bytes(where)
        need = f"; it needs {needed / 1e6:.1f} MB" if needed is not None else ""
        return QconvError(f"{action} failed: no space left on the device{need}, {free / 1e6:.1f} MB free",
                          where=where, fix="free space there or point QCONV_HOME at a bigger disk"
                                           + (f", then {retry_hint}" if retry_hint else ""))
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return QconvError(f"{action} failed: {e.strerror}", where=getattr(e, "filename", None) or where,
                          fix="make that folder writable or point QCONV_HOME at one that is")
    return QconvError(f"{action} failed: {e}", where=where, fix=retry_hint)


def _free_bytes(path: str) -> int:
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return 0


def check_free_space(path: str | os.PathLike, needed: int, what: str) -> None:
    """Refuse before writing `needed` bytes under `path` when the disk cannot hold them."""
    free = _free_bytes(str(path))
    if needed > free:
        raise QconvError(f"{what} needs {needed / 1e6:.1f} MB but only {free / 1e6:.1f} MB are free",
                         where=str(path), fix="free space there or point QCONV_HOME at a bigger disk")
