"""The official ``anthropic`` client against ``/v1/messages``: a live ``expertfs serve`` on a tiny
synthesised store (whole and streamed replies, stop sequences, token counting, the key in
``x-api-key`` or ``Authorization: Bearer``, errors in Anthropic's shape naming the field), and
the application on a loopback thread over a scripted model with a real Qwen3 template (tool_use
blocks whole and streamed, tool results going back through the template)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import urllib.request

import pytest

from expertfs.runtime.server import ServerConfig, build_app
from expertfs.runtime.server.anthropic import parse_messages
from expertfs.runtime.server.session import Session

from serve_live import build_store, live_server  # noqa: E402
from test_tool_calls import OUTPUTS, _Scripted, qwen_tok  # noqa: E402, F401

anthropic = pytest.importorskip("anthropic")

MSG = [{"role": "user", "content": "Beautiful is better than ugly. Explicit is"}]
TOOL = {"name": "get_weather", "description": "The weather in a city",
        "input_schema": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}}}}
KEY = "s3cret"
T0 = {"temperature": 0}                 # the client no longer has it as an argument


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with live_server(build_store(tmp_path_factory.mktemp("anthropic-live")), "--api-key", KEY) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0, timeout=120)


def test_a_whole_message(client):
    r = client.messages.create(model="m.efs", messages=MSG, max_tokens=6, extra_body=T0)
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    assert [b.type for b in r.content] in (["text"], [])
    assert r.stop_reason in ("end_turn", "max_tokens") and r.stop_sequence is None
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 6


def test_a_stream_gives_the_same_text_in_events_in_order(client):
    kw = dict(model="m.efs", messages=MSG, max_tokens=8, extra_body=T0)
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == "".join(b.text for b in whole.content) == "".join(b.text for b in final.content)
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens
    events = [e.type for e in client.messages.create(stream=True, **kw)]
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    blocks = [e for e in events if e.startswith("content_block")]
    assert blocks[0] == "content_block_start" and blocks[-1] == "content_block_stop"


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_sequence_ends_the_reply_and_is_named(client, stream):
    base = client.messages.create(model="m.efs", messages=MSG, max_tokens=16, extra_body=T0)
    text = "".join(b.text for b in base.content)
    stop = next(text[i:i + 2] for i in range(2, len(text) - 2) if text[i:i + 2].strip())
    kw = dict(model="m.efs", messages=MSG, max_tokens=16, extra_body=T0, stop_sequences=[stop])
    if stream:
        with client.messages.stream(**kw) as s:
            r = s.get_final_message()
    else:
        r = client.messages.create(**kw)
    assert "".join(b.text for b in r.content) == text[:text.index(stop)]
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop


def test_system_as_text_or_blocks_and_count_tokens(client):
    a = client.messages.create(model="m.efs", system="Be brief.", messages=MSG, max_tokens=1)
    b = client.messages.create(model="m.efs", messages=MSG, max_tokens=1, system=[
        {"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}])
    n = client.messages.count_tokens(model="m.efs", system="Be brief.", messages=MSG)
    plain = client.messages.count_tokens(model="m.efs", messages=MSG)
    assert a.usage.input_tokens == b.usage.input_tokens == n.input_tokens > plain.input_tokens


def test_the_key_in_either_header(server):
    bearer = anthropic.Anthropic(base_url=server, auth_token=KEY, api_key=None, max_retries=0)
    assert bearer.messages.create(model="m.efs", messages=MSG, max_tokens=1).type == "message"
    wrong = anthropic.Anthropic(base_url=server, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(model="m.efs", messages=MSG, max_tokens=1)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("kw,name", [
    ({"extra_body": {"logit_bias": {"1": 2}}}, "logit_bias"),
    ({"extra_body": {"mcp_servers": []}}, "mcp_servers"),
    ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "other"}}, "tool_choice"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),                    # no tools to call
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"extra_body": {"temperature": 1.5}}, "temperature"),
    ({"output_config": {"effort": "low"}}, "output_config"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0]"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]"),
])
def test_unsupported_or_bad_fields_are_400s_naming_them(client, kw, name):
    args = {"model": "m.efs", "messages": MSG, "max_tokens": 2, **kw}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**args)
    body = e.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert name in body["error"]["message"]


def test_missing_max_tokens_and_a_wrong_model(server):
    def post(body):
        req = urllib.request.Request(server + "/v1/messages", data=json.dumps(body).encode(),
                                     headers={"x-api-key": KEY, "Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=60)
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())
    status, body = post({"model": "m.efs", "messages": MSG})
    assert status == 400 and "max_tokens" in body["error"]["message"]
    status, body = post({"model": "other", "messages": MSG, "max_tokens": 1})
    assert status == 404 and body["error"]["type"] == "not_found_error"


def test_metrics_of_the_live_server_parse(server, client):
    parser = pytest.importorskip("prometheus_client.parser")
    client.messages.create(model="m.efs", messages=MSG, max_tokens=2)
    text = urllib.request.urlopen(server + "/metrics", timeout=30).read().decode()
    fams = {f.name: f for f in parser.text_string_to_metric_families(text)}
    served = [s for s in fams["expertfs_requests"].samples
              if s.labels.get("endpoint") == "/v1/messages" and s.labels["status"] == "200"]
    assert served and served[0].value >= 1
    assert fams["expertfs_expert_requests"].samples[0].value > 0       # a real engine ran
    assert {s.labels["tier"] for s in fams["expertfs_expert_hit_rate"].samples}


# ---- tool use, over a scripted model with Qwen3's template ----------------------------------

@contextlib.contextmanager
def threaded(app):
    """``app`` served on a free loopback port by a thread's event loop."""
    from aiohttp import web
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        t.join(30)
        loop.close()


@pytest.fixture(scope="module")
def tool_client(qwen_tok):  # noqa: F811
    tok = qwen_tok
    eos = tok.tokens.index("<|im_end|>")
    sess = Session(_Scripted(tok.n_vocab, tok.encode(OUTPUTS[0][1], add_bos=False), eos), tok)
    with threaded(build_app(sess, ServerConfig("tiny"))) as url:
        yield anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=60)


def _check_tool_reply(r):
    assert [b.type for b in r.content] == ["text", "tool_use"]
    assert r.content[0].text == "Let me look.\n"
    use = r.content[1]
    assert use.name == "get_weather" and use.input == {"city": "Paris", "days": 3}
    assert use.id.startswith("toolu_") and r.stop_reason == "tool_use"


def test_a_tool_call_is_a_tool_use_block(tool_client):
    _check_tool_reply(tool_client.messages.create(
        model="tiny", max_tokens=200, extra_body=T0, tools=[TOOL],
        messages=[{"role": "user", "content": "Weather in Paris?"}]))


def test_a_streamed_tool_call_arrives_as_input_json_deltas(tool_client):
    kw = dict(model="tiny", max_tokens=200, extra_body=T0, tools=[TOOL],
              messages=[{"role": "user", "content": "Weather in Paris?"}])
    with tool_client.messages.stream(**kw) as s:
        final = s.get_final_message()
    _check_tool_reply(final)
    events = list(tool_client.messages.create(stream=True, **kw))
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    parts = [d.partial_json for d in deltas if d.type == "input_json_delta"]
    assert len(parts) > 3 and json.loads("".join(parts)) == {"city": "Paris", "days": 3}
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["text", "tool_use"]


def test_tool_use_and_results_go_back_through_the_template(qwen_tok):  # noqa: F811
    body = {"max_tokens": 8, "tools": [TOOL], "system": "You help.", "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "sunny, 21 C"}]},
            {"type": "text", "text": "And tomorrow?"}]}]}
    req, _ = parse_messages(body)
    assert [m["role"] for m in req.messages] == ["system", "user", "assistant", "tool", "user"]
    prompt = Session(None, qwen_tok).render(req)
    assert prompt.startswith("<|im_start|>system\nYou help.") and '"name": "get_weather"' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
    assert prompt.index("sunny") < prompt.index("And tomorrow?")
