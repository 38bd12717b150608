"""The aiohttp application: OpenAI routes, the Anthropic Messages API (``anthropic_app``),
``/metrics`` (``metrics``), the chat page at ``/`` (``static/chat.html``), auth, a bounded
queue, JSON errors for everything.

One generation runs at a time (the engine and its expert caches are one machine's resources);
``max_waiting`` more may queue, in arrival order, for up to ``queue_timeout`` seconds; beyond
that a request is refused at once with 503 and ``Retry-After``. Generation runs on one worker
thread; streamed tokens reach the event loop through ``call_soon_threadsafe``, so the loop never
blocks on the model. A client that disconnects, streaming or not, stops its generation at the
next token. Heads and bodies are read within the limits ``body`` documents (size, time,
nesting).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

from aiohttp import web

from ...errors import ExpertfsError, IntegrityError
from ..io.errors import IOEngineError
from .anthropic_app import add_messages_routes, anthropic_errors
from .conn import Streamed, run_whole
from .body import BODY_TIMEOUT, HEADER_TIMEOUT, MAX_DEPTH, read_json
from .metrics import ARRIVAL, Metrics
from .respond import chunk, final, last_chunk, response_id
from .schema import CompletionRequest, RequestError, parse_chat, parse_completion
from .session import Outcome, Session

__all__ = ["ServerConfig", "build_app"]

log = logging.getLogger(__name__)

_PAGE_CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
             "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'self'; "
             "frame-ancestors 'none'")


@dataclass(frozen=True)
class ServerConfig:
    model_id: str
    api_key: str | None = None
    max_waiting: int = 8
    queue_timeout: float = 300.0
    max_body: int = 4 << 20
    body_timeout: float = BODY_TIMEOUT
    max_depth: int = MAX_DEPTH
    header_timeout: float = HEADER_TIMEOUT


class _Gate:
    """FIFO admission: one running, at most ``max_waiting`` waiting; counted synchronously on
    arrival so a burst cannot slip past the bound before the lock is taken."""

    def __init__(self, max_waiting: int) -> None:
        self.lock = asyncio.Lock()
        self.max_waiting = max_waiting
        self.admitted = 0                       # running + waiting

    @property
    def waiting(self) -> int:
        return max(0, self.admitted - 1)

    async def acquire(self, timeout: float) -> None:
        if self.admitted >= 1 + self.max_waiting:
            raise RequestError(503, f"the server is busy ({self.waiting} requests waiting)",
                               code="server_busy", kind="server_error")
        self.admitted += 1
        try:
            await asyncio.wait_for(self.lock.acquire(), timeout)
        except BaseException:
            self.admitted -= 1
            if isinstance(sys.exc_info()[1], asyncio.TimeoutError):
                raise RequestError(503, f"waited {timeout:.0f} s for the model",
                                   code="queue_timeout", kind="server_error") from None
            raise

    def release(self) -> None:
        self.admitted -= 1
        self.lock.release()


def _error(status: int, message: str, **kw: Any) -> web.Response:
    err = RequestError(status, message, **kw)
    headers = {"Retry-After": "1"} if status == 503 else None
    return web.json_response(err.body(), status=status, headers=headers)


@web.middleware
async def _errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                  ) -> web.StreamResponse:
    try:
        return await handler(request)
    except RequestError as e:
        resp = web.json_response(e.body(), status=e.status,
                                 headers={"Retry-After": "1"} if e.status == 503 else None)
        if e.status in (408, 413):             # the rest of the body is not read: hang up
            resp.force_close()
        return resp
    except web.HTTPRequestEntityTooLarge as e:
        return _error(413, f"the request body is too large: {e.text}", code="body_too_large")
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _error(e.status, e.reason or "error", code=str(e.status))
    except (IOEngineError, IntegrityError) as e:   # the store could not be read: say which
        log.error("storage read failed: %s", e)
        return _error(503, str(e), kind="server_error", code="storage_error")
    except ExpertfsError as e:
        log.error("request failed: %s", e)
        return _error(500, str(e), kind="server_error", code="engine_error")
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as e:                     # a bug: report it, keep serving
        log.exception("unexpected error")
        return _error(500, f"internal error: {type(e).__name__}: {e}", kind="server_error")


def build_app(session: Session, config: ServerConfig) -> web.Application:
    gate = _Gate(config.max_waiting)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="expertfs-generate")
    created = int(time.time())
    metrics = Metrics(lambda: session.engine.provider.stats, lambda: gate.waiting,
                      lambda: int(gate.lock.locked()))

    @web.middleware
    async def auth(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                   ) -> web.StreamResponse:
        if config.api_key and (request.path.startswith("/v1/") or request.path == "/apply-template"):
            given = request.headers.get("Authorization", "")
            if given != f"Bearer {config.api_key}" and \
                    request.headers.get("x-api-key") != config.api_key:
                return _error(401, "missing or wrong API key (Authorization: Bearer KEY, "
                              "or x-api-key: KEY)",
                              code="invalid_api_key", kind="authentication_error")
        return await handler(request)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "model": config.model_id,
                                  "busy": gate.lock.locked(), "waiting": gate.waiting,
                                  "auth": bool(config.api_key)})

    page = (Path(__file__).parent / "static" / "chat.html").read_bytes()

    async def chat_page(request: web.Request) -> web.Response:
        """The chat page: one static file, its script and style inline, talking to this origin
        only (its Content-Security-Policy lets it reach nothing else)."""
        return web.Response(body=page, content_type="text/html", charset="utf-8", headers={
            "Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff",
            "Content-Security-Policy": _PAGE_CSP})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": config.model_id, "object": "model", "created": created, "owned_by": "expertfs"}]})

    async def body_of(request: web.Request) -> Any:
        return await read_json(request, max_body=config.max_body, timeout=config.body_timeout,
                               max_depth=config.max_depth)

    async def completion(request: web.Request, chat: bool) -> web.StreamResponse:
        body = await body_of(request)
        req = parse_chat(body) if chat else parse_completion(body)
        if req.model not in (None, "", config.model_id):
            raise RequestError(404, f"model {req.model!r} is not served here; this server serves "
                               f"{config.model_id!r}", param="model", code="model_not_found")
        ids = session.prompt_ids(req)
        await gate.acquire(config.queue_timeout)
        try:
            if req.stream:
                return await _stream(request, req, ids)
            return await _whole(request, req, ids)
        finally:
            gate.release()

    async def _generate(req: CompletionRequest, ids: list[int], emit: Callable[[dict[str, Any]], None],
                        cancelled: Callable[[], bool], request: web.Request | None = None) -> Outcome:
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        out = await loop.run_in_executor(pool, session.run, req, ids, lambda s: None, cancelled,
                                         emit)
        metrics.observe(out, request.get(ARRIVAL, started) if request is not None else started,
                        started)
        return out

    async def _whole(request: web.Request, req: CompletionRequest, ids: list[int]) -> web.Response:
        out = await run_whole(_generate, request, req, ids)
        return web.json_response(final(req, out, config.model_id))

    async def _stream(request: web.Request, req: CompletionRequest, ids: list[int]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        rid = response_id(req)
        async with Streamed(_generate, request, req, ids) as gen:
            if req.chat:
                await _send(resp, chunk(req, rid, config.model_id, {"role": "assistant", "content": ""}))
            async for delta in gen:
                await _send(resp, chunk(req, rid, config.model_id, delta))
            try:
                out = await gen.result()
            except Exception as e:             # headers are sent: report in-band, end the stream
                log.error("generation failed mid-stream: %s", e)
                if isinstance(e, RequestError):
                    err = e
                elif isinstance(e, (IOEngineError, IntegrityError)):
                    err = RequestError(503, str(e), kind="server_error", code="storage_error")
                else:
                    err = RequestError(500, str(e), kind="server_error", code="engine_error")
                await _send(resp, err.body())
                await resp.write(b"data: [DONE]\n\n")
                return resp
            await _send(resp, last_chunk(req, rid, config.model_id, out))
            await resp.write(b"data: [DONE]\n\n")
        return resp

    async def chat(request: web.Request) -> web.StreamResponse:
        return await completion(request, True)

    async def complete(request: web.Request) -> web.StreamResponse:
        return await completion(request, False)

    async def apply_template(request: web.Request) -> web.Response:
        """llama.cpp's ``/apply-template``: the prompt a chat request renders to."""
        req = parse_chat(await body_of(request))
        return web.json_response({"prompt": session.render(req)})

    async def not_found(request: web.Request) -> web.Response:
        return _error(404, f"no route {request.method} {request.path}", code="not_found")

    # aiohttp closes a connection whose next request head is not whole within its keep-alive
    # timeout (counted from the connection's opening or its previous response): that is the
    # head timeout, whatever the runner was given
    app = web.Application(middlewares=[metrics.middleware, anthropic_errors, _errors, auth],
                          client_max_size=config.max_body,
                          handler_args={"keepalive_timeout": config.header_timeout})
    app.router.add_get("/", chat_page)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics.handler)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", complete)
    app.router.add_post("/apply-template", apply_template)
    add_messages_routes(app, session=session, model_id=config.model_id, gate=gate,
                        queue_timeout=config.queue_timeout, body_of=body_of, generate=_generate)
    app.router.add_route("*", "/{tail:.*}", not_found)

    async def close_pool(app: web.Application) -> None:
        pool.shutdown(wait=True)
    app.on_cleanup.append(close_pool)
    return app




async def _send(resp: web.StreamResponse, obj: dict[str, Any]) -> None:
    await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
