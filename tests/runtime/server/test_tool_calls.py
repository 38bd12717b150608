"""Tool calls: each family's syntax parsed back into OpenAI calls (streamed a character at a
time too), calls written by the families' real chat templates read back, and the whole server
path (template with tools → scripted model output → ``tool_calls``, whole and streamed)."""

from __future__ import annotations

import asyncio
import json
import os
from types import SimpleNamespace

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer

from expertfs.runtime.engine import Engine, EngineOptions
from expertfs.runtime.server import ServerConfig, build_app
from expertfs.runtime.server.session import Session
from expertfs.runtime.server.tools import (DEEPSEEK, DEEPSEEK_R1, GLM, HARMONY, HERMES, ToolStream,
                                           assemble, parse_all, syntax_for)
from expertfs.runtime.tokenizer.gguf import GGUFTokenizer, render_chat

from serve_live import TEMPLATES, build_store, template  # noqa: E402

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}}}}]
CALL = {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}

OUTPUTS = [
    (HERMES, 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
             '{"city": "Paris", "days": 3}}\n</tool_call>', "Let me look.\n"),
    (GLM, "<think></think>\nSure.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
          "<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n"
          "</tool_call>", "<think></think>\nSure.\n"),
    (DEEPSEEK, "Hi<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
               '{"city": "Paris", "days": 3}<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "Hi"),
    (DEEPSEEK, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
               '```json\n{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', ""),
    (HARMONY, "<|channel|>analysis<|message|>Weather first.<|end|><|start|>assistant<|channel|>"
              'commentary to=functions.get_weather <|constrain|>json<|message|>'
              '{"city": "Paris", "days": 3}', ""),
]


def _calls(events):
    return [{"name": v["name"], "arguments": json.loads(v["arguments"])}
            for k, v in events if k == "tool"]


@pytest.mark.parametrize("syntax,text,content", OUTPUTS)
def test_each_family_parses_whole_and_streamed(syntax, text, content):
    whole = parse_all(syntax, TOOLS, text)
    assert _calls(whole) == [CALL]
    assert "".join(v for k, v in whole if k == "content") == content
    s, events = ToolStream(syntax, TOOLS), []
    for ch in text:
        events += s.push(ch)
    events += s.finish()
    assert _calls(assemble(events)) == [CALL]
    assert "".join(v for k, v in events if k == "content") == content
    kinds = [k for k, _ in events if k.startswith("tool")]
    assert kinds[0] == "tool_start" and kinds[-1] == "tool_end"     # the call streamed
    if syntax is not GLM:                   # GLM's arguments are not JSON as written
        assert kinds.count("tool_args") > 5                         # piece by piece


def test_text_that_is_not_a_call_is_kept():
    for text in ("a <tool here", "x <tool_call>not json</tool_call> after", "plain"):
        ev = parse_all(HERMES, TOOLS, text)
        assert "".join(v for _, v in ev) == text and not _calls(ev)


@pytest.mark.parametrize("name,syntax,takes_tools", [
    ("Qwen-Qwen3-0.6B.jinja", HERMES, True), ("GLM-4.6.jinja", GLM, True),
    ("deepseek-ai-DeepSeek-V3.1.jinja", DEEPSEEK, False),    # writes calls, lists no tools
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", DEEPSEEK_R1, False),
    ("openai-gpt-oss-120b.jinja", HARMONY, True)])
def test_a_call_the_real_template_writes_parses_back(name, syntax, takes_tools):
    src = template(name)
    assert syntax_for(src) is syntax
    user = [{"role": "user", "content": "Weather in Paris?"}]
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": CALL}]}
    prompt = render_chat(src, user, tools=TOOLS, add_generation_prompt=True)
    full = render_chat(src, user + [call], tools=TOOLS, add_generation_prompt=False)
    n = 0
    while n < min(len(prompt), len(full)) and prompt[n] == full[n]:
        n += 1
    if n and full[n - 1] == "<":                       # a marker both begin with "<"
        n -= 1
    assert ("get_weather" in prompt) == takes_tools     # the tools are rendered
    reply = full[n:]
    for end in ("<|im_end|>", "<｜end▁of▁sentence｜>", "<|call|>"):
        reply = reply.replace(end, "")
    assert _calls(parse_all(syntax, TOOLS, reply)) == [CALL]


class _Scripted:
    """An engine whose logits spell out ``script`` (token ids), then EOS."""

    def __init__(self, n_vocab: int, script: list[int], eos: int) -> None:
        self.n_vocab, self.script, self.eos, self.i, self.pos = n_vocab, script, eos, 0, 0
        self.options = SimpleNamespace(n_ctx=4096)
        self.provider = SimpleNamespace(stats=SimpleNamespace(bytes_read=0, requests=0, hits={}))

    def can_reset(self, pos):
        return True

    def reset(self, pos=0):
        self.i, self.pos = 0, pos

    def _next(self):
        t = self.script[self.i] if self.i < len(self.script) else self.eos
        self.i += 1
        lg = torch.full((self.n_vocab,), -10.0)
        lg[t] = 10.0
        return lg

    def prefill(self, ids):
        self.pos += len(ids)
        return self._next()

    def decode(self, t):
        self.pos += 1
        return self._next()


@pytest.fixture(scope="module")
def qwen_tok(tmp_path_factory):
    store = build_store(tmp_path_factory.mktemp("tools"))
    eng = Engine.open(store, provider="direct", options=EngineOptions(n_ctx=64))
    tok = GGUFTokenizer(eng.kv)
    eng.close()
    if not os.path.exists(f"{TEMPLATES}/Qwen-Qwen3-0.6B.jinja"):
        pytest.skip("llama.cpp's Qwen3 template is not here")
    tok.chat_template = template("Qwen-Qwen3-0.6B.jinja")
    return tok


@pytest.mark.parametrize("stream", [False, True])
def test_the_server_returns_tool_calls(qwen_tok, stream):
    tok = qwen_tok
    text = OUTPUTS[0][1]
    eos = tok.tokens.index("<|im_end|>")
    sess = Session(_Scripted(tok.n_vocab, tok.encode(text, add_bos=False), eos), tok)
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS,
            "max_tokens": 200, "temperature": 0, "stream": stream}

    async def go():
        app = build_app(sess, ServerConfig("tiny"))
        async with TestClient(TestServer(app)) as c:
            r = await c.post("/v1/chat/completions", json=body)
            return r.status, (await r.read()).decode()
    status, raw = asyncio.run(go())
    assert status == 200, raw
    if not stream:
        choice = json.loads(raw)["choices"][0]
        calls, content, finish = choice["message"]["tool_calls"], choice["message"]["content"], \
            choice["finish_reason"]
    else:
        events = [json.loads(x[6:]) for x in raw.split("\n\n") if x.startswith("data: {")]
        deltas = [e["choices"][0]["delta"] for e in events]
        pieces = [c for d in deltas for c in d.get("tool_calls", [])]
        assert all(c["index"] == 0 for c in pieces) and len(pieces) > 5   # arguments stream
        assert pieces[0]["function"] == {"name": "get_weather", "arguments": ""}
        assert all("id" not in c and "name" not in c["function"] for c in pieces[1:])
        calls = [{**pieces[0], "function": {"name": "get_weather", "arguments": "".join(
            c["function"]["arguments"] for c in pieces)}}]
        content = "".join(d.get("content") or "" for d in deltas)
        finish = events[-1]["choices"][0]["finish_reason"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] \
        == [("get_weather", CALL["arguments"])]
    assert calls[0]["id"].startswith("call_") and content == "Let me look.\n"
    assert finish == "tool_calls"


@pytest.mark.parametrize("parallel", [True, False])
def test_parallel_tool_calls_false_ends_the_reply_at_its_first_call(qwen_tok, parallel):
    from expertfs.runtime.server.schema import parse_chat
    tok = qwen_tok
    two = OUTPUTS[0][1] + "\n" + OUTPUTS[0][1].replace("Let me look.\n", "")
    script = tok.encode(two, add_bos=False)
    sess = Session(_Scripted(tok.n_vocab, script, tok.tokens.index("<|im_end|>")), tok)
    req = parse_chat({"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS,
                      "max_tokens": 400, "temperature": 0, "parallel_tool_calls": parallel})
    out = sess.run(req, sess.prompt_ids(req), lambda s: None, lambda: False)
    assert len(out.tool_calls) == (2 if parallel else 1) and out.finish_reason == "tool_calls"
    assert (out.completion_tokens < len(script)) == (not parallel)
