"""Request fuzzing (``tools/fuzz_serve.py``'s strategies, a few seeded examples per endpoint):
every answer a 2xx or an OpenAI-shaped 4xx, never a 5xx, a hang or a dead server; and the
cases the fuzzing found, pinned: deep nesting, lone surrogates, NaN, huge numbers and bodies."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings

from expertfs.runtime.server.body import MAX_DEPTH
from expertfs.runtime.server.session import Session

from fuzz_serve import ENDPOINTS, FastEngine, Harness, cases, tiny_tokenizer

CHAT = "/v1/chat/completions"
MSG = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("fuzz"))


@pytest.fixture(scope="module")
def harness(tok):
    h = Harness(Session(FastEngine(tok.n_vocab), tok), timeout=20)
    yield h
    h.close()


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_fuzzed_requests_never_fail_the_server(harness, endpoint):
    harness.failures.clear()

    @settings(max_examples=40, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=cases(endpoint))
    def one(case):
        harness.send(case)
    one()
    assert harness.failures == []
    assert harness.alive()


def _post(h, data, path=CHAT, ctype="application/json"):
    async def go():
        async with h.client.post(path, data=data, headers={"Content-Type": ctype}) as r:
            return r.status, r.headers, await r.read()
    return h.loop.run_until_complete(go())


def _err(h, data, path=CHAT):
    status, _, raw = _post(h, data, path)
    return status, json.loads(raw)["error"]


@pytest.mark.parametrize("opener", ["[", "{"])
def test_a_body_nested_5000_deep_is_a_400_naming_the_limit(harness, opener):
    data = ("[" * 5000 + "]" * 5000) if opener == "[" else ('{"a":' * 5000 + "1" + "}" * 5000)
    status, err = _err(harness, data.encode())
    assert status == 400 and err["code"] == "body_too_deep" and str(MAX_DEPTH) in err["message"]


def test_nesting_at_the_limit_passes_and_one_past_it_is_refused(harness):
    def body(depth):                  # the body object itself is level 1
        return json.dumps({**MSG, "metadata": json.loads('{"a":' * (depth - 2) + "{}" + "}" * (depth - 2))})
    assert _post(harness, body(MAX_DEPTH).encode())[0] == 200
    status, err = _err(harness, body(MAX_DEPTH + 1).encode())
    assert status == 400 and err["code"] == "body_too_deep"


@pytest.mark.parametrize("path,body,param", [
    (CHAT, {"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages[0].content"),
    ("/v1/completions", {"prompt": "\udfff"}, "prompt"),
    ("/apply-template", {"messages": [{"role": "user", "content": [{"type": "text",
                                                                     "text": "\ud83d"}]}]},
     "messages[0].content[0].text"),
])
def test_a_lone_surrogate_is_a_400_naming_where_it_is(harness, path, body, param):
    status, err = _err(harness, json.dumps(body).encode(), path)   # ensure_ascii: "\ud800"
    assert status == 400 and err["code"] == "invalid_unicode" and err["param"] == param
    assert "surrogate" in err["message"]


@pytest.mark.parametrize("data,code", [
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "invalid_json"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}', "invalid_json"),
    (b'{"max_tokens": 1' + b"0" * 5000 + b"}", "invalid_json"),
    (b'{"messages": [{"role": "user", "content": "caf\xc3"}]}', "invalid_json"),
    (b'{"messages": [{"role": "user", "content": "hi"}]', "invalid_json"),
])
def test_strict_json(harness, data, code):
    status, err = _err(harness, data)
    assert status == 400 and err["code"] == code and err["message"]


def test_a_duplicate_key_keeps_its_last_value(harness):
    data = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 99999, "max_tokens": 3}'
    status, _, raw = _post(harness, data)
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] <= 3


def test_a_body_over_the_limit_is_a_413_naming_it(harness):
    big = json.dumps({"messages": [{"role": "user", "content": "x" * (2 << 20)}]}).encode()
    status, err = _err(harness, big)
    assert status == 413 and err["code"] == "body_too_large" and "--max-body" in err["message"]


def test_a_text_far_longer_than_the_context_is_refused_before_tokenizing(harness):
    status, err = _err(harness, json.dumps({"prompt": "ab " * 300000}).encode(), "/v1/completions")
    assert status == 400 and err["code"] == "context_length_exceeded"


def test_the_limits_are_documented_in_serve_help():
    import argparse

    from expertfs.cli import serve
    from expertfs.runtime.server.body import BODY_TIMEOUT
    ap = argparse.ArgumentParser()
    serve.register(ap.add_subparsers())
    text = ap._subparsers._group_actions[0].choices["serve"].format_help()
    for flag in ("--max-body", "--body-timeout", "--max-depth", "--max-waiting"):
        assert flag in text
    assert (serve.BODY_TIMEOUT, serve.MAX_DEPTH) == (BODY_TIMEOUT, MAX_DEPTH)
    from expertfs.runtime.server.body import HEADER_TIMEOUT
    if hasattr(serve, "HEADER_TIMEOUT"):       # once serve has --header-timeout
        assert serve.HEADER_TIMEOUT == HEADER_TIMEOUT and "--header-timeout" in text


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-40])
def test_a_tiny_temperature_is_not_a_500(harness, temperature):
    status, _, raw = _post(harness, json.dumps({**MSG, "temperature": temperature}).encode())
    assert status == 200, raw[:300]
