"""What every endpoint does with its connection: notice a client that has gone, and run a
whole (non-streamed) generation so a disconnect stops it within a token but the engine still
finishes before the next request starts."""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from aiohttp import web

__all__ = ["client_gone", "run_whole"]


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
