"""``kvikio``: reads with ``kvikio.CuFile`` into host buffers or straight into CUDA memory.

kvikio uses GPUDirect Storage where the platform supports it (cuFile with nvidia-fs) and its
POSIX compat mode with its own thread pool otherwise (``KVIKIO_COMPAT_MODE=AUTO``). Every read,
host buffers included, asks the CUDA driver what kind of memory the buffer is, so the backend
is available only where ``libcuda.so.1`` loads (the NVIDIA driver); elsewhere
:meth:`KvikioBackend.availability` says why and ``auto`` falls back. kvikio is an optional
extra (``pip install expertfs[kvikio]``); it is imported only when this backend is used.
"""

from __future__ import annotations

import ctypes
import errno
import importlib
import logging
import os
import threading
from typing import Any

import numpy as np
import torch

from .buffers import host_view, is_device_buffer
from .errors import BackendUnavailable
from .protocol import DEFAULT_QUEUE_DEPTH, Availability, FileHandle, IOBackend, RawFile, open_fd
from .retry import RetryPolicy

__all__ = ["KvikioBackend"]

log = logging.getLogger(__name__)

_lock = threading.Lock()


def _import_kvikio() -> Any:
    try:
        kvikio = importlib.import_module("kvikio")
        importlib.import_module("kvikio.defaults")
        return kvikio
    except ImportError as e:
        raise BackendUnavailable("kvikio", f"kvikio is not installed ({e})",
                                 fix="pip install 'expertfs[kvikio]' on a machine with the NVIDIA "
                                     "driver, or use backend='direct'") from None


def _get(kvikio: Any, key: str, default: Any) -> Any:
    """A kvikio setting, or ``default`` where this kvikio version has no such key."""
    try:
        return kvikio.defaults.get(key)
    except (KeyError, ValueError, RuntimeError, AttributeError):
        return default


class _KvikioFile(RawFile):
    host_only = False

    def __init__(self, path: str, size: int, cufile: Any) -> None:
        super().__init__(path, size)
        self._f = cufile

    def prepare(self, buf: Any) -> Any:
        if isinstance(buf, torch.Tensor) and buf.device.type == "cuda":
            return buf.detach().reshape(-1).view(torch.uint8)
        if is_device_buffer(buf):
            return buf                     # a 1-D uint8 device array (cupy, numba)
        return np.frombuffer(host_view(buf), dtype=np.uint8)

    def pread_into(self, dest: Any, start: int, end: int, file_offset: int) -> int:
        n = end - start
        try:
            return int(self._f.pread(dest[start:end], size=n, file_offset=file_offset).get())
        except RuntimeError as e:      # kvikio reports failed reads as RuntimeError
            raise OSError(errno.EIO, f"kvikio: {e}") from e

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


class KvikioBackend(IOBackend):
    """``nthreads``: kvikio's pool size (default: the handle's queue depth, at least 4);
    ``task_size``: bytes per pool task (kvikio's default 4 MiB); ``direct_io``: kvikio's POSIX
    path reads with O_DIRECT where it can (``auto_direct_io_read``), as the ``direct`` backend,
    or through the page cache (``False``), as the ``buffered`` one. In each mode kvikio reads
    within a few percent of its POSIX twin; which mode is faster depends on the drive and the
    queue depth, so ``auto`` gives kvikio the mode its probe measured faster
    (``bench/kvikio_ab.py`` measures both). kvikio keeps the setting per process: the handle
    opened last sets it for all."""

    name = "kvikio"

    def __init__(self, *, nthreads: int | None = None, task_size: int | None = None,
                 direct_io: bool = True) -> None:
        self.nthreads = nthreads
        self.task_size = task_size
        self.direct_io = direct_io

    @classmethod
    def availability(cls) -> Availability:
        try:
            _import_kvikio()
        except BackendUnavailable as e:
            return Availability(False, e.reason)
        try:
            ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            return Availability(False, "libcuda.so.1 (the NVIDIA driver) cannot be loaded: kvikio "
                                       f"needs the CUDA driver even for host buffers ({e})")
        return Availability(True, "kvikio imports and libcuda.so.1 loads")

    def mode(self) -> str:
        """'gds' when cuFile reads go GPUDirect, 'compat' when kvikio uses its POSIX path."""
        kvikio = _import_kvikio()
        return "compat" if kvikio.defaults.is_compat_mode_preferred() else "gds"

    def describe(self) -> str:
        try:
            kvikio = _import_kvikio()
            return (f"kvikio ({self.mode()} mode, {'O_DIRECT' if self.direct_io else 'page cache'}, "
                    f"{kvikio.defaults.get('num_threads')} threads, "
                    f"task {kvikio.defaults.get('task_size')} B)")
        except BackendUnavailable as e:
            return f"kvikio (unavailable: {e.reason})"

    def _configure(self, queue_depth: int) -> None:
        kvikio = _import_kvikio()
        want = self.nthreads or max(4, queue_depth)
        with _lock:
            # compat mode reads through the page cache unless asked: cold single expert reads
            # measured slower that way than with O_DIRECT (see bench/README.md)
            if _get(kvikio, "auto_direct_io_read", self.direct_io) != self.direct_io:
                kvikio.defaults.set("auto_direct_io_read", self.direct_io)
            if kvikio.defaults.get("num_threads") < want:
                kvikio.defaults.set("num_threads", want)
            if self.task_size and kvikio.defaults.get("task_size") != self.task_size:
                kvikio.defaults.set("task_size", self.task_size)

    def open(self, path: str | os.PathLike[str], *, queue_depth: int = DEFAULT_QUEUE_DEPTH,
             max_pending: int | None = None, retry: RetryPolicy | None = None) -> FileHandle:
        self._configure(queue_depth)
        return super().open(path, queue_depth=queue_depth, max_pending=max_pending, retry=retry)

    def open_raw(self, path: str | os.PathLike[str]) -> RawFile:
        avail = self.availability()
        if not avail.available:
            raise BackendUnavailable(self.name, avail.reason, path=path,
                                     fix="use backend='direct' or 'auto' (it falls back)")
        kvikio = _import_kvikio()
        path, fd, size = open_fd(path)      # the same typed errors as every backend
        os.close(fd)
        f = kvikio.CuFile(path, "r")
        log.debug("%s: opened with %s", path, self.describe())
        return _KvikioFile(path, size, f)
