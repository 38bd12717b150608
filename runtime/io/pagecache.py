"""Making reads cold: drop a file's pages (``posix_fadvise(DONTNEED)``, any user) or the whole
page cache (``/proc/sys/vm/drop_caches``, root only)."""

from __future__ import annotations

import logging
import os

__all__ = ["drop_file_cache", "drop_system_cache", "make_cold"]

log = logging.getLogger(__name__)

DROP_CACHES = "/proc/sys/vm/drop_caches"


def drop_file_cache(path: str | os.PathLike[str]) -> bool:
    """Evict the clean cached pages of one file; False where the platform cannot."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True


def drop_system_cache() -> bool:
    """``sync; echo 3 > /proc/sys/vm/drop_caches``; False when not permitted."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False
    try:
        os.sync()
        with open(DROP_CACHES, "w") as f:
            f.write("3\n")
    except OSError as e:
        log.debug("cannot drop the page cache: %s", e)
        return False
    return True


def make_cold(path: str | os.PathLike[str], *, system: bool = True) -> str:
    """Drop what can be dropped before a cold read; returns how it was done, for reports."""
    if system and drop_system_cache():
        return "page cache dropped (drop_caches)"
    if drop_file_cache(path):
        return "file pages dropped (posix_fadvise DONTNEED)"
    return "page cache not dropped (not permitted here); only O_DIRECT reads are cold"
