"""``expertfs serve``'s application on a real engine over a tiny synthesised store: OpenAI
responses, streaming, prefix reuse, auth, a bounded queue, and 4xx JSON for bad requests."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from expertfs.store.repack import repack
from expertfs.runtime.engine import Engine, EngineOptions
from expertfs.runtime.server import ServerConfig, build_app
from expertfs.runtime.server.session import Session, StopMatcher
from expertfs.runtime.tokenizer.gguf import GGUFTokenizer
from expertfs.synth import SynthConfig, synthesize


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("serve")
    g = synthesize(SynthConfig.tiny("qwen3moe"), str(d / "m.gguf"))
    repack(g, str(d / "m.efs"))
    return str(d / "m.efs")


@pytest.fixture(scope="module")
def engine(store):
    eng = Engine.open(store, provider="direct", options=EngineOptions(n_ctx=256))
    yield eng
    eng.close()


def _run(engine, coro_fn, **cfg):
    async def main():
        tok = GGUFTokenizer(engine.kv)
        app = build_app(Session(engine, tok), ServerConfig("tiny", **cfg))
        async with TestClient(TestServer(app)) as client:
            return await coro_fn(client)
    return asyncio.run(main())


def test_health_models_and_chat(engine):
    async def go(c):
        h = await (await c.get("/health")).json()
        m = await (await c.get("/v1/models")).json()
        r = await c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0})
        return h, m, r.status, await r.json()
    h, m, status, body = _run(engine, go)
    assert h["status"] == "ok" and m["data"][0]["id"] == "tiny"
    assert status == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] <= 6
    t = body["timings"]
    for k in ("prompt_n", "prompt_per_second", "predicted_n", "predicted_per_second",
              "expert_hit_rate", "mb_read"):
        assert k in t


def test_stream_equals_whole_and_prefix_is_reused(engine):
    req = {"prompt": "Beautiful is better than", "max_tokens": 8, "temperature": 0}

    async def go(c):
        whole = await (await c.post("/v1/completions", json=req)).json()
        r = await c.post("/v1/completions", json={**req, "stream": True,
                                                   "stream_options": {"include_usage": True}})
        raw = (await r.read()).decode()
        return whole, raw
    whole, raw = _run(engine, go)
    events = [json.loads(line[6:]) for line in raw.split("\n\n") if line.startswith("data: {")]
    assert raw.strip().endswith("data: [DONE]")
    text = "".join(e["choices"][0]["text"] for e in events)
    assert text == whole["choices"][0]["text"]
    assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert events[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    # the second identical prompt reuses every prompt token but the last from the KV cache
    assert events[-1]["timings"]["cache_n"] == whole["usage"]["prompt_tokens"] - 1


@pytest.mark.parametrize("body,status,param", [
    ("not json", 400, None),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 3}, 400, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "model": "other"}, 404, "model"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}, 400, "max_tokens"),
    ([1, 2, 3], 400, None),
])
def test_bad_requests_are_4xx_json(engine, body, status, param):
    async def go(c):
        data = body if isinstance(body, str) else json.dumps(body)
        r = await c.post("/v1/chat/completions", data=data)
        return r.status, await r.json()
    st, err = _run(engine, go)
    assert st == status and err["error"]["param"] == param and err["error"]["message"]


def test_unknown_route_and_method(engine):
    async def go(c):
        a = await c.get("/v2/whatever")
        b = await c.get("/v1/chat/completions")
        return a.status, b.status, await b.json()
    a, b, body = _run(engine, go)
    assert a == 404 and b in (404, 405) and "error" in body


def test_api_key(engine):
    async def go(c):
        no = await c.get("/v1/models")
        bad = await c.get("/v1/models", headers={"Authorization": "Bearer nope"})
        ok = await c.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
        health = await c.get("/health")
        return no.status, bad.status, ok.status, health.status
    assert _run(engine, go, api_key="s3cret") == (401, 401, 200, 200)


def test_queue_bound_refuses_with_503(engine):
    async def go(c):
        req = {"prompt": "x", "max_tokens": 24, "temperature": 0}
        tasks = [asyncio.create_task(c.post("/v1/completions", json=req)) for _ in range(6)]
        rs = await asyncio.gather(*tasks)
        return sorted(r.status for r in rs), [await r.json() for r in rs]
    statuses, bodies = _run(engine, go, max_waiting=1)
    assert statuses.count(200) >= 2 and set(statuses) <= {200, 503}
    assert any(s == 503 for s in statuses)
    assert all("error" in b for b, s in zip(bodies, statuses) if s == 503)


def test_stop_matcher_holds_back_partial_stops():
    m = StopMatcher(["END"])
    out = []
    for piece in ["he", "llo E", "N", "D more"]:
        text, hit = m.push(piece)
        out.append(text)
        if hit:
            break
    assert "".join(out) == "hello " and hit


def test_a_prompt_prefix_is_reused_only_where_the_engine_can_go_back():
    """A recurrent state that cannot rewind to the shared prefix is re-run from 0."""
    from types import SimpleNamespace

    from expertfs.runtime.server.session import Session

    class Eng:
        def __init__(self, rewind: bool) -> None:
            self.rewind, self.calls = rewind, []
            self.provider = SimpleNamespace(stats=SimpleNamespace(bytes_read=0, requests=0,
                                                                  hits={}))

        def can_reset(self, pos):
            return self.rewind or pos == 0

        def reset(self, pos=0):
            self.calls.append(("reset", pos))

        def prefill(self, ids):
            self.calls.append(("prefill", len(ids)))
            raise RuntimeError("stop here")

    for rewind, keep in ((True, 3), (False, 0)):
        eng = Eng(rewind)
        s = Session(eng, SimpleNamespace())
        s.cached = [1, 2, 3, 4]
        with pytest.raises(RuntimeError, match="stop here"):
            s.run(SimpleNamespace(), [1, 2, 3, 9, 9], lambda _: None, lambda: False)
        assert eng.calls == [("reset", keep), ("prefill", 5 - keep)]
