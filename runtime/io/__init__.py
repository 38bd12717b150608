"""The expert I/O engine: one extent from the drive into a host (or device) buffer, fast.

::

    from expertfs.runtime.io import open_file, aligned_empty
    with open_file("STORE/experts.bin", backend="auto", queue_depth=16) as fh:
        buf = aligned_empty(extent.length)
        fut = fh.pread(buf, extent.offset, extent.length)    # a ReadFuture
        n = fut.result()

Backends (``backend=``): ``kvikio`` (CuFile; GPUDirect Storage or its POSIX compat mode; needs
the NVIDIA driver), ``direct`` (O_DIRECT + thread pool), ``buffered`` (pread, page cache),
``mmap`` (a baseline), ``auto`` (measures on the file, logs and caches the choice).
:class:`ExpertReader` reads experts by (layer, expert) with checksums;
:class:`AsyncExpertReader` is its asyncio front; :mod:`.bench` is ``expertfs bench io``.
"""

from .aio import AsyncExpertReader, run, uvloop_available
from .auto import AutoChoice, choose_backend, open_file, probe_backends
from .backends import BACKEND_NAMES, BACKENDS, available_backends, backend_status, get_backend
from .buffered import BufferedBackend
from .buffers import (PAGE, HostSlab, PinBudget, aligned_empty, default_pin_budget, host_view,
                      is_device_buffer)
from .direct import DirectBackend
from .errors import (AlignmentError, BackendUnavailable, ExpertIntegrityError, IOEngineError,
                     IOFaultError, IOUsageError, QueueFullError)
from .kvikio_backend import KvikioBackend
from .mmap_backend import MmapBackend
from .pagecache import drop_file_cache, drop_system_cache, make_cold
from .protocol import DEFAULT_QUEUE_DEPTH, Availability, FileHandle, IOBackend, RawFile
from .reader import VERIFY_MODES, ExpertBuffer, ExpertReader
from .retry import RetryPolicy
from .scheduler import Priority, ReadFuture, ReadScheduler

__all__ = [
    "AsyncExpertReader", "run", "uvloop_available",
    "AutoChoice", "choose_backend", "open_file", "probe_backends",
    "BACKEND_NAMES", "BACKENDS", "available_backends", "backend_status", "get_backend",
    "BufferedBackend", "DirectBackend", "KvikioBackend", "MmapBackend",
    "PAGE", "HostSlab", "PinBudget", "aligned_empty", "default_pin_budget", "host_view",
    "is_device_buffer",
    "AlignmentError", "BackendUnavailable", "ExpertIntegrityError", "IOEngineError", "IOFaultError",
    "IOUsageError", "QueueFullError",
    "drop_file_cache", "drop_system_cache", "make_cold",
    "DEFAULT_QUEUE_DEPTH", "Availability", "FileHandle", "IOBackend", "RawFile",
    "VERIFY_MODES", "ExpertBuffer", "ExpertReader",
    "RetryPolicy", "Priority", "ReadFuture", "ReadScheduler",
]
