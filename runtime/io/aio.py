"""The asyncio front: ``await reader.read_expert(layer, expert, into=slot)``, many in flight.

Reads run on the handle's worker threads; the event loop only awaits their futures, so it is
never blocked by the disk. Cancelling the awaiting task cancels a read that has not started.
Prefetches are fire-and-forget tasks that :meth:`AsyncExpertReader.cancel_stale` drops once
the forward pass has moved on. :func:`run` uses uvloop when it is installed.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import Collection, Coroutine
from typing import Any, TypeVar

from .reader import ExpertBuffer, ExpertReader
from .scheduler import Priority

__all__ = ["AsyncExpertReader", "run", "uvloop_available"]

log = logging.getLogger(__name__)

T = TypeVar("T")


def uvloop_available() -> bool:
    try:
        importlib.import_module("uvloop")
    except ImportError:
        return False
    return True


def run(coro: Coroutine[Any, Any, T], *, use_uvloop: bool | None = None) -> T:
    """``asyncio.run`` on a uvloop loop when uvloop is installed (or ``use_uvloop`` says so)."""
    if use_uvloop is None:
        use_uvloop = uvloop_available()
    if use_uvloop:
        uvloop = importlib.import_module("uvloop")
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coro)
    return asyncio.run(coro)


class AsyncExpertReader:
    """Async reads over an :class:`ExpertReader` (which it does not own: close that)."""

    def __init__(self, reader: ExpertReader) -> None:
        self.reader = reader
        self._prefetches: dict[tuple[int, int], asyncio.Future[ExpertBuffer]] = {}

    async def read_expert(self, layer: int, expert: int, *, into: Any = None,
                          priority: Priority = Priority.DEMAND,
                          verify: str | None = None) -> ExpertBuffer:
        """Read one expert; a prefetch of it already queued is promoted and awaited."""
        fut = self.reader.read_expert(layer, expert, into, priority=priority, verify=verify)
        return await asyncio.wrap_future(fut)

    def prefetch(self, layer: int, expert: int, *, into: Any = None) -> asyncio.Future[ExpertBuffer]:
        """Queue a prefetch; the returned future can be awaited, or left and cancelled."""
        key = (layer, expert)
        cur = self._prefetches.get(key)
        if cur is not None and not cur.done():
            return cur
        afut = asyncio.wrap_future(self.reader.read_expert(layer, expert, into,
                                                           priority=Priority.PREFETCH))
        afut.add_done_callback(lambda f, k=key: self._done(k, f))
        self._prefetches[key] = afut
        return afut

    def _done(self, key: tuple[int, int], fut: asyncio.Future[ExpertBuffer]) -> None:
        if self._prefetches.get(key) is fut:
            del self._prefetches[key]
        if not fut.cancelled() and fut.exception() is not None:
            log.debug("prefetch of %s failed: %s", key, fut.exception())

    def cancel_stale(self, keep: Collection[tuple[int, int]] = ()) -> int:
        """Cancel queued prefetches of experts not in ``keep``; reads already running finish."""
        keep = set(keep)
        n = self.reader.cancel_prefetches(keep)
        for key, f in list(self._prefetches.items()):
            if key not in keep and f.done():
                self._prefetches.pop(key, None)
        return n
