"""Hashing and all-or-nothing writes: nothing half-written is ever left under a user's path.

Temp folders are named `.NAME.PID.RAND.partial` and flock-ed while their owner works in them, and the previous
folder of an atomic swap is parked as `.NAME.old-PID.RAND`, so `sweep_stale` can tell a crash's leftovers from a
live process's work. Disk-full and permission errors become one QconvError in qconv.disk.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

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


def find_links(root: str | os.PathLike) -> list[Path]:
    """Symbolic links at or below root, sorted; a linked folder is listed, never entered."""
    root = Path(root)
    if root.is_symlink():
        return [root]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):  # followlinks=False
        out += [p for n in dirnames + filenames if (p := Path(dirpath) / n).is_symlink()]
    return sorted(out)


def refuse_links(root: str | os.PathLike, what: str, fix: str) -> None:
    """One QconvError naming the first symbolic link at or below root: qconv never reads or writes through one."""
    if links := find_links(root):
        raise QconvError(
            f"{what}: {links[0]} is a symbolic link (to {os.readlink(links[0])}); qconv never reads or "
            "writes through links here",
            where=str(root),
            fix=fix,
        )


def open_nofollow(path: str | os.PathLike, flags: int, what: str, fix: str) -> int:
    """os.open for a file qconv owns alone: a symbolic link in place of `path` (O_NOFOLLOW), a hard link (more than
    one name for its bytes) or anything but a regular file is refused before a byte is written. O_TRUNC is applied
    only after those checks, so a planted hard link never loses its contents."""
    try:
        fd = os.open(path, (flags & ~os.O_TRUNC) | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o666)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENXIO):  # ENXIO: a FIFO with no reader
            raise
        kind = "a symbolic link" if e.errno == errno.ELOOP else "not a regular file"
        raise QconvError(f"{what}: {path} is {kind}; qconv never writes through links", where=str(path), fix=fix) from e
    if problem := _not_sole_file(os.fstat(fd)):
        os.close(fd)
        raise QconvError(f"{what}: {path} is {problem}; qconv never writes through links", where=str(path), fix=fix)
    os.set_blocking(fd, True)
    if flags & os.O_TRUNC:
        os.ftruncate(fd, 0)
    return fd


def _not_sole_file(st: os.stat_result) -> str | None:
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    return "a hard link (it shares its bytes with another file)" if st.st_nlink > 1 else None


def refuse_shared(path: str | os.PathLike, what: str, fix: str) -> None:
    """One QconvError unless `path` is a regular file with one name: a hard link planted in a download folder would
    make the cached file share its inode with someone else's."""
    if problem := _not_sole_file(os.lstat(path)):
        raise QconvError(
            f"{what}: {path} is {problem}; qconv never takes files through links", where=str(path), fix=fix
        )


def file_table(root: str | os.PathLike, exclude: tuple[str, ...] = ()) -> dict[str, dict]:
    """{relative posix path: {sha256, size}} for every regular file below root, sorted (links are not followed)."""
    root = Path(root)
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink():
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
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~umask())
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_path(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def fsync_path(path: str | os.PathLike) -> None:
    """Flush one file or folder (a folder's fsync makes the renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if Path(path).is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """Flush every file and folder below root, then root: what is renamed into place is on disk first."""
    root = Path(root)
    for p in sorted(root.rglob("*"), key=lambda q: -len(q.parts)):
        if not p.is_symlink():
            fsync_path(p)
    fsync_path(root)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


@contextlib.contextmanager
def owned_temp_dir(parent: str | os.PathLike, name: str) -> Iterator[Path]:
    """`parent/.NAME.PID.RAND.partial`, flock-ed for as long as the block runs and removed at its end unless the
    caller renamed it away: a crash leaves a folder whose owner is provably gone (see sweep_stale)."""
    tmp = Path(tempfile.mkdtemp(dir=parent, prefix=f".{name}.{os.getpid()}.", suffix=".partial"))
    fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield tmp
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # our own leftovers are never in use by us once we sweep
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stale_partial(p: Path) -> bool:
    """A temp folder/file whose owner is gone: the pid its name carries is not running and nobody holds its lock."""
    m = re.search(r"\.(\d+)\.[^.]*\.(partial|tmp)$", p.name)
    if m and _pid_alive(int(m.group(1))):
        return False
    if p.is_dir() and not p.is_symlink():
        fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY)
        try:
            return _try_lock(fd)
        finally:
            os.close(fd)
    return True


def sweep_stale(parent: str | os.PathLike, name: str = "*") -> list[Path]:
    """Clean what a killed process left beside `parent/NAME` (NAME "*": beside anything in parent): temp
    `.NAME.*.partial` folders and `.NAME.*.tmp` files whose owner is gone are removed; a `.NAME.old-PID.*` folder
    parked by an atomic swap that never finished is put back as NAME when NAME is missing (the user's previous
    folder), else removed. Returns the paths removed or restored."""
    parent = Path(parent)
    if not parent.is_dir():
        return []
    done = []
    for p in sorted(parent.glob(f".{glob_escape(name) if name != '*' else '*'}.*")):
        if p.name.endswith((".partial", ".tmp")):
            if _stale_partial(p):
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
                done.append(p)
            continue
        m = re.fullmatch(r"\.(.+)\.old-(\d+)(\.[^.]+)?", p.name)
        if not m or _pid_alive(int(m.group(2))):
            continue
        final = parent / m.group(1)
        if not final.exists():
            os.replace(p, final)
            fsync_path(parent)
        else:
            shutil.rmtree(p, ignore_errors=True)
        done.append(p)
    return done


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike, *, force: bool = False) -> Iterator[Path]:
    """Yield a temp dir beside `final`; on success it replaces `final` (flushed to disk first), on any error it is
    removed. The previous folder is parked as `.NAME.old-PID.*` between the two renames (sweep_stale restores it
    after a crash there)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    with owned_temp_dir(final.parent, final.name) as tmp:
        tmp.chmod(0o755)
        yield tmp
        normal_modes(tmp)
        fsync_tree(tmp)
        if final.exists():
            if not force:
                raise FileExistsError(final)
            old = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.old-{os.getpid()}."))
            os.replace(final, old)
            os.replace(tmp, final)
            fsync_path(final.parent)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
            fsync_path(final.parent)


def switch_symlink(link: str | os.PathLike, target: str) -> None:
    """Point `link` at `target` atomically (a new symlink renamed over the old one): readers see old or new, never none."""
    link = Path(link)
    tmp = link.with_name(f".{link.name}.tmp-{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    os.symlink(target, tmp)
    os.replace(tmp, link)
