"""``expertfs serve STORE``: an OpenAI-compatible server (chat and text completions, streaming),
the Anthropic Messages API and Prometheus metrics."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ..errors import UsageError
from ._common import size_arg

__all__ = ["register", "run"]

# runtime.server.body's defaults (not imported here: that pulls in aiohttp for every command)
BODY_TIMEOUT, MAX_DEPTH, HEADER_TIMEOUT = 30.0, 64, 30.0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server over a store",
                       description="Serve a store over HTTP: /v1/chat/completions, "
                       "/v1/completions (streaming with \"stream\": true), /v1/models, /health, "
                       "/apply-template; the Anthropic Messages API at /v1/messages (and "
                       "/v1/messages/count_tokens); Prometheus metrics at /metrics. "
                       "Runs on uvloop when installed. "
                       "Responses carry llama.cpp-style timings plus expert hit rates and MB read. "
                       "Request limits: a body larger than --max-body is a 413, one that takes "
                       "longer than --body-timeout to arrive a 408 (a head slower than "
                       "--header-timeout is disconnected), one nested deeper than "
                       "--max-depth a 400 (strict JSON: no NaN/Infinity, no lone UTF-16 "
                       "surrogates); more than --max-waiting queued requests a 503 with "
                       "Retry-After.")
    p.add_argument("store")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (8080)")
    p.add_argument("--api-key", default=os.environ.get("EXPERTFS_API_KEY"),
                   help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY' on /v1/ "
                   "(or EXPERTFS_API_KEY)")
    p.add_argument("--model-id", help="the model name clients see (default: the store's name)")
    p.add_argument("--max-waiting", type=int, default=8,
                   help="requests that may queue behind the running one (8); more get 503")
    p.add_argument("--queue-timeout", type=float, default=300.0,
                   help="seconds a request may wait for the model (300)")
    p.add_argument("--max-body", type=size_arg, default=4 << 20,
                   help="largest request body accepted, e.g. 4M (4 MiB); larger is a 413")
    p.add_argument("--body-timeout", type=float, default=BODY_TIMEOUT,
                   help=f"seconds a request body may take to arrive ({BODY_TIMEOUT:g}); "
                   "slower is a 408")
    p.add_argument("--header-timeout", type=float, default=HEADER_TIMEOUT,
                   help=f"seconds a request's head (request line and headers) may take to "
                   f"arrive, an idle keep-alive connection included ({HEADER_TIMEOUT:g}); "
                   "slower connections are closed")
    p.add_argument("--max-depth", type=int, default=MAX_DEPTH,
                   help=f"deepest nesting of JSON arrays and objects in a body ({MAX_DEPTH}); "
                   "deeper is a 400")
    p.add_argument("--ram", type=size_arg, default=None, help="RAM tier for experts")
    p.add_argument("--vram", type=size_arg, default=0, help="VRAM tier for experts")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--ctx", type=int, default=4096, help="context length (4096)")
    p.add_argument("-t", "--threads", type=int, default=0, help="CPU threads")
    p.add_argument("--trunk", choices=("auto", "float", "quant"), default="auto",
                   help="dequantize trunk matrices at load (float) or keep them quantized")
    p.add_argument("--chat-template-file", metavar="FILE",
                   help="a Jinja chat template to use instead of the store's own")
    p.set_defaults(func=run)


def _event_loop():
    """A uvloop loop when uvloop is installed (the ``async`` extra), else asyncio's own."""
    import asyncio
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(args: argparse.Namespace) -> int:
    import torch
    from aiohttp import web

    from ..runtime.engine import Engine, EngineOptions
    from ..runtime.io.pages import expect_long_life
    from ..runtime.server import ServerConfig, build_app
    from ..runtime.server.session import Session
    from ..runtime.tokenizer.gguf import GGUFTokenizer
    from ._tiers import ram_and_lookahead
    from .run import _device

    if not 0 < args.port < 65536:
        raise UsageError(f"--port {args.port} is not a TCP port", fix="use 1..65535")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"expertfs serve: warning: listening on {args.host} without --api-key",
              file=sys.stderr)
    if args.max_body < 1 or args.body_timeout <= 0 or args.header_timeout <= 0 \
            or args.max_depth < 2:
        raise UsageError("--max-body, --body-timeout, --header-timeout and --max-depth must be "
                         "positive (--max-depth at least 2)", fix="e.g. --max-body 4M "
                         "--body-timeout 30 --header-timeout 30 --max-depth 64")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = _device(args.device)
    ram, look = ram_and_lookahead(args, device)
    opts = EngineOptions(device=device, n_ctx=args.ctx, trunk=args.trunk, **look,
                         trunk_stream=args.trunk_short, load_nextn=False)   # no drafts here
    expect_long_life()                  # huge pages: cleared by the warm start, read into often
    eng = Engine.open(args.store, ram_bytes=ram, vram_bytes=args.vram, options=opts)
    eng.start_warm()                    # the cache fills while no request is waiting
    try:
        tok = GGUFTokenizer(eng.kv, args.store)
        if args.chat_template_file:
            try:
                with open(args.chat_template_file, encoding="utf-8") as f:
                    tok.chat_template = f.read()
            except OSError as e:
                raise UsageError(f"--chat-template-file: {e}",
                                 fix="give a readable Jinja template file") from None
        name = args.model_id or os.path.basename(os.path.normpath(args.store))
        cfg = ServerConfig(name, api_key=args.api_key, max_waiting=args.max_waiting,
                           queue_timeout=args.queue_timeout, max_body=args.max_body,
                           body_timeout=args.body_timeout, max_depth=args.max_depth,
                           header_timeout=args.header_timeout)
        app = build_app(Session(eng, tok), cfg)
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
        print(f"expertfs serve: {name} on http://{args.host}:{args.port} "
              f"(OpenAI API under /v1; Ctrl-C stops)", file=sys.stderr)
        web.run_app(app, host=args.host, port=args.port, print=None, handle_signals=True,
                    loop=_event_loop())
    finally:
        eng.close()
    return 0
