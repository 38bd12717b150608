"""The C heap's thresholds, set to where glibc's own rule takes them in a long-running process,
from the first call instead.

glibc serves an allocation above its mmap threshold (128 KiB at start) with fresh pages from
the kernel and hands them back on free. A prompt's activations (a 128-token batch of a
7168-wide model is 3.7 MB a tensor) are such allocations, so the first prompt of a process
faults in zeroed pages for every one of them (slow on a virtual machine's first touch) until
glibc's dynamic rule has raised the threshold, on each free of a large block, to that block's
size (at most 32 MiB on 64-bit) and the trim threshold to twice it. Setting both to that end
point at start gives the first prompt the heap a warmed process has (bench/README.md, "The
first prompt's heap": its time with and without). The memory kept is what glibc itself keeps
after the first large frees: at most 64 MiB of freed heap top.

``configure()`` does it where the C library has ``mallopt`` (glibc); the user's own
``GLIBC_TUNABLES`` malloc settings or ``MALLOC_*_`` variables win. The CLI calls it first thing;
a library user may.
"""

from __future__ import annotations

import ctypes
import logging
import os

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "configure"]

log = logging.getLogger(__name__)

#: glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: where its dynamic threshold stops
MMAP_THRESHOLD = 32 << 20
#: twice it, as the dynamic rule sets the trim threshold
TRIM_THRESHOLD = 64 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3          # malloc.h

_done: list[bool] = []


def _user_set() -> bool:
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return True
    return any(k.startswith("MALLOC_") and k.endswith("_") for k in os.environ)


def configure() -> bool:
    """Set the heap's mmap and trim thresholds (once); False where the user set malloc's own
    tuning or the C library has no ``mallopt``."""
    if _done:
        return _done[0]
    ok = False
    if not _user_set():
        try:
            mallopt = ctypes.CDLL(None).mallopt
        except (OSError, AttributeError):
            mallopt = None
        if mallopt is not None:
            mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
            ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and \
                bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
            if not ok:
                log.debug("mallopt refused the heap thresholds; glibc's defaults kept")
    _done.append(ok)
    return ok
