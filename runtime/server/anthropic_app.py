"""The Anthropic Messages API routes: ``POST /v1/messages`` (whole or streamed as Anthropic's
server-sent events) and ``POST /v1/messages/count_tokens``, on the application ``app`` builds,
sharing its queue, generation thread and body limits; and the middleware that gives every
error under ``/v1/messages`` Anthropic's shape (``{"type": "error", "error": {"type",
"message"}}``) with the status the OpenAI routes would give it.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Awaitable, Callable

from aiohttp import web

from .anthropic import StreamShaper, error_body, message, parse_messages
from .conn import Streamed, run_whole
from .schema import CompletionRequest, RequestError

__all__ = ["add_messages_routes", "anthropic_errors", "PREFIX"]

log = logging.getLogger(__name__)
PREFIX = "/v1/messages"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def anthropic_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Rewrites the OpenAI-shaped error bodies of the routes under ``/v1/messages``."""
    resp = await handler(request)
    if not request.path.startswith(PREFIX) or resp.status < 400 or not isinstance(resp, web.Response) \
            or resp.prepared:
        return resp
    try:
        msg = json.loads(resp.body)["error"]["message"]
    except (TypeError, ValueError, KeyError):
        msg = resp.reason or "error"
    resp.body = json.dumps(error_body(resp.status, str(msg))).encode()
    resp.content_type = "application/json"
    return resp




async def _event(resp: web.StreamResponse, name: str, data: dict[str, Any]) -> None:
    await resp.write(f"event: {name}\ndata: ".encode() + json.dumps(data).encode() + b"\n\n")


def add_messages_routes(app: web.Application, *, session: Any, model_id: str, gate: Any,
                        queue_timeout: float, body_of: Callable[[web.Request], Awaitable[Any]],
                        generate: Callable[..., Awaitable[Any]]) -> None:
    """``generate(req, ids, emit, cancelled)`` runs one generation on the generation thread;
    ``gate`` is the application's admission queue."""

    async def parse(request: web.Request, count_only: bool) -> tuple[CompletionRequest, bool]:
        req, single = parse_messages(await body_of(request), count_only)
        if req.model not in (None, "", model_id):
            raise RequestError(404, f"model {req.model!r} is not served here; this server "
                               f"serves {model_id!r}", param="model", code="model_not_found")
        return req, single

    async def count_tokens(request: web.Request) -> web.Response:
        req, _ = await parse(request, True)
        return web.json_response({"input_tokens": len(session.prompt_ids(req))})

    async def messages(request: web.Request) -> web.StreamResponse:
        req, single = await parse(request, False)
        ids = session.prompt_ids(req)
        await gate.acquire(queue_timeout)
        try:
            if req.stream:
                return await _stream(request, req, ids, single)
            return await _whole(request, req, ids, single)
        finally:
            gate.release()

    async def _whole(request: web.Request, req: CompletionRequest, ids: list[int],
                     single: bool) -> web.Response:
        out = await run_whole(generate, request, req, ids)
        return web.json_response(message(out, model_id, single))

    async def _stream(request: web.Request, req: CompletionRequest, ids: list[int],
                      single: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        shaper = StreamShaper(model_id, len(ids), single)
        async with Streamed(generate, request, req, ids) as gen:
            for name, data in shaper.start():
                await _event(resp, name, data)
            async for delta in gen:
                for name, data in shaper.push(delta):
                    await _event(resp, name, data)
            try:
                out = await gen.result()
            except Exception as e:             # headers are sent: report in-band, end the stream
                log.error("generation failed mid-stream: %s", e)
                status = e.status if isinstance(e, RequestError) else 500
                await _event(resp, "error", error_body(status, str(e)))
                return resp
            for name, data in shaper.finish(out):
                await _event(resp, name, data)
        return resp

    app.router.add_post(PREFIX, messages)
    app.router.add_post(PREFIX + "/count_tokens", count_tokens)
