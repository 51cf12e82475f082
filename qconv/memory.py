"""Host memory: what is free now, and keeping freed memory returned to the system (a build and a streamed
evaluation allocate and free tens of MB per module)."""

from __future__ import annotations

# glibc raises its mmap threshold to the size of each large block freed (up to 32 MB), so a build that allocates and
# frees tens of MB per module serves them from the heap, which fragments and is never given back (RSS grows with
# every module compressed). Pinned, every block above it is mmapped and returned on free.
MMAP_THRESHOLD = 4 << 20
_M_MMAP_THRESHOLD = -3  # mallopt parameter number (malloc.h)


def available_ram() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def pin_mmap_threshold(nbytes: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold (see MMAP_THRESHOLD) for this process. False where the C library has no
    mallopt (not glibc)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, nbytes))
    except (OSError, AttributeError):
        return False
