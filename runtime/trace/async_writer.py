"""The routing-trace writer for an asyncio runtime: the event loop never waits on disk or zstd.

Rows go into a one-chunk buffer (a few numpy stores per row). A full chunk is queued; one
background task compresses it in a worker thread and appends it with ``aiofiles``, in order.
The queue holds ``max_pending`` chunks: only when the disk falls that far behind does ``add``
suspend (backpressure on the calling coroutine, never a blocked loop), so memory stays bounded.
The bytes are exactly those of ``TraceWriter`` (format in ``expertfs.runtime.trace.file``).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import aiofiles

from .format import (END, END_TAG, ZSTD_LEVEL, ChunkBuffer, TraceChunk, TraceError,
                           TraceHeader, encode_chunk)

__all__ = ["AsyncTraceWriter"]

log = logging.getLogger(__name__)


class AsyncTraceWriter:
    """``async with AsyncTraceWriter(path, header) as w: await w.add(token, layer, ids, weights)``.

    Errors from the background task (a full disk, say) are raised by the next ``add`` or by
    ``close``. Leaving the ``async with`` normally writes the remaining rows and the End record;
    leaving it by an exception leaves the file unfinished (no End record), as readers then say.
    """

    def __init__(self, path: str | os.PathLike[str], header: TraceHeader, *, chunk_rows: int = 4096,
                 level: int = ZSTD_LEVEL, max_pending: int = 2) -> None:
        self.path, self.header, self.level = os.fspath(path), header, level
        self._buf = ChunkBuffer(header, chunk_rows)
        self._queue: asyncio.Queue[TraceChunk | None] = asyncio.Queue(maxsize=max(1, max_pending))
        self._task: asyncio.Task[None] | None = None
        self._f: Any = None
        self._closed = False
        self.n_rows = self.n_chunks = 0

    async def open(self) -> AsyncTraceWriter:
        try:
            self._f = await aiofiles.open(self.path, "wb")
        except OSError as e:
            raise TraceError(f"cannot create: {e.strerror}", path=self.path,
                             fix="check the directory exists and is writable") from None
        await self._f.write(self.header.pack())
        self._task = asyncio.get_running_loop().create_task(self._drain(), name=f"trace:{self.path}")
        return self

    async def add(self, token: int, layer: int, experts: Any, weights: Any,
                  draft_experts: Any = None, draft_weights: Any = None) -> None:
        """Append one row; suspends only while ``max_pending`` chunks wait for the disk."""
        if self._task is None or self._closed:
            raise TraceError("add before open or after close", path=self.path,
                             fix="use `async with AsyncTraceWriter(...)`")
        self._raise_failure()
        self._buf.add(token, layer, experts, weights, draft_experts, draft_weights)
        if self._buf.full:
            await self._put(self._buf.take())

    async def _put(self, item: TraceChunk | None) -> None:
        """Queue ``item``; if the background task dies while we wait, raise its error."""
        if not self._queue.full():
            self._queue.put_nowait(item)
            return
        assert self._task is not None
        put = asyncio.ensure_future(self._queue.put(item))
        await asyncio.wait({put, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if not put.done():
            put.cancel()
            self._raise_failure()

    def _raise_failure(self) -> None:
        t = self._task
        if t is not None and t.done() and not t.cancelled() and t.exception() is not None:
            raise t.exception()  # type: ignore[misc]

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while (chunk := await self._queue.get()) is not None:
            data = await loop.run_in_executor(None, encode_chunk, self.header, chunk, self.level)
            await self._f.write(data)
            self.n_rows += len(chunk)
            self.n_chunks += 1

    async def close(self) -> None:
        """Write what is buffered and the End record, then close the file."""
        if self._closed or self._task is None:
            return
        self._closed = True
        try:
            if self._buf.n:
                await self._put(self._buf.take())
            await self._put(None)
            await self._task
            await self._f.write(END.pack(END_TAG, self.n_rows, self.n_chunks, 0))
        finally:
            await self._f.close()
        log.debug("wrote trace %s: %d rows in %d chunks", self.path, self.n_rows, self.n_chunks)

    async def __aenter__(self) -> AsyncTraceWriter:
        return await self.open()

    async def __aexit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            await self.close()
            return
        self._closed = True                      # an error in the caller: no End record
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._f.close()
