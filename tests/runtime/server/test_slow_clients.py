"""Slow and vanishing clients against the application on a loopback port, over a slow
scripted engine: a disconnect (streamed or not) cancels the generation within a token, a body
sent a byte at a time is cut off by ``body_timeout`` with a 408, a head sent a byte at a time (or
never) by ``header_timeout``, and the other clients are served meanwhile."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from types import SimpleNamespace

from aiohttp import ClientSession, ClientTimeout, web

from expertfs.runtime.server import ServerConfig, build_app
from expertfs.runtime.server.session import Session

from fuzz_serve import FastEngine, tiny_tokenizer

DELAY = 0.02                                   # seconds a token


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("slow"))


class Spy(Session):
    """A session that records each generation's outcome and whether it was told to stop."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.outcomes, self.cancel_seen = [], []

    def run(self, req, ids, emit, cancelled, on_delta=None):
        seen = []

        def watch():
            c = cancelled()
            if c and not seen:
                seen.append(self.engine.decodes)
            return c
        out = super().run(req, ids, emit, watch, on_delta)
        self.outcomes.append(out)
        self.cancel_seen.append(seen[0] if seen else None)
        return out


def _serve(tok, coro_fn, cancel_handlers=False, **cfg):
    """Serve as ``web.run_app`` does (handlers are not cancelled on a disconnect), or as
    aiohttp's test server does (they are) with ``cancel_handlers``."""
    sess = Spy(FastEngine(tok.n_vocab, n_ctx=512, delay=DELAY), tok)

    async def main():
        runner = web.AppRunner(build_app(sess, ServerConfig("tiny", **cfg)),
                               handler_cancellation=cancel_handlers, shutdown_timeout=1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            return await coro_fn(SimpleNamespace(port=port), sess)
        finally:
            await runner.cleanup()
    return asyncio.run(main()), sess


async def _idle(sess, n):
    for _ in range(500):
        if len(sess.outcomes) >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the generation did not end")


def _request(path, body, extra=b""):
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data + extra


@pytest.mark.parametrize("cancel_handlers", [False, True])
@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_cancels_its_generation_within_a_token(tok, stream,
                                                                         cancel_handlers):
    body = {"prompt": "hello", "max_tokens": 400, "temperature": 1, "stream": stream}

    async def go(server, sess):
        r, w = await asyncio.open_connection("127.0.0.1", server.port)
        w.write(_request("/v1/completions", body))
        await w.drain()
        if stream:
            got = b""
            while got.count(b"data: ") < 4:   # a few tokens have gone out
                got += await r.read(4096)
        else:
            while sess.engine.decodes < 3:
                await asyncio.sleep(DELAY)
        w.close()
        at_close = sess.engine.decodes
        await _idle(sess, 1)
        return at_close
    at_close, sess = _serve(tok, go, cancel_handlers)
    out = sess.outcomes[0]
    assert out.finish_reason == "cancelled"
    assert sess.cancel_seen[0] is not None            # the session's `cancelled` fired
    # the engine stopped within a token of the disconnect (one may be in flight)
    assert sess.engine.decodes <= at_close + 2 and out.completion_tokens < 100


def test_a_body_sent_a_byte_at_a_time_is_cut_off_and_others_are_served(tok):
    async def go(server, sess):
        r, w = await asyncio.open_connection("127.0.0.1", server.port)
        req = _request("/v1/completions", {"prompt": "slow", "max_tokens": 2})
        head, rest = req.split(b"\r\n\r\n", 1)
        w.write(head + b"\r\n\r\n")

        async def dribble():
            for b in rest:
                w.write(bytes([b]))
                await w.drain()
                await asyncio.sleep(0.05)

        feeder = asyncio.ensure_future(dribble())
        t0 = time.monotonic()
        async with ClientSession(timeout=ClientTimeout(total=10)) as c:
            async with c.post(f"http://127.0.0.1:{server.port}/v1/completions",
                              json={"prompt": "fast", "max_tokens": 3}) as other:
                other_status, other_s = other.status, time.monotonic() - t0
        answer = await asyncio.wait_for(r.read(4096), 10)
        slow_s = time.monotonic() - t0
        feeder.cancel()
        w.close()
        return other_status, other_s, answer, slow_s
    (other_status, other_s, answer, slow_s), _ = _serve(tok, go, body_timeout=0.6)
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408")
    err = json.loads(payload)["error"]
    assert err["code"] == "body_timeout" and "--body-timeout" in err["message"]
    assert 0.5 < slow_s < 5 and other_status == 200 and other_s < slow_s


@pytest.mark.parametrize("cancel_handlers", [False, True])
def test_a_client_gone_while_queued_never_runs_to_the_end(tok, cancel_handlers):
    """A queued request whose client left is cancelled at its first token, and the one behind
    it is served."""
    async def go(server, sess):
        url = f"http://127.0.0.1:{server.port}/v1/completions"
        async with ClientSession(timeout=ClientTimeout(total=20)) as c:
            first = asyncio.ensure_future(c.post(url, json={"prompt": "a", "max_tokens": 20}))
            await asyncio.sleep(0.1)
            r, w = await asyncio.open_connection("127.0.0.1", server.port)
            w.write(_request("/v1/completions", {"prompt": "b", "max_tokens": 400}))
            await w.drain()
            await asyncio.sleep(0.05)
            w.close()                                  # gone while waiting behind `first`
            third = await c.post(url, json={"prompt": "c", "max_tokens": 5})
            a = await first
            return a.status, third.status
    (a, c), sess = _serve(tok, go, cancel_handlers)
    assert (a, c) == (200, 200)
    if cancel_handlers:                                # its handler was cancelled in the queue
        assert [o.completion_tokens for o in sess.outcomes] == [20, 5]
    else:                                              # it runs, and stops at its first token
        assert [o.finish_reason for o in sess.outcomes] == ["length", "cancelled", "length"]
        assert sess.outcomes[1].completion_tokens <= 1


@pytest.mark.parametrize("idle", [False, True])
def test_a_head_sent_a_byte_at_a_time_or_never_is_cut_off_and_others_are_served(tok, idle):
    """Slowloris: a connection whose request line and headers do not arrive within
    ``header_timeout`` is closed, while other clients are answered meanwhile."""
    async def go(server, sess):
        r, w = await asyncio.open_connection("127.0.0.1", server.port)
        head = _request("/v1/completions", {"prompt": "slow", "max_tokens": 2}).split(b"\r\n\r\n")[0]

        async def dribble():
            try:
                for b in head if not idle else b"":
                    w.write(bytes([b]))
                    await w.drain()
                    await asyncio.sleep(0.05)
            except ConnectionResetError:         # hung up on mid-head
                return False
            return True

        feeder = asyncio.ensure_future(dribble())
        t0 = time.monotonic()
        async with ClientSession(timeout=ClientTimeout(total=10)) as c:
            for _ in range(3):
                async with c.post(f"http://127.0.0.1:{server.port}/v1/completions",
                                  json={"prompt": "fast", "max_tokens": 3}) as other:
                    assert other.status == 200
        other_s = time.monotonic() - t0
        try:
            answer = await asyncio.wait_for(r.read(4096), 10)   # b"": the server hung up
        except ConnectionResetError:
            answer = b""
        cut_s = time.monotonic() - t0
        sent = feeder.done() and feeder.result()
        feeder.cancel()
        w.close()
        return answer, cut_s, other_s, sent
    (answer, cut_s, other_s, sent), _ = _serve(tok, go, header_timeout=0.6)
    assert answer == b"" and 0.4 < cut_s < 5 and other_s < cut_s
    assert idle or not sent                  # cut off before its head was whole
