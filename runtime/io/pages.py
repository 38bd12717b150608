"""The kernel's page facilities: ``madvise`` through ctypes, and which page size a fresh slab
takes on this box.

Transparent huge pages give the kernels that stream a slab every token one TLB entry per 2 MiB
instead of per 4 KiB. But every page of a new slab is memory the kernel clears on its first
touch (inside the first O_DIRECT read into it, or ``Prefault``'s populate). In a virtual
machine whose balloon reports free pages to the host (``VIRTIO_BALLOON_F_REPORTING``: the
guest hands each 2 MiB block that stays free for a moment back, and the host discards it),
a fresh huge page is such a block and its first touch is a host fault for every page of it:
clearing it costs several times what the same bytes of 4 KiB pages cost, which mostly come
from memory the host still backs (bench/README.md, "Huge pages and a virtual machine's fresh
memory"). A capped prompt's first token and a preload wait on that clearing, where the TLB
saves a decode only a few percent. Reads into them cost more, though: O_DIRECT pins and the
block device takes 4 KiB pages one segment each, where a huge page is one. So a one-shot run
takes small pages where the kernel reports free pages (:func:`page_reporting`), and a process
that lives long (``expertfs serve``, :func:`expect_long_life`: its warm start clears the pages
before the first request, and every request's reads go faster) keeps huge pages;
``EXPERTFS_HUGE_PAGES=1`` / ``0`` decides instead of both.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
import time
from typing import Any

__all__ = ["HUGE_PAGE", "MADV_POPULATE_READ", "MADV_POPULATE_WRITE", "libc", "huge_pages_pay",
           "page_reporting", "expect_long_life", "first_touch_s_per_gb"]

log = logging.getLogger(__name__)

#: madvise(2) advice faulting a range in: readable, reading file pages as needed; writable,
#: without touching it (Linux 5.14 and later; Python's mmap names them only from 3.13 on).
MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23

HUGE_PAGE = 2 << 20


@functools.lru_cache(maxsize=1)
def libc() -> Any:
    """The C library with ``madvise(addr, n, advice)`` and ``mincore(addr, n, vec)`` typed (both
    return int, ctypes' default), or None. Through ctypes, not ``mmap.madvise``: a ctypes call
    releases the GIL, ``mmap.madvise`` holds it while a populate waits for the drive or the
    kernel's zeroing, and the forward pass's thread with it."""
    try:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    return lib


def first_touch_s_per_gb(huge: bool, nbytes: int = 16 << 20) -> float | None:
    """Seconds a GB the kernel takes to fault in ``nbytes`` of fresh anonymous memory on 2 MiB
    (``huge``) or 4 KiB pages (``MADV_POPULATE_WRITE``: the clearing a first read pays); None
    where the kernel lacks the advice or transparent huge pages. A measurement for benchmarks:
    memory another process freed a moment ago, before the host took it back, is cheap to touch,
    so a short probe cannot decide for a slab of gigabytes."""
    lib = libc()
    if lib is None or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mm.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
        buf = ctypes.c_char.from_buffer(mm)
        addr = -(-ctypes.addressof(buf) // HUGE_PAGE) * HUGE_PAGE
        t0 = time.perf_counter()
        rc = lib.madvise(addr, nbytes, MADV_POPULATE_WRITE)
        dt = time.perf_counter() - t0
        del buf
    except OSError:
        return None
    finally:
        mm.close()
    return dt / nbytes * 1e9 if rc == 0 else None


#: a virtio device's id for the memory balloon, and its feature bit for free page reporting
VIRTIO_BALLOON_ID, VIRTIO_BALLOON_F_REPORTING = 0x0005, 5


def page_reporting(sysfs: str = "/sys") -> bool:
    """True where the kernel hands free pages back to a hypervisor: a virtio balloon that
    negotiated free page reporting (its ``features`` string, bit 5), or a page-reporting
    module that says it has reported memory (``reported_kib``, where the kernel has it)."""
    root = os.path.join(sysfs, "bus", "virtio", "devices")
    try:
        devices = os.listdir(root)
    except OSError:
        devices = []
    for d in devices:
        try:
            with open(os.path.join(root, d, "device")) as f:
                if int(f.read().strip(), 16) != VIRTIO_BALLOON_ID:
                    continue
            with open(os.path.join(root, d, "features")) as f:
                bits = f.read().strip()
        except (OSError, ValueError):
            continue
        if len(bits) > VIRTIO_BALLOON_F_REPORTING and bits[VIRTIO_BALLOON_F_REPORTING] == "1":
            return True
    try:
        with open(os.path.join(sysfs, "module", "page_reporting", "parameters",
                               "reported_kib")) as f:
            return int(f.read().strip()) > 0
    except (OSError, ValueError):
        return False


_long_life = False


def expect_long_life() -> None:
    """This process will serve many requests: its slabs keep huge pages wherever the kernel
    offers them (call before the first slab)."""
    global _long_life
    _long_life = True


@functools.lru_cache(maxsize=1)
def _reporting_here() -> bool:
    """``page_reporting()`` of this box, read (and said) once a process."""
    reporting = page_reporting()
    if reporting:
        log.info("the kernel reports free pages to the hypervisor: a one-shot run's slabs on "
                 "4 KiB pages, whose first touch costs less than fresh huge pages' "
                 "(EXPERTFS_HUGE_PAGES=1 keeps huge pages: slower to fill, faster to read into)")
    return reporting


def huge_pages_pay() -> bool:
    """Whether a fresh slab should be advised for transparent huge pages on this box: not in
    a one-shot process where the kernel reports free pages to a hypervisor;
    ``EXPERTFS_HUGE_PAGES`` 1 or 0 overrides."""
    env = os.environ.get("EXPERTFS_HUGE_PAGES", "auto").strip().lower()
    if env in ("1", "0", "on", "off", "true", "false"):
        return env in ("1", "on", "true")
    return _long_life or not _reporting_here()
