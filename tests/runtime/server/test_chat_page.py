"""The chat page at ``/``: served as UTF-8 HTML from the package's own file, self-contained
(inline script and style, nothing fetched from another origin, a Content-Security-Policy that
says so), calling only routes this server has, and reading only stream fields the server sends.
The page in a real browser is ``test_chat_page_browser.py`` (opt-in)."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

import expertfs.runtime.server as server_pkg
from expertfs.runtime.engine import Engine, EngineOptions
from expertfs.runtime.server import ServerConfig, build_app
from expertfs.runtime.server.session import Session
from expertfs.runtime.tokenizer.gguf import GGUFTokenizer

from serve_live import build_store  # noqa: E402

PAGE = Path(server_pkg.__file__).parent / "static" / "chat.html"
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = Engine.open(build_store(tmp_path_factory.mktemp("page")), provider="direct",
                      options=EngineOptions(n_ctx=256))
    yield eng
    eng.close()


def _run(engine, go, **cfg):
    async def main():
        app = build_app(Session(engine, GGUFTokenizer(engine.kv)), ServerConfig("tiny", **cfg))
        async with TestClient(TestServer(app)) as client:
            return await go(client)
    return asyncio.run(main())


def _script(html: str) -> str:
    scripts = re.findall(r"<script>(.*?)</script>", html, re.S)
    assert len(scripts) == 1
    return scripts[0]


def _endpoints(js: str) -> dict[str, str]:
    m = re.search(r"const API = \{([^}]*)\}", js)
    assert m, "the page names its endpoints in one API object"
    return dict(re.findall(r'(\w+): "([^"]*)"', m.group(1)))


def test_root_serves_the_page_as_utf8_html(engine):
    async def go(c):
        r = await c.get("/")
        return r.status, r.headers, await r.read()
    status, headers, body = _run(engine, go)
    assert status == 200
    assert headers["Content-Type"] == "text/html; charset=utf-8"
    assert body == PAGE.read_bytes()
    csp = headers["Content-Security-Policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    assert body.decode("utf-8").lstrip().startswith("<!DOCTYPE html>")


def test_the_page_is_self_contained_and_same_origin():
    html = PAGE.read_text(encoding="utf-8")
    assert "://" not in html, "no absolute URL (no CDN, no other origin)"
    assert not re.search(r"""(?:src|href|action)\s*=\s*"(?!data:)|@import|url\(|"""
                         r"""new\s+(?:WebSocket|EventSource)|XMLHttpRequest|import\(""", html), \
        "no external script, style, image, font or socket"
    js = _script(html)
    api = _endpoints(js)
    assert set(api) == {"chat", "health"}
    for path in api.values():
        assert path.startswith("/") and not path.startswith("//")
    calls = re.findall(r"fetch\(([^,)]*)", js)
    assert calls and all(c.strip() in {f"API.{k}" for k in api} for c in calls), calls


def test_the_page_endpoints_are_routes_and_read_what_the_stream_sends(engine):
    """Each endpoint answers; every ``timings`` field the page reads is in the last chunk."""
    js = _script(PAGE.read_text(encoding="utf-8"))
    api = _endpoints(js)
    read = set(re.findall(r"\bt\.(\w+)", js))
    assert {"predicted_per_second", "expert_hit_rate"} <= read

    async def go(c):
        h = await (await c.get(api["health"])).json()
        r = await c.post(api["chat"], json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0})
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        events = [ln[6:] for ln in (await r.text()).split("\n\n") if ln.startswith("data: ")]
        return h, events
    health, events = _run(engine, go)
    assert health["auth"] is False and health["model"] == "tiny"
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"][0]["finish_reason"] in ("stop", "length")
    assert read <= set(last["timings"]), read - set(last["timings"])
    assert isinstance(last["timings"]["expert_hit_rate"], dict)


def test_with_a_key_the_page_is_public_and_the_api_is_not(engine):
    async def go(c):
        page = await c.get("/")
        h = await (await c.get("/health")).json()
        r = await c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True})
        return page.status, h, r.status, await r.json()
    page, health, status, body = _run(engine, go, api_key="sekrit")
    assert page == 200 and health["auth"] is True
    assert status == 401 and "API key" in body["error"]["message"]


def test_the_page_ships_in_the_package():
    """Package data names the page; selenium is the browser extra's, not the test extra's."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11's")
    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)
    data = project["tool"]["setuptools"]["package-data"]["expertfs.runtime.server"]
    rel = PAGE.relative_to(Path(server_pkg.__file__).parent).as_posix()
    assert any(Path(rel).match(g) for g in data)
    extras = project["project"]["optional-dependencies"]
    assert any(d.startswith("selenium") for d in extras["browser"])
    assert not any(d.startswith("selenium") for d in extras["test"])
