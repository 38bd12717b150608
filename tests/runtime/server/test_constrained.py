"""Constrained decoding over a model that knows nothing: seeded random logits over the tiny
synthesised tokenizer (``FastEngine``), so only the grammar's mask can make the output valid.

``tool_choice`` ``required`` and a named function always give a call of a tool that was offered,
whose arguments ``jsonschema`` accepts against the tool's ``parameters``, in each family's syntax
as its real chat template (llama.cpp's copies) teaches it; ``none`` offers no tools and parses
no calls. ``response_format`` ``json_schema`` always parses and matches its schema,
``json_object`` is always an object; ``logit_bias`` moves the choice as the API defines. The
official ``openai`` client drives the in-process application on a loopback thread."""

from __future__ import annotations

import json

import pytest

from expertfs.runtime.server import ServerConfig, build_app, grammar
from expertfs.runtime.server.schema import RequestError, parse_chat
from expertfs.runtime.server.session import Session

from fuzz_serve import FastEngine, tiny_tokenizer
from serve_live import template  # noqa: E402
from test_anthropic_client import threaded  # noqa: E402
from test_tool_calls import _Scripted  # noqa: E402

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
if not grammar.available():
    pytest.skip("llguidance (the serve extra) is not installed", allow_module_level=True)

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time",
                                           "parameters": {"type": "object", "properties": {
                                               "zone": {"enum": ["UTC", "CET"]}},
                                               "required": ["zone"], "additionalProperties": False}}}]
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    "ok": {"type": "boolean"}}, "required": ["name", "age", "ok"], "additionalProperties": False}
USER = [{"role": "user", "content": "hi"}]
FAMILIES = ["Qwen-Qwen3-0.6B.jinja", "GLM-4.6.jinja", "openai-gpt-oss-120b.jinja"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("constrained"))


def _run(tok, body, seed=0):
    sess = Session(FastEngine(tok.n_vocab, n_ctx=4096, seed=seed), tok)
    req = parse_chat({"messages": USER, "max_tokens": 300, "temperature": 1, "seed": seed, **body})
    return sess.run(req, sess.prompt_ids(req), lambda s: None, lambda: False)


def _schema_of(name):
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_time"}}])
def test_a_forced_call_is_always_a_valid_call(tok, family, choice):
    tok.chat_template = template(family)
    names = set()
    for seed in range(6):
        out = _run(tok, {"tools": TOOLS, "tool_choice": choice}, seed)
        assert out.finish_reason == "tool_calls" and len(out.tool_calls) == 1, out
        fn = out.tool_calls[0]["function"]
        if isinstance(choice, dict):
            assert fn["name"] == "get_time"
        names.add(fn["name"])
        jsonschema.validate(json.loads(fn["arguments"]), _schema_of(fn["name"]))
        assert out.content.strip() == ""
    assert choice != "required" or names <= {"get_weather", "get_time"}


def test_none_offers_no_tools_and_parses_no_calls(tok):
    tok.chat_template = template("Qwen-Qwen3-0.6B.jinja")
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
    eos = tok.tokens.index("<|im_end|>")
    sess = Session(_Scripted(tok.n_vocab, tok.encode(call, add_bos=False), eos), tok)
    plain = sess.render(parse_chat({"messages": USER}))
    req = parse_chat({"messages": USER, "tools": TOOLS, "tool_choice": "none", "max_tokens": 99,
                      "temperature": 0})
    assert sess.render(req) == plain
    out = sess.run(req, sess.prompt_ids(req), lambda s: None, lambda: False)
    assert out.tool_calls == [] and out.content == call and out.finish_reason == "stop"


def test_a_forced_call_opens_the_assistant_turn_in_the_prompt(tok):
    tok.chat_template = template("Qwen-Qwen3-0.6B.jinja")
    sess = Session(None, tok)
    named = parse_chat({"messages": USER, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}})
    assert sess.render(named).endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": ')
    assert sess.render(parse_chat({"messages": USER, "tools": TOOLS, "tool_choice": "required"})
                       ).endswith('<|im_start|>assistant\n<tool_call>\n{"name": "')


def test_json_schema_output_always_parses_and_matches(tok):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for seed in range(12):
        out = _run(tok, {"response_format": fmt}, seed)
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.content), PERSON)


def test_json_object_output_is_an_object(tok):
    done = 0
    for seed in range(8):
        out = _run(tok, {"response_format": {"type": "json_object"}, "max_tokens": 120}, seed)
        if out.finish_reason == "stop":            # a random model may write a long string
            assert isinstance(json.loads(out.content), dict)
            done += 1
        else:
            assert out.content.startswith("{")
    assert done >= 4


def test_logit_bias_forces_and_bans_tokens(tok):
    favour = tok.encode(" often", add_bos=False)[0]
    out = _run(tok, {"logit_bias": {str(favour): 100}, "max_tokens": 6, "logprobs": True})
    assert out.content == tok.decode([favour] * 6)
    base = _run(tok, {"max_tokens": 1, "temperature": 0, "logprobs": True})
    first = tok.encode(base.content, add_bos=False)[0]
    banned = _run(tok, {"max_tokens": 1, "temperature": 0, "logit_bias": {str(first): -100}})
    assert banned.content and tok.encode(banned.content, add_bos=False)[0] != first


@pytest.mark.parametrize("bias", [{"1" * 5000: 1}, {"²": 1}, {"-1": 2}, {"1": 100.5},
                                  {"3": True}, {"3": "5"}, [1], "x"])
def test_a_bad_logit_bias_is_a_400_naming_it(bias):
    with pytest.raises(RequestError) as e:
        parse_chat({"messages": USER, "logit_bias": bias})
    assert e.value.status == 400 and e.value.param == "logit_bias" and len(e.value.message) < 200


def test_without_the_grammar_library_it_is_a_400_naming_the_parameter(tok, monkeypatch):
    monkeypatch.setattr(grammar, "_llg", None)
    tok.chat_template = template("Qwen-Qwen3-0.6B.jinja")
    sess = Session(FastEngine(tok.n_vocab, n_ctx=4096), tok)
    for body, param in [({"response_format": {"type": "json_object"}}, "response_format"),
                        ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice")]:
        with pytest.raises(RequestError) as e:
            sess.prompt_ids(parse_chat({"messages": USER, **body}))
        assert e.value.status == 400 and e.value.param == param and "llguidance" in e.value.message


@pytest.fixture(scope="module")
def url(tok):
    tok.chat_template = template("Qwen-Qwen3-0.6B.jinja")
    with threaded(build_app(Session(FastEngine(tok.n_vocab, n_ctx=4096), tok),
                            ServerConfig("tiny"))) as url:
        yield url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_the_anthropic_client_gets_a_forced_tool_use(url, choice):
    c = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=60)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    kw = dict(model="tiny", max_tokens=200, tools=tools, tool_choice=choice,
              messages=[{"role": "user", "content": "hi"}])
    with c.messages.stream(**kw) as s:
        streamed = s.get_final_message()
    for r in (c.messages.create(**kw), streamed):
        uses = [b for b in r.content if b.type == "tool_use"]
        assert r.stop_reason == "tool_use" and len(uses) == 1
        assert choice["type"] == "any" or uses[0].name == "get_weather"
        jsonschema.validate(uses[0].input, _schema_of(uses[0].name))


@pytest.mark.parametrize("stream", [False, True])
def test_the_openai_client_gets_a_forced_call(client, stream):
    kw = dict(model="tiny", messages=USER, tools=TOOLS, max_tokens=200, temperature=1,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        calls = [c for ch in chunks for c in (ch.choices[0].delta.tool_calls or [])]
        name = "".join(c.function.name or "" for c in calls)
        args = "".join(c.function.arguments or "" for c in calls)
        finish = chunks[-1].choices[0].finish_reason
    else:
        r = client.chat.completions.create(**kw).choices[0]
        name, args = r.message.tool_calls[0].function.name, r.message.tool_calls[0].function.arguments
        finish = r.finish_reason
    assert name == "get_weather" and finish == "tool_calls"
    jsonschema.validate(json.loads(args), WEATHER)


@pytest.mark.parametrize("stream", [False, True])
def test_the_openai_client_gets_json_that_matches(client, stream):
    kw = dict(model="tiny", messages=USER, max_tokens=200, temperature=1, seed=3,
              response_format={"type": "json_schema", "json_schema": {
                  "name": "person", "schema": PERSON, "strict": True}})
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(stream=True, **kw))
    else:
        text = client.chat.completions.create(**kw).choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("name", ["qwen2", "llama-spm", "deepseek-llm"])
def test_json_over_a_real_vocabulary_always_parses_and_matches(name):
    """llama.cpp's reference vocabularies (byte-level BPE and SentencePiece, 32k to 152k
    tokens): the mask is right for every token of a real tokenizer, not just a tiny one."""
    from llamacpp_convert import ConverterUnavailable, source_dir

    from expertfs.formats.gguf_read import read_gguf
    from expertfs.runtime.tokenizer.gguf import GGUFTokenizer
    try:
        path = source_dir() / "models" / f"ggml-vocab-{name}.gguf"
    except ConverterUnavailable as e:
        pytest.skip(f"llama.cpp reference vocabularies unavailable: {e}")
    real = GGUFTokenizer({k: e.value for k, e in read_gguf(str(path)).kv.items()}, str(path))
    real.chat_template = "{% for m in messages %}{{ m.content }}\n{% endfor %}"
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for seed in range(3):
        out = _run(real, {"response_format": fmt, "max_tokens": 200}, seed)
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.content), PERSON)
