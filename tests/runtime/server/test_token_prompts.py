"""``/v1/completions`` with ``prompt`` as the API reference allows it: a string, an array of
token ids, or an array holding one of either (token ids go to the model as they are, no BOS
added); a batch of several prompts, ids outside the vocabulary and other shapes are 400s
naming ``prompt``."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from expertfs.runtime.server import ServerConfig, build_app
from expertfs.runtime.server.schema import parse_completion
from expertfs.runtime.server.session import Session

from fuzz_serve import FastEngine, tiny_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("ids"))


def _post(tok, body):
    sess = Session(FastEngine(tok.n_vocab, n_ctx=128), tok)

    async def go():
        async with TestClient(TestServer(build_app(sess, ServerConfig("tiny")))) as c:
            async with c.post("/v1/completions", json=body) as r:
                return r.status, await r.read()
    status, raw = asyncio.run(go())
    return status, raw, sess


@pytest.mark.parametrize("form", ["ids", "nested", "text", "text_list"])
@pytest.mark.parametrize("stream", [False, True])
def test_each_prompt_form_reaches_the_model_as_its_ids(tok, form, stream):
    text = "Beautiful is better than ugly."
    ids = tok.encode(text)
    prompt = {"ids": ids[1:] or ids, "nested": [ids[1:] or ids], "text": text,
              "text_list": [text]}[form]
    want = (ids[1:] or ids) if form in ("ids", "nested") else ids
    status, raw, sess = _post(tok, {"prompt": prompt, "max_tokens": 5, "stream": stream,
                                    "stream_options": {"include_usage": True} if stream else None})
    assert status == 200, raw
    assert sess.cached[:len(want)] == want              # exactly these ids were prefilled
    if stream:
        events = [json.loads(x[6:]) for x in raw.decode().split("\n\n") if x.startswith("data: {")]
        assert all(e["object"] == "text_completion" for e in events)
        usage = events[-1]["usage"]
    else:
        body = json.loads(raw)
        assert body["object"] == "text_completion" and isinstance(body["choices"][0]["text"], str)
        usage = body["usage"]
    assert usage["prompt_tokens"] == len(want)


@pytest.mark.parametrize("prompt,code", [
    ([[1, 2], [3, 4]], "unsupported_parameter"),
    (["a", "b"], "unsupported_parameter"),
    ([], "invalid_value"),
    ([1.5, 2], "invalid_value"),
    ([True, 2], "invalid_value"),
    ([1, "a"], "invalid_value"),
    ([[1], "a"], "invalid_value"),
    ([[]], "invalid_value"),
    (7, "invalid_value"),
])
def test_prompt_shapes_the_server_does_not_take_are_400s_naming_prompt(prompt, code):
    from expertfs.runtime.server.schema import RequestError
    with pytest.raises(RequestError) as e:
        parse_completion({"prompt": prompt})
    assert e.value.status == 400 and e.value.param == "prompt" and e.value.code == code


@pytest.mark.parametrize("bad", [-1, 1 << 20, 2 ** 64])
def test_a_token_id_outside_the_vocabulary_is_a_400(tok, bad):
    status, raw, _ = _post(tok, {"prompt": [1, 2, bad], "max_tokens": 2})
    err = json.loads(raw)["error"]
    assert status == 400 and err["param"] == "prompt" and "prompt[2]" in err["message"]


def test_token_ids_past_the_context_are_a_400(tok):
    status, raw, _ = _post(tok, {"prompt": [1] * 200, "max_tokens": 2})
    assert status == 400 and json.loads(raw)["error"]["code"] == "context_length_exceeded"
