"""The C heap's thresholds: the mmap threshold where glibc's own rule takes it in a long-running
process, from the first call; the trim threshold past a prompt's scratch.

glibc serves an allocation above its mmap threshold (128 KiB at start) with fresh pages from
the kernel and hands them back on free. A prompt's activations (a 128-token batch of a
7168-wide model is 3.7 MB a tensor) are such allocations, so the first prompt of a process
faults in zeroed pages for every one of them (slow on a virtual machine's first touch) until
glibc's dynamic rule has raised the threshold, on each free of a large block, to that block's
size (at most 32 MiB on 64-bit). Setting it to that end point at start gives the first prompt
the heap a warmed process has.

The trim threshold is set past any prompt's scratch, so the heap a prompt grew stays for the
next one: at glibc's dynamic end point (twice the mmap threshold, 64 MiB) the freed top of a
larger prompt was handed back at its end and every later prompt faulted it in again, its
blocks past 32 MiB (MLA's chunked attention output) as fresh mappings too, which a heap with
room serves from its free chunks instead (bench/README.md, "The first prompt's heap": the
figures with and without). What stays is about the largest prompt batch's activations,
which ``run``'s budget reserves for it anyway (``plan.host.prefill_activation_bytes``); decode
allocates from the same free chunks.

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
#: past any prompt's scratch: the freed heap top is kept for the next prompt
TRIM_THRESHOLD = 1 << 30
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
