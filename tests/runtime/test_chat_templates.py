"""Chat templates render byte for byte as transformers' ``apply_chat_template`` renders them.

Every template llama.cpp ships in ``models/templates/`` whose model is a mixture of experts
(``MOE_TEMPLATES``; from the llama-cpp-python 0.3.36 source package tools/llamacpp_convert.py
finds in or downloads into the cache), over every conversation in ``CONVERSATIONS``: each is an
OpenAI request body, sent through the server's conversion (``parse_chat``) and the GGUF
tokenizer's template call as ``Session.render`` makes it, and compared with transformers given
the same messages (tool-call arguments as a mapping: the server decodes a JSON string once, as
the templates expect; a null content as "", which templates such as Qwen3's need). A pair that transformers refuses must be refused by us with a typed error.
"""

from __future__ import annotations

import copy
import json

import pytest

from expertfs.errors import UsageError
from expertfs.runtime.server.schema import parse_chat
from expertfs.runtime.tokenizer.gguf import GGUFTokenizer
from expertfs.synth.tokenizer import build_vocab

#: by file name, the templates of MoE models (Qwen-Qwen3-0.6B and Qwen3.5-4B carry the template
#: their MoE siblings Qwen3-30B-A3B / 235B-A22B and Qwen3.5-397B-A17B ship)
MOE_TEMPLATES = [
    "Cohere2MoE", "GLM-4.6", "GLM-4.7-Flash", "GigaChat3-10B-A1.8B", "GigaChat3.1-10B-A1.8B",
    "Kimi-K2-Instruct", "Kimi-K2-Thinking", "Kimi-K3", "moonshotai-Kimi-K2", "LFM2-8B-A1B",
    "LFM2.5-8B-A1B", "MiniMax-M1", "MiniMax-M2", "MiniMax-M3",
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", "Qwen3-Coder", "Qwen-Qwen3-0.6B", "Qwen3.5-4B",
    "StepFun3.5-Flash", "deepseek-ai-DeepSeek-V3.1", "deepseek-ai-DeepSeek-V3.2",
    "deepseek-ai-DeepSeek-V4-Flash-0731", "deepseek-ai-DeepSeek-V4", "llama-cpp-deepseek-r1",
    "openai-gpt-oss-120b", "inclusionai-ling-3.0-flash", "tencent-Hy3", "upstage-Solar-Open-100B",
    "poolside-Laguna-S-2.1", "poolside-Laguna-XS-2.1", "poolside-Laguna-XS.2"]

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "The city"},
            "days": {"type": "integer"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}]
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
ASK = {"role": "user", "content": "What's the weather in Paris for 3 days?"}


def _call(i: int, name: str, args: dict, as_string: bool) -> dict:
    return {"id": f"call_{i}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args) if as_string else args}}


def _calls(as_string: bool, parallel: bool = False, **extra) -> list[dict]:
    calls = [_call(0, "get_weather", {"city": "Paris", "days": 3}, as_string)]
    results = [{"role": "tool", "tool_call_id": "call_0", "name": "get_weather",
                "content": '{"temperature": 21, "sky": "clear"}'}]
    if parallel:
        calls.append(_call(1, "get_time", {"city": "Paris"}, as_string))
        results.append({"role": "tool", "tool_call_id": "call_1", "name": "get_time",
                        "content": "14:05"})
    return [SYSTEM, ASK, {"role": "assistant", "content": None, "tool_calls": calls, **extra},
            *results]


CONVERSATIONS = {
    "system_user": {"messages": [SYSTEM, {"role": "user", "content": "Hello!"}]},
    "multi_turn": {"messages": [
        SYSTEM, {"role": "user", "content": "Hi, who are you?"},
        {"role": "assistant", "content": "I am an assistant."},
        {"role": "user", "content": "Tell me a joke."}]},
    "tools": {"messages": [SYSTEM, ASK], "tools": TOOLS},
    "tool_call_dict": {"messages": _calls(False), "tools": TOOLS},
    "tool_call_string": {"messages": _calls(True), "tools": TOOLS},
    "parallel_calls": {"messages": _calls(True, parallel=True), "tools": TOOLS},
    "reasoning": {"messages": [
        SYSTEM, {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4.", "reasoning_content": "Two plus two is four."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6.", "reasoning_content": "Three and three: six."},
        {"role": "user", "content": "Thanks."}]},
    "reasoning_as_thinking": {"messages": [   # the field name gpt-oss's template reads
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": None, "thinking": "Add them.", "tool_calls": [
            _call(0, "get_weather", {"city": "Paris"}, True)]},
        {"role": "tool", "tool_call_id": "call_0", "name": "get_weather", "content": "sunny"}],
        "tools": TOOLS},
    "reasoning_tool_call": {"messages": _calls(
        False, reasoning_content="I should look up the weather."), "tools": TOOLS},
    "non_ascii": {"messages": [
        {"role": "system", "content": "Réponds en français, s'il te plaît. 🦙"},
        {"role": "user", "content": "天气怎么样？ Ünïcödé — “quotes”"},
        {"role": "assistant", "content": None, "tool_calls": [
            _call(0, "get_weather", {"city": "Zürich 北京"}, True)]},
        {"role": "tool", "tool_call_id": "call_0", "name": "get_weather",
         "content": "☀️ 21 °C"}], "tools": TOOLS},
}


def _template(name: str) -> str:
    from llamacpp_convert import ConverterUnavailable, source_dir
    try:
        path = source_dir() / "models" / "templates" / f"{name}.jinja"
    except ConverterUnavailable as e:
        pytest.skip(f"llama.cpp's templates unavailable: {e}")
    return path.read_text(encoding="utf-8")


def _gguf_tokenizer() -> GGUFTokenizer:
    v = build_vocab("deepseek2", 700)
    fam = v.family
    return GGUFTokenizer({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": fam.pre,
        "tokenizer.ggml.tokens": list(v.tokens), "tokenizer.ggml.token_type": list(v.token_types),
        "tokenizer.ggml.merges": list(v.merges), "tokenizer.ggml.bos_token_id": v.id_of(fam.bos),
        "tokenizer.ggml.eos_token_id": v.id_of(fam.eos)})


def _hf_tokenizer(bos: str, eos: str):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({bos: 0, eos: 1, "x": 2}, unk_token="x")),
        bos_token=bos, eos_token=eos)


def _reference_messages(messages: list[dict]) -> list[dict]:
    """The messages as a transformers user writes them: tool-call arguments as a mapping, and
    an empty content where an OpenAI client sends a null one."""
    out = copy.deepcopy(messages)
    for m in out:
        if m.get("content") is None:
            m["content"] = ""
        for c in m.get("tool_calls") or ():
            if isinstance(c["function"]["arguments"], str):
                c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    return out


def _ours(tok: GGUFTokenizer, body: dict) -> str:
    """The prompt the server renders for ``body`` (as ``Session.render`` calls the template)."""
    req = parse_chat(copy.deepcopy(body))
    msgs = [dict(m) for m in req.messages or ()]
    if req.tools and req.tool_choice != "none":
        return tok.apply_chat_template(msgs, tools=[dict(t) for t in req.tools],
                                       tool_choice=req.tool_choice)
    return tok.apply_chat_template(msgs)


def _theirs(hf, body: dict) -> str:
    kw = {"tools": body["tools"], "tool_choice": "auto"} if body.get("tools") else {}
    return hf.apply_chat_template(_reference_messages(body["messages"]), tokenize=False,
                                  add_generation_prompt=True, **kw)


@pytest.fixture(scope="module")
def toks():
    tok = _gguf_tokenizer()
    return tok, _hf_tokenizer(tok.tokens[tok.bos_id], tok.tokens[tok.eos_id])


def compare(tok: GGUFTokenizer, hf, name: str, conv: str) -> tuple[str, str | None, str | None]:
    """``("equal" | "differs" | "both refuse" | "we refuse" | "they refuse", ours, theirs)``."""
    src = _template(name)
    tok.chat_template, hf.chat_template = src, src
    body = CONVERSATIONS[conv]
    try:
        theirs = _theirs(hf, body)
    except Exception:
        theirs = None
    try:
        ours = _ours(tok, body)
    except UsageError:
        ours = None
    if theirs is None:
        return ("both refuse" if ours is None else "they refuse"), ours, theirs
    if ours is None:
        return "we refuse", ours, theirs
    return ("equal" if ours == theirs else "differs"), ours, theirs


@pytest.mark.parametrize("conv", sorted(CONVERSATIONS))
@pytest.mark.parametrize("name", MOE_TEMPLATES)
def test_renders_as_transformers(toks, name, conv):
    verdict, ours, theirs = compare(*toks, name, conv)
    assert verdict in ("equal", "both refuse"), (verdict, ours, theirs)


def test_refusal_is_typed_and_speaks_of_the_request(toks):
    tok, _ = toks
    tok.chat_template = "{{ raise_exception('Conversation roles must alternate') }}"
    with pytest.raises(UsageError, match="roles must alternate") as e:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert "--" not in str(e.value)


def test_the_server_refuses_with_a_400_that_names_the_messages(toks):
    from expertfs.runtime.server.schema import RequestError
    from expertfs.runtime.server.session import Session
    tok, _ = toks
    tok.chat_template = _template("Kimi-K2-Instruct")     # transformers' sandbox refuses it too
    with pytest.raises(RequestError) as e:
        Session(None, tok).render(parse_chat(copy.deepcopy(CONVERSATIONS["tool_call_dict"])))
    assert e.value.status == 400 and e.value.param == "messages"
    assert "chat template failed on these messages: access to attribute 'append'" in str(e.value)
    assert "--" not in str(e.value) and str(e.value).count("chat template failed") == 1


def test_the_whole_message_reaches_the_template(toks):
    tok, _ = toks
    tok.chat_template = "{% for m in messages %}{{ m | tojson(sort_keys=True) }}\n{% endfor %}"
    body = {"messages": [{"role": "user", "content": "hi", "x_extra": [1, "é"]}, {
        "role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
            {"id": "c2", "type": "function", "function": {"name": "g",
                                                          "arguments": '"{\\"b\\": 2}"'}}],
        "reasoning": "hmm"}]}
    lines = _ours(tok, body).splitlines()
    assert json.loads(lines[0]) == {"role": "user", "content": "hi", "x_extra": [1, "é"]}
    second = json.loads(lines[1])
    assert second["reasoning_content"] == second["thinking"] == "hmm"
    args = [c["function"]["arguments"] for c in second["tool_calls"]]
    assert args == [{"a": 1}, '"{\\"b\\": 2}"']              # decoded once, and only once


if __name__ == "__main__":                     # a tally: python tests/runtime/test_chat_templates.py
    from collections import Counter
    t = _gguf_tokenizer()
    h = _hf_tokenizer(t.tokens[t.bos_id], t.tokens[t.eos_id])
    tally = Counter(compare(t, h, n, c)[0] for n in MOE_TEMPLATES for c in CONVERSATIONS)
    print(dict(tally), "of", len(MOE_TEMPLATES) * len(CONVERSATIONS))
