"""Overload over a slow scripted engine: more concurrent requests than the queue holds get a
503 with ``Retry-After`` at once, every request gets exactly one answer, each admitted one runs
exactly once, and the server is idle and serving again afterwards."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from expertfs.runtime.server import ServerConfig, build_app
from expertfs.runtime.server.session import Session

from fuzz_serve import FastEngine, tiny_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("overload"))


class Counting(Session):
    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.runs: list[str] = []

    def run(self, req, ids, emit, cancelled, on_delta=None):
        self.runs.append(req.prompt)
        return super().run(req, ids, emit, cancelled, on_delta)


def _serve(tok, coro_fn, **cfg):
    sess = Counting(FastEngine(tok.n_vocab, n_ctx=256, delay=0.01), tok)

    async def main():
        async with TestClient(TestServer(build_app(sess, ServerConfig("tiny", **cfg)))) as c:
            return await coro_fn(c)
    return asyncio.run(main()), sess


@pytest.mark.parametrize("stream", [False, True])
def test_more_requests_than_the_queue_holds(tok, stream):
    n, waiting, tokens = 16, 3, 8

    async def one(c, i):
        async with c.post("/v1/completions", json={
                "prompt": f"request {i}", "max_tokens": tokens, "temperature": 0,
                "stream": stream}) as r:
            return i, r.status, dict(r.headers), await r.read()

    async def go(c):
        answers = await asyncio.gather(*(one(c, i) for i in range(n)))
        health = await (await c.get("/health")).json()
        again = await c.post("/v1/completions", json={"prompt": "after", "max_tokens": 2})
        return answers, health, again.status
    (answers, health, again), sess = _serve(tok, go, max_waiting=waiting)
    assert sorted(i for i, *_ in answers) == list(range(n))            # one answer each
    ok = [i for i, s, _, _ in answers if s == 200]
    busy = [(i, h, raw) for i, s, h, raw in answers if s == 503]
    assert len(ok) + len(busy) == n and waiting + 1 <= len(ok) < n
    for _, h, raw in busy:
        err = json.loads(raw)["error"]
        assert h["Retry-After"] == "1" and err["code"] == "server_busy" and err["message"]
    # each admitted request ran exactly once, none refused ran at all
    assert sorted(sess.runs[:len(ok)]) == sorted(f"request {i}" for i in ok)
    for i, s, h, raw in answers:
        if s == 200 and not stream:
            assert json.loads(raw)["usage"]["completion_tokens"] == tokens
        elif s == 200:
            assert raw.decode().rstrip().endswith("data: [DONE]")
    assert health["busy"] is False and health["waiting"] == 0 and again == 200
    assert sess.runs[-1] == "after" and len(sess.runs) == len(ok) + 1


def test_a_request_that_waits_past_the_queue_timeout_is_a_503(tok):
    async def go(c):
        slow = asyncio.ensure_future(c.post("/v1/completions",
                                            json={"prompt": "long", "max_tokens": 60}))
        await asyncio.sleep(0.1)
        r = await c.post("/v1/completions", json={"prompt": "late", "max_tokens": 2})
        late = r.status, r.headers.get("Retry-After"), (await r.json())["error"]["code"]
        return (await slow).status, late
    (first, late), sess = _serve(tok, go, queue_timeout=0.2)
    assert first == 200 and late == (503, "1", "queue_timeout") and sess.runs == ["long"]


class Failing(Session):
    """A store that cannot be read mid-request: the typed read error, as the reader raises it."""

    def run(self, req, ids, emit, cancelled, on_delta=None):
        from expertfs.runtime.io.errors import IOFaultError
        raise IOFaultError("EIO", path="experts.bin", offset=0, size=4096, attempts=3,
                           layer=3, expert=7)


@pytest.mark.parametrize("stream", [False, True])
def test_a_store_read_failure_is_a_503_naming_it_not_a_500(tok, stream):
    sess = Failing(FastEngine(tok.n_vocab, n_ctx=256), tok)

    async def main():
        async with TestClient(TestServer(build_app(sess, ServerConfig("tiny")))) as c:
            r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2,
                                                      "stream": stream})
            return r.status, await r.text()
    status, body = asyncio.run(main())
    if stream:                              # headers were sent: the error is in the stream
        assert status == 200 and '"storage_error"' in body and "layer 3, expert 7" in body
    else:
        assert status == 503
        err = json.loads(body)["error"]
        assert err["code"] == "storage_error" and "layer 3, expert 7" in err["message"]
