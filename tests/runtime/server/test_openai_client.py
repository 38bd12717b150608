"""The official ``openai`` client against a live ``expertfs serve``: logprobs (the log-softmax
of the logits the sampler saw, checked against the engine run in-process), stop strings across
token boundaries, penalties, seeds, tools through a real chat template, and 400s that name
each unsupported parameter."""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

from expertfs.runtime.engine import Engine, EngineOptions
from expertfs.runtime.sampling import penalize
from expertfs.runtime.server.schema import parse_chat
from expertfs.runtime.server.session import Session
from expertfs.runtime.tokenizer.gguf import GGUFTokenizer

from serve_live import TEMPLATES, build_store, live_server, template  # noqa: E402

openai = pytest.importorskip("openai")

MSG = [{"role": "user", "content": "Beautiful is better than ugly. Explicit is"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


@pytest.fixture(scope="module")
def tiny_store(tmp_path_factory) -> str:
    return build_store(tmp_path_factory.mktemp("serve-live"))


@pytest.fixture(scope="module")
def server(tiny_store):
    with live_server(tiny_store) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(tiny_store):
    """The engine in-process: the raw logits at each step after a given prompt."""
    eng = Engine.open(tiny_store, provider="direct", options=EngineOptions(n_ctx=512))
    tok = GGUFTokenizer(eng.kv)
    sess = Session(eng, tok)

    def logits(messages, tokens):
        ids = sess.prompt_ids(parse_chat({"messages": messages, "max_tokens": 1}))
        eng.reset(0)
        out = [eng.prefill(ids).float().cpu()]
        for t in tokens[:-1]:
            out.append(eng.decode(t).float().cpu())
        return out
    yield tok, logits
    eng.close()


def _ids(tok, entries):
    """Token ids of logprob entries, by their bytes."""
    by_bytes = {tok.token_bytes(i): i for i in range(tok.n_vocab)}
    return [by_bytes[bytes(e.bytes)] for e in entries]


def test_chat_logprobs_are_the_log_softmax_of_the_logits(client, reference):
    tok, logits = reference
    r = client.chat.completions.create(model="m.efs", messages=MSG, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=3)
    lp = r.choices[0].logprobs.content
    assert len(lp) == r.usage.completion_tokens and all(len(e.top_logprobs) == 3 for e in lp)
    ids = _ids(tok, lp)
    for e, t, lg in zip(lp, ids, logits(MSG, ids)):
        ref = torch.log_softmax(lg, -1)
        assert e.logprob == pytest.approx(float(ref[t]), abs=1e-4)
        assert t == int(torch.argmax(lg))                       # greedy took the top token
        top = torch.topk(ref, 3)
        assert [x.logprob for x in e.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
    shown = [e.token for e, t in zip(lp, ids) if tok.types[t] not in (3, 5)]   # not control, pad
    assert "".join(shown) == r.choices[0].message.content


def test_streamed_logprobs_equal_whole(client):
    kw = dict(model="m.efs", messages=MSG, max_tokens=6, temperature=0, logprobs=True,
              top_logprobs=2)
    whole = client.chat.completions.create(**kw).choices[0]
    chunks = list(client.chat.completions.create(stream=True, **kw))
    got = [e for c in chunks if c.choices and c.choices[0].logprobs
           for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in got] == [(e.token, e.logprob) for e in whole.logprobs.content]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.message.content


def test_completion_logprobs_shape(client):
    r = client.completions.create(model="m.efs", prompt="Beautiful is better than",
                                  max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert all(len(t) <= 2 and max(t.values()) == pytest.approx(v, abs=1e-6)
               for t, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert all(t in r.choices[0].text or t.startswith("[PAD") for t in lp.tokens)
    assert lp.text_offset == sorted(lp.text_offset)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_across_token_boundaries(client, stream):
    base = client.chat.completions.create(model="m.efs", messages=MSG, max_tokens=16,
                                          temperature=0, logprobs=True)
    toks = [e.token for e in base.choices[0].logprobs.content]
    text = base.choices[0].message.content
    k = next(i for i in range(1, len(toks)) if toks[i - 1] and toks[i]
             and not toks[i - 1].startswith("[PAD") and not toks[i].startswith("[PAD"))
    pos = len("".join(toks[:k]))
    stop = text[pos - 1:pos + 1]                 # the last char of one token, the first of the next
    want = text[:text.index(stop)]
    kw = dict(model="m.efs", messages=MSG, max_tokens=16, temperature=0, stop=[stop])
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        r = client.chat.completions.create(**kw)
        got, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert got == want and finish == "stop"


def test_seed_repeats_a_sampled_reply(client):
    kw = dict(model="m.efs", messages=MSG, max_tokens=8, temperature=1.0, seed=7)
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b


def test_penalties_change_the_distribution_as_defined(client, reference):
    tok, logits = reference
    pp, fp = 0.7, 1.3
    r = client.chat.completions.create(model="m.efs", messages=MSG, max_tokens=8, temperature=0,
                                       logprobs=True, presence_penalty=pp, frequency_penalty=fp)
    lp = r.choices[0].logprobs.content
    ids = _ids(tok, lp)
    counts: dict[int, int] = {}
    for e, t, lg in zip(lp, ids, logits(MSG, ids)):
        want = lg.clone()
        for j, c in counts.items():
            want[j] -= c * fp + pp
        assert e.logprob == pytest.approx(float(torch.log_softmax(want, -1)[t]), abs=1e-4)
        assert t == int(torch.argmax(want))
        counts[t] = counts.get(t, 0) + 1


def test_penalize_is_openais_formula():
    lg = torch.zeros(5)
    out = penalize(lg, {1: 1, 3: 4}, presence=0.5, frequency=0.25)
    assert out.tolist() == [0.0, -0.75, 0.0, -1.5, 0.0] and lg.tolist() == [0.0] * 5


def test_max_completion_tokens(client):
    r = client.chat.completions.create(model="m.efs", messages=MSG, max_completion_tokens=3,
                                       temperature=0)
    assert r.usage.completion_tokens <= 3 and r.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("kw,param", [
    ({"logit_bias": {"x": 5}}, "logit_bias"),                 # not a token id
    ({"logit_bias": {"1": 101}}, "logit_bias"),               # beyond -100..100
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),          # not in the vocabulary
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "wibble"}}}}}}, "response_format"),
    ({"n": 2}, "n"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"tools": TOOLS}, "tools"),                       # the store's template cannot take tools
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),             # no tools to call
    ({"functions": [TOOLS[0]["function"]]}, "functions"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),
])
def test_unsupported_parameters_are_400s_naming_them(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m.efs", messages=MSG, max_tokens=2, **kw)
    assert e.value.body["param"] == param and e.value.body["message"]


@pytest.mark.parametrize("kw,param", [({"echo": True}, "echo"), ({"best_of": 2}, "best_of"),
                                      ({"suffix": "x"}, "suffix"), ({"logprobs": 9}, "logprobs")])
def test_unsupported_completion_parameters_are_400s(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m.efs", prompt="x", max_tokens=2, **kw)
    assert e.value.body["param"] == param


def test_tools_reach_a_real_template_and_tool_results_go_back(tiny_store):
    path = f"{TEMPLATES}/Qwen-Qwen3-0.6B.jinja"
    template("Qwen-Qwen3-0.6B.jinja")
    msgs = MSG + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    with live_server(tiny_store, "--chat-template-file", path, "--ctx", "2048") as url:
        req = urllib.request.Request(url + "/apply-template", method="POST",
                                     data=json.dumps({"messages": msgs, "tools": TOOLS}).encode(),
                                     headers={"Content-Type": "application/json"})
        prompt = json.loads(urllib.request.urlopen(req, timeout=60).read())["prompt"]
        assert '"name": "get_weather"' in prompt and "<tools>" in prompt
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
        assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        plain = c.chat.completions.create(model="m.efs", messages=MSG, max_tokens=2, temperature=0)
        r = c.chat.completions.create(model="m.efs", messages=msgs, tools=TOOLS, max_tokens=4,
                                      temperature=0)
        assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 50     # the tools are in it
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_logit_bias_is_added_to_the_logits_before_sampling(client, reference):
    tok, logits = reference
    base = client.chat.completions.create(model="m.efs", messages=MSG, max_tokens=1,
                                          temperature=0, logprobs=True)
    top = _ids(tok, base.choices[0].logprobs.content)[0]
    favour = (top + 7) % tok.n_vocab
    while tok.types[favour] != 1:                    # a normal token
        favour = (favour + 1) % tok.n_vocab
    bias = {str(top): -100, str(favour): 3.5}
    r = client.chat.completions.create(model="m.efs", messages=MSG, max_tokens=4, temperature=0,
                                       logprobs=True, logit_bias=bias)
    lp = r.choices[0].logprobs.content
    ids = _ids(tok, lp)
    for e, t, lg in zip(lp, ids, logits(MSG, ids)):
        want = lg.clone()
        want[top] -= 100
        want[favour] += 3.5
        assert t == int(torch.argmax(want)) != top
        assert e.logprob == pytest.approx(float(torch.log_softmax(want, -1)[t]), abs=1e-4)
    forced = client.completions.create(model="m.efs", prompt="Beautiful is", max_tokens=3,
                                       temperature=1, logit_bias={str(favour): 100})
    assert forced.choices[0].text == tok.decode([favour] * 3)


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "ok": {"type": "boolean"}}, "required": ["name", "age", "ok"], "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_replies_of_random_weights_parse_and_match(client, stream):
    """The synthesised model's weights are random: only the grammar makes the reply valid."""
    from expertfs.runtime.server import grammar
    jsonschema = pytest.importorskip("jsonschema")
    if not grammar.available():
        pytest.skip("llguidance (the serve extra) is not installed")
    for seed in (1, 2):
        kw = dict(model="m.efs", messages=MSG, max_tokens=120, temperature=1, seed=seed,
                  response_format={"type": "json_schema", "json_schema": {
                      "name": "person", "schema": PERSON, "strict": True}})
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kw))
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            r = client.chat.completions.create(**kw).choices[0]
            text, finish = r.message.content, r.finish_reason
        assert finish == "stop"
        jsonschema.validate(json.loads(text), PERSON)
