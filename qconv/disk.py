"""Disk failures and the checks made before any work: a full disk or a refused write (an OSError, its causes, or a
library's wrapper of one) becomes one QconvError naming what, where and how much space; free space, writability and
the output folder are checked before a command starts."""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
from pathlib import Path

from qconv.errors import QconvError

_FIX_SPACE = "free space there, or point --out / --work-dir / QCONV_HOME at a larger disk"
_FIX_PERM = "choose a folder you can write to, or fix its permissions"
_DISK_ERRORS = {
    errno.ENOSPC: ("no space left on the device", _FIX_SPACE),
    errno.EDQUOT: ("disk quota exceeded", _FIX_SPACE),
    errno.EACCES: ("permission denied", _FIX_PERM),
    errno.EPERM: ("operation not permitted", _FIX_PERM),
    errno.EROFS: ("read-only file system", "choose a folder on a writable file system"),
}
# Libraries that wrap the OS error in their own type (safetensors: "... (os error 28)") keep only its text.
_OS_TEXT = [
    (re.compile(r"os error (\d+)"), None),
    (re.compile("No space left on device"), errno.ENOSPC),
    (re.compile("Disk quota exceeded"), errno.EDQUOT),
    (re.compile("Permission denied"), errno.EACCES),
    (re.compile("Read-only file system"), errno.EROFS),
]


def _disk_errno(e: BaseException | None) -> tuple[int, str | None] | None:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _DISK_ERRORS:  # filename2: a copy's or rename's destination
            return e.errno, e.filename2 or e.filename
        for rx, code in _OS_TEXT:
            if m := rx.search(str(e)):
                code = code if code is not None else int(m.group(1))
                if code in _DISK_ERRORS:
                    return code, None
        e = e.__cause__ or e.__context__
    return None


def free_bytes(path: str | os.PathLike) -> int:
    """Free bytes on the file system that holds path (or its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def human_bytes(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def disk_error(
    e: BaseException, *, what: str, where: str | os.PathLike, needed: int | None = None
) -> QconvError | None:
    """The QconvError for a disk-full / permission error (e, its causes, or a library's wrapper of one), naming
    what was being written, where, and for a full disk how much space it needed and had; None for any other error.
    The one place OSError turns into the CLI's error type."""
    found = _disk_errno(e)
    if found is None:
        return None
    code, filename = found
    reason, fix = _DISK_ERRORS[code]
    where = str(filename or where)
    msg = f"{what}: {reason}"
    if code in (errno.ENOSPC, errno.EDQUOT):
        msg += f" ({f'needs about {human_bytes(needed)}, ' if needed else ''}{human_bytes(free_bytes(where))} free)"
    return QconvError(msg, where=where, fix=fix)


def check_space(folder: str | os.PathLike, needed: int, what: str) -> None:
    """Refuse before any work when the disk holding folder has less than `needed` bytes free."""
    free = free_bytes(folder)
    if needed > free:
        raise QconvError(
            f"{what}: not enough disk space (needs about {human_bytes(needed)}, {human_bytes(free)} free)",
            where=str(folder),
            fix=_FIX_SPACE,
        )


def check_writable(folder: str | os.PathLike, what: str) -> None:
    """Refuse before any work when folder (created if missing) cannot be written: a temp folder made and removed."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        Path(tempfile.mkdtemp(dir=folder, prefix=f".qconv-probe.{os.getpid()}.", suffix=".partial")).rmdir()
    except OSError as e:
        raise (
            disk_error(e, what=what, where=folder)
            or QconvError(
                f"{what}: {e.strerror or e}", where=str(folder), fix="pass a folder on a disk you can write to"
            )
        ) from e


# kernel file systems: nothing written there is a file (`-o /proc/x` failed with a FileNotFoundError traceback)
PSEUDO_FS = {"proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "bpf"}


def _fs_type(path: Path) -> str | None:
    """The type of the file system `path` lives on (the longest mount point above it in /proc/self/mounts)."""
    best, kind = "", None
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if len(parts) > 2:
            mount = parts[1].replace("\\040", " ")
            if (mount == "/" or _inside(path, Path(mount))) and len(mount) >= len(best):
                best, kind = mount, parts[2]
    return kind


def check_out_place(out: Path, raw: Path, flag: str) -> None:
    """A folder can be made at `out`: its nearest existing ancestor is a folder on a real file system."""
    anc = next(p for p in (out, *out.parents) if p.exists())
    if not anc.is_dir():
        raise QconvError(
            f"{flag} {raw} cannot be made: {anc} is a file, not a folder",
            where=flag,
            fix=f"pass a folder as {flag} that is not inside a file",
        )
    if (kind := _fs_type(anc)) in PSEUDO_FS:
        raise QconvError(
            f"{flag} {raw} is on the kernel's {kind} file system, which holds no files",
            where=flag,
            fix=f"pass a folder on a disk as {flag}",
        )


def _inside(a: Path, b: Path) -> bool:
    return a == b or b in a.parents


def check_out_folder(
    out: str | os.PathLike,
    *,
    force: bool,
    marker: str,
    protected: dict[str, str | os.PathLike | None],
    flag: str = "--out",
) -> Path:
    """The resolved output folder, refused before any work when writing it could destroy something: equal to,
    inside or containing a protected path (the source, the work dir, caches), the root, a file, or an existing
    folder that --force would replace although it is neither empty nor holds `marker` (a folder we wrote)."""
    raw = Path(out).expanduser()
    out = raw.resolve()
    if not out.name:
        raise QconvError(f"{flag} {raw} is the file system root", where=flag, fix=f"pass a new folder as {flag}")
    check_out_place(out, raw, flag)
    for label, p in protected.items():
        if p is None:
            continue
        p = Path(p).expanduser().resolve()
        if _inside(out, p) or _inside(p, out):
            rel = "is" if out == p else ("is inside" if _inside(out, p) else "contains")
            raise QconvError(
                f"{flag} {raw} {rel} the {label} ({p}): writing there could destroy it",
                where=flag,
                fix=f"pass a separate folder as {flag}",
            )
    if out.exists():
        if not out.is_dir():
            raise QconvError(f"{flag} {raw} exists and is not a folder", where=flag, fix=f"pass a folder as {flag}")
        if not force:
            raise QconvError(
                f"output folder already exists: {raw}",
                where=flag,
                fix=f"pass --force to replace it, or choose another {flag}",
            )
        if any(out.iterdir()) and not (out / marker).is_file():
            raise QconvError(
                f"--force would replace {raw}, which is not empty and holds no {marker} (not a folder qconv wrote)",
                where=flag,
                fix=f"choose another {flag}, or empty that folder yourself",
            )
    return out


def is_disk_error(e: BaseException) -> bool:
    """A local filesystem failure (full, not writable), as opposed to a network one that a retry may cure."""
    return not isinstance(e, ConnectionError) and _disk_errno(e) is not None


def os_error(
    e: OSError, action: str, where: str | os.PathLike, *, needed: int | None = None, retry_hint: str | None = None
) -> QconvError:
    """disk_error for a filesystem failure; any other OSError becomes a plain QconvError, with `retry_hint` only
    where rerunning really helps."""
    return disk_error(e, what=f"{action} failed", where=where, needed=needed) or QconvError(
        f"{action} failed: {e}", where=str(where), fix=retry_hint
    )
