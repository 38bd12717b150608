"""The request bodies ``tools/fuzz_serve.py`` sends: hypothesis strategies per endpoint, from
valid-but-odd to garbage (wrong types, huge numbers, NaN/Infinity, deep nesting, invalid UTF-8
and lone surrogates, huge strings, duplicate keys, wrong content types and methods, truncated
bodies), and well-formed chats whose ``logit_bias``, ``response_format`` and ``tool_choice``
are mostly valid, so those reach the template, the grammar and the sampler."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st


ENDPOINTS = ("chat", "completions", "models", "health", "apply-template", "messages",
             "count-tokens", "metrics")
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
         "models": "/v1/models", "health": "/health", "apply-template": "/apply-template",
         "messages": "/v1/messages", "count-tokens": "/v1/messages/count_tokens",
         "metrics": "/metrics"}



# ---- strategies -------------------------------------------------------------------------

ODD_TEXT = ["", " ", "\x00", "\ud800", "a\udfffb", "<|im_end|>", "<|im_start|>user\n", "{{ 7*7 }}",
            "{% for x in range(99999999) %}", "\u202e\u200b", "😀" * 3, "\\u0000", "é" * 50,
            "a" * 5000, "\n" * 200]
HUGE_INTS = [2 ** 31, 2 ** 63, -(2 ** 63) - 1, 2 ** 64, 10 ** 30, -1, 0]
text = st.text(max_size=40) | st.sampled_from(ODD_TEXT)
number = (st.integers(-1000, 1000) | st.sampled_from(HUGE_INTS)
          | st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from([0.0, -0.0, 1e308]))
scalar = st.none() | st.booleans() | number | text
json_value = st.recursive(scalar, lambda c: st.lists(c, max_size=4)
                          | st.dictionaries(text, c, max_size=4), max_leaves=12)

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
ROLES = ["system", "user", "assistant", "tool", "developer", "wizard", "", None]
content = (text | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                                  "text": text}), max_size=3) | json_value)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(ROLES)},
    optional={"content": content, "name": text, "tool_call_id": text,
              "tool_calls": st.lists(st.fixed_dictionaries(
                  {"id": text, "type": st.just("function"),
                   "function": st.fixed_dictionaries({"name": text, "arguments": text | json_value})}),
                  max_size=2) | json_value})
small_max = st.integers(0, 24) | st.sampled_from([-1, 1.5, "8", 100000, 2 ** 63, None])
COMMON = {
    "model": st.sampled_from(["tiny", "", "other", None]) | json_value,
    "max_tokens": small_max, "temperature": st.floats(-1, 3) | json_value,
    "top_p": st.floats(-0.5, 1.5) | scalar, "top_k": st.integers(-2, 2000) | scalar,
    "seed": number | scalar, "stop": text | st.lists(text, max_size=6) | json_value,
    "stream": st.booleans() | scalar,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": scalar}) | json_value,
    "n": st.sampled_from([1, 2, 0, None, "1"]), "presence_penalty": number,
    "frequency_penalty": number, "user": text, "metadata": json_value,
    "unknown_" + "field": json_value,
}
# logit_bias, response_format and tool_choice: valid values (``ok_*``) and near misses (ids
# beyond the vocabulary, biases out of range, schemas llguidance cannot take, unknown tools)
ok_bias = st.dictionaries(st.integers(0, 1023).map(str), st.integers(-100, 100)
                          | st.floats(-100, 100), max_size=5)
logit_bias = ok_bias | st.dictionaries(st.integers(-3, 99999).map(str) | st.sampled_from(
    ["abc", "1.5", " 7", "", "0x10", "9" * 20]), st.floats(-150, 150) | scalar, max_size=5) \
    | json_value
SCHEMAS = [{"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "n": {
    "type": "integer", "minimum": 0, "maximum": 9}}, "required": ["city"],
    "additionalProperties": False}, {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    {"enum": ["a", "b", 3, None]}, {"type": "string", "pattern": "^[a-z]{1,4}$"},
    {"type": "object", "properties": {"x": {"$ref": "#/$defs/n"}}, "$defs": {"n": {"type": "number"}}},
    {"anyOf": [{"type": "integer"}, {"type": "null"}]}, {"const": {"deep": [1, 2]}}, {}]
BAD_SCHEMAS = [{"type": "nonsense"}, {"type": "string", "pattern": "("}, {"not": {}},
               {"$ref": "#/$defs/missing"}, {"type": "object", "properties": {"a": {"$ref": "#"}}},
               {"type": "integer", "minimum": 5, "maximum": 1}, {"type": "string", "format": "no"}]
schema = st.sampled_from(SCHEMAS) | st.sampled_from(BAD_SCHEMAS) | json_value
ok_format = st.sampled_from([{"type": "text"}, {"type": "json_object"}]) | st.builds(
    lambda s, strict: {"type": "json_schema", "json_schema": {"name": "out", "schema": s,
                                                              "strict": strict}},
    st.sampled_from(SCHEMAS), st.booleans())
response_format = ok_format | st.sampled_from([{"type": "xml"}, {"type": None}, {}]) \
    | st.fixed_dictionaries({"type": st.just("json_schema")}, optional={
        "json_schema": st.fixed_dictionaries({"name": st.sampled_from(["out", ""]) | scalar},
                                             optional={"schema": schema, "strict": scalar})
        | json_value}) | json_value
TOOL2 = {"type": "function", "function": {"name": "lookup", "parameters": SCHEMAS[0]}}
ok_tools = st.sampled_from([[TOOL], [TOOL, TOOL2], [TOOL2]])
tools = ok_tools | st.just([]) | st.lists(st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": text}, optional={"parameters": schema, "description": text})}), max_size=2) \
    | st.lists(json_value, max_size=2) | json_value
ok_choice = st.sampled_from(["auto", "none", "required", {"type": "function", "function": {
    "name": "get_weather"}}, {"type": "function", "function": {"name": "lookup"}}])
tool_choice = ok_choice | st.sampled_from(["any", None, ""]) | st.fixed_dictionaries(
    {"type": st.sampled_from(["function", "tool", None])}, optional={"function": st.fixed_dictionaries(
        {}, optional={"name": st.sampled_from(["nope", ""]) | scalar}) | json_value}) | json_value
CHAT = {**COMMON, "max_completion_tokens": small_max, "logprobs": st.booleans() | scalar,
        "top_logprobs": st.integers(-1, 30) | scalar, "tools": tools, "tool_choice": tool_choice,
        "response_format": response_format, "logit_bias": logit_bias,
        "parallel_tool_calls": scalar, "modalities": json_value}
# well-formed chats, mostly valid, so these fields reach the template, grammar and sampler: one
# offering tools, one asking for JSON, one with any of them


def _mostly(ok: st.SearchStrategy[Any], other: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``ok`` three times in four, else ``other``."""
    return st.integers(0, 3).flatmap(lambda i: other if i == 0 else ok)


EXTRAS = {"logit_bias": _mostly(ok_bias, logit_bias), "parallel_tool_calls": st.booleans(),
          "stream": st.booleans(), "temperature": st.floats(0, 2), "logprobs": st.booleans()}
WANTS = {"tools": _mostly(ok_tools, tools), "tool_choice": _mostly(ok_choice, tool_choice),
         "response_format": _mostly(ok_format, response_format)}


def _chat(given: tuple[str, ...]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {"messages": st.just([{"role": "user", "content": "Weather in Paris?"}]),
         "max_tokens": st.integers(1, 96), **{k: WANTS[k] for k in given}},
        optional={**EXTRAS, **{k: v for k, v in WANTS.items() if k not in given}})


good_chat = _chat(("tools", "tool_choice")) | _chat(("response_format",)) | _chat(())
prompt = (text | st.lists(text, max_size=3) | st.lists(st.integers(-5, 1100), max_size=12)
          | st.lists(st.lists(st.integers(0, 1100), max_size=6), max_size=3) | json_value)
COMPLETION = {**COMMON, "logprobs": st.integers(-1, 7) | scalar, "echo": scalar,
              "best_of": scalar, "suffix": scalar, "logit_bias": logit_bias}
chat_body = st.fixed_dictionaries({"messages": st.lists(message, max_size=4) | json_value},
                                  optional=CHAT) | good_chat | json_value
completion_body = st.fixed_dictionaries({"prompt": prompt}, optional=COMPLETION) | json_value

# the Anthropic Messages API
BLOCK_TYPES = ["text", "tool_use", "tool_result", "thinking", "redacted_thinking", "image", None]
block = st.fixed_dictionaries(
    {"type": st.sampled_from(BLOCK_TYPES)},
    optional={"text": text | json_value, "id": text, "name": text | st.just("get_weather"),
              "input": st.just({"city": "Paris"}) | json_value, "tool_use_id": text,
              "content": text | st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                "text": text}), max_size=2)
              | json_value, "is_error": scalar, "thinking": text, "cache_control": json_value})
a_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", None])},
    optional={"content": text | st.lists(block, max_size=3) | json_value})
A_TOOL = {"name": "get_weather", "description": "weather",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
MESSAGES = {
    "model": COMMON["model"], "max_tokens": small_max, "system": text | st.lists(block, max_size=2)
    | json_value, "stop_sequences": st.lists(text, max_size=4) | json_value,
    "temperature": st.floats(-1, 2) | json_value, "top_p": st.floats(-0.5, 1.5) | scalar,
    "top_k": st.integers(-2, 2000) | scalar, "stream": st.booleans() | scalar,
    "metadata": st.fixed_dictionaries({}, optional={"user_id": text}) | json_value,
    "tools": st.just([A_TOOL]) | st.lists(json_value, max_size=2) | json_value,
    "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "none"}, {"type": "any"},
                                    {"type": "tool", "name": "get_weather"},
                                    {"type": "auto", "disable_parallel_tool_use": True}, "auto"])
    | json_value, "thinking": st.sampled_from([{"type": "disabled"}, {"type": "enabled",
                                                                      "budget_tokens": 1024}])
    | json_value, "service_tier": text, "unknown_" + "field": json_value}
messages_body = st.fixed_dictionaries({"messages": st.lists(a_message, max_size=4) | json_value},
                                      optional=MESSAGES) | json_value
BODIES = {"completions": completion_body, "messages": messages_body,
          "count-tokens": messages_body}

CONTENT_TYPES = ["application/json", "application/json; charset=utf-8", "text/plain",
                 "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                 "application/json; charset=utf-16", "", "image/png"]


def _deep(n: int, opener: str) -> bytes:
    closer = {"[": "]", "{": "}"}[opener]
    inner = '{"a":' * n + "1" + "}" * n if opener == "{" else "[" * n + "]" * n
    return ('{"messages": [{"role": "user", "content": "hi"}], "metadata": ' + inner + "}"
            if closer == "}" else inner).encode()


@st.composite
def raw_body(draw: Any, body: st.SearchStrategy[Any]) -> bytes:
    """A body as bytes: JSON, or JSON spoiled at the byte level."""
    value = draw(body)
    try:
        data = json.dumps(value, ensure_ascii=draw(st.booleans())).encode("utf-8", "surrogatepass")
    except (ValueError, RecursionError):
        data = b"{}"
    how = draw(st.sampled_from(["plain"] * 6 + ["truncate", "deep", "dup", "nan", "binary",
                                                 "huge_str", "huge_int", "bad_utf8", "empty"]))
    if how == "truncate" and data:
        data = data[:draw(st.integers(0, len(data) - 1))]
    elif how == "deep":
        data = _deep(draw(st.sampled_from([10, 63, 65, 500, 1000, 5000, 100000])),
                     draw(st.sampled_from("[{")))
    elif how == "dup" and data.startswith(b"{") and len(data) > 2:
        data = b'{"max_tokens": 1, "max_tokens": "x", "stream": true, ' + data[1:]
    elif how == "nan":
        data = data.replace(b"1", draw(st.sampled_from([b"NaN", b"Infinity", b"-Infinity"])), 1) \
            if b"1" in data else b'{"max_tokens": NaN}'
    elif how == "binary":
        data = draw(st.binary(max_size=64))
    elif how == "huge_str":
        n = draw(st.sampled_from([10 ** 5, 10 ** 6, 3 << 20]))
        data = b'{"messages": [{"role": "user", "content": "' + b"ab " * (n // 3) + \
            b'"}], "prompt": "' + b"x" * 10 + b'"}'
    elif how == "huge_int":
        data = b'{"max_tokens": 1' + b"0" * draw(st.sampled_from([20, 400, 5000])) + b"}"
    elif how == "bad_utf8" and data:
        i = draw(st.integers(0, len(data)))
        data = data[:i] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80"])) + data[i:]
    elif how == "empty":
        data = b""
    return data


@st.composite
def cases(draw: Any, endpoint: str) -> tuple[str, str, bytes, dict[str, str]]:
    """(method, path, body, headers) for ``endpoint``."""
    path = PATHS[endpoint]
    if endpoint in ("models", "health", "metrics"):
        method = draw(st.sampled_from(["GET"] * 4 + ["POST", "PUT", "DELETE", "HEAD", "PATCH"]))
        data = draw(raw_body(json_value)) if method != "GET" or draw(st.booleans()) else b""
        if draw(st.booleans()):
            path += "?" + draw(st.sampled_from(["a=1", "x=%ff", "&&", "q=" + "z" * 2000]))
    else:
        method = draw(st.sampled_from(["POST"] * 12 + ["GET", "PUT"]))
        data = draw(raw_body(BODIES.get(endpoint, chat_body)))
    ctype = draw(st.sampled_from(CONTENT_TYPES))
    return method, path, data, {"Content-Type": ctype} if ctype else {}
