"""What every endpoint does with its connection: notice a client that has gone, and run a
whole (``run_whole``) or streamed (``Streamed``) generation so a disconnect stops it within a
token but the engine still finishes before the next request starts."""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from aiohttp import web

__all__ = ["client_gone", "run_whole", "Streamed"]


def client_gone(request: web.Request) -> bool:
    """Whether the client has disconnected (read from the generation thread: one attribute)."""
    t = request.transport
    return t is None or t.is_closing()


async def run_whole(generate: Callable[..., Awaitable[Any]], request: web.Request, req: Any,
                    ids: list[int]) -> Any:
    """``generate(req, ids, emit, cancelled, request)``'s outcome, cancelled by a disconnect."""
    gone = {"flag": False}
    task = asyncio.ensure_future(generate(req, ids, lambda d: None,
                                          lambda: gone["flag"] or client_gone(request), request))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:             # the handler cancelled on a disconnect
        gone["flag"] = True
        await asyncio.wait([task])             # the engine must finish before the next request
        raise


class Streamed:
    """``generate(req, ids, emit, cancelled, request)`` run as a task whose deltas are read with
    ``async for``; ``result()`` is its outcome. Used as ``async with``: a client that hangs up
    (a reset while writing) cancels the generation, which is awaited, and the response ends
    quietly; a cancelled handler does the same and the cancellation goes on."""

    def __init__(self, generate: Callable[..., Awaitable[Any]], request: web.Request, req: Any,
                 ids: list[int]) -> None:
        loop = asyncio.get_running_loop()
        self._q: asyncio.Queue[Any] = asyncio.Queue()
        self._gone = False
        self.task = asyncio.ensure_future(generate(
            req, ids, lambda d: loop.call_soon_threadsafe(self._q.put_nowait, d),
            lambda: self._gone or client_gone(request), request))
        self.task.add_done_callback(lambda _: loop.call_soon_threadsafe(self._q.put_nowait, None))

    def __aiter__(self) -> Streamed:
        return self

    async def __anext__(self) -> Any:
        delta = await self._q.get()
        if delta is None:
            raise StopAsyncIteration
        return delta

    async def result(self) -> Any:
        return await self.task

    async def __aenter__(self) -> Streamed:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, *_: object) -> bool:
        if kind is None or not issubclass(kind, (ConnectionResetError, asyncio.CancelledError)):
            return False
        self._gone = True
        await asyncio.wait([self.task])        # the engine must finish before the next request
        return issubclass(kind, ConnectionResetError)
