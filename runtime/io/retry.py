"""Reading a whole range through a backend's single-attempt read: short reads are continued,
transient errors (EIO, EAGAIN, EINTR, EBUSY, ETIMEDOUT) retried with exponential backoff, and
what still fails becomes an :class:`IOFaultError` naming the file and offset."""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from .errors import IOFaultError

__all__ = ["RetryPolicy", "read_fully"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetryPolicy:
    """``attempts`` failures are allowed per read (a read that makes progress resets nothing:
    a short read is not a failure, a zero-byte read before the end is). Backoff doubles from
    ``backoff_s`` up to ``max_backoff_s``."""

    attempts: int = 4
    backoff_s: float = 0.002
    factor: float = 4.0
    max_backoff_s: float = 0.25
    retry_errnos: frozenset[int] = frozenset({errno.EIO, errno.EAGAIN, errno.EINTR, errno.EBUSY,
                                              errno.ETIMEDOUT})

    def delay(self, failure: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * self.factor ** (failure - 1))


def read_fully(raw: Callable[[int, int, int], int], *, path: str, offset: int, size: int,
               policy: RetryPolicy, sleep: Callable[[float], None] = time.sleep) -> int:
    """Call ``raw(start, end, file_offset)`` until ``size`` bytes from ``offset`` are in the
    destination; ``raw`` reads into destination bytes [start, end) and returns the count."""
    got = 0
    failures = 0
    while got < size:
        try:
            n = raw(got, size, offset + got)
        except OSError as e:
            if e.errno not in policy.retry_errnos:
                raise IOFaultError(f"{os.strerror(e.errno) if e.errno else e} (not retryable)",
                                   path=path, offset=offset + got, size=size - got,
                                   attempts=failures + 1, errno=e.errno) from e
            failures += 1
            if failures >= policy.attempts:
                raise IOFaultError(f"[Errno {e.errno}] {os.strerror(e.errno)}", path=path,
                                   offset=offset + got, size=size - got, attempts=failures,
                                   errno=e.errno) from e
            log.warning("%s: read at offset %d failed (%s); retry %d of %d", path, offset + got,
                        e, failures, policy.attempts - 1)
            sleep(policy.delay(failures))
            continue
        if n <= 0:
            failures += 1
            if failures >= policy.attempts:
                raise IOFaultError(f"the device returned no data ({got} of {size} bytes read; "
                                   "the file may have been truncated)", path=path,
                                   offset=offset + got, size=size - got, attempts=failures)
            log.warning("%s: zero-byte read at offset %d; retry %d of %d", path, offset + got,
                        failures, policy.attempts - 1)
            sleep(policy.delay(failures))
            continue
        got += n
    return got
