"""Request fuzzing for ``expertfs serve``, in process against the aiohttp application.

Bodies come from hypothesis strategies, per endpoint, from valid-but-odd to garbage: wrong
types, huge numbers, NaN/Infinity, deep nesting, invalid UTF-8 and lone surrogates, huge
strings, duplicate keys, wrong content types and methods, truncated bodies. Every answer must
be a 2xx (a stream ends with ``[DONE]``, or ``message_stop`` for the Anthropic Messages API,
and carries no error) or a 4xx whose body is an OpenAI error (``{"error": {"message", "type",
"param", "code"}}``; Anthropic's ``{"type": "error", "error": {"type", "message"}}`` under
``/v1/messages``; a 503 with ``Retry-After``); a 5xx,
a malformed 4xx or an answer slower than the per-request timeout (a hang) is a failure, and
the server must still answer ``/health`` at the end.

The model is ``FastEngine``: seeded random logits over a real tokenizer's vocabulary (the tiny
synthesised qwen3moe store's), so the server's whole path (templates, tokenizer, sampling,
stop strings, logprobs, tool parsing, streaming) runs at the speed of the HTTP layer. The
suite (``tests/runtime/server/test_fuzz.py``) runs a few seeded examples per endpoint; this
script runs many::

    .venv/bin/python tools/fuzz_serve.py --count 10000 --seed 0 --time-limit 600
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from hypothesis import strategies as st

ENDPOINTS = ("chat", "completions", "models", "health", "apply-template", "messages",
             "count-tokens", "metrics")
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
         "models": "/v1/models", "health": "/health", "apply-template": "/apply-template",
         "messages": "/v1/messages", "count-tokens": "/v1/messages/count_tokens",
         "metrics": "/metrics"}


class FastEngine:
    """The engine interface ``Session`` drives, answering seeded random logits at once (or
    after ``delay`` seconds a token); ``decodes`` counts the tokens asked for."""

    def __init__(self, n_vocab: int, n_ctx: int = 128, seed: int = 0, delay: float = 0.0) -> None:
        self.n_vocab, self.delay, self.pos, self.decodes = n_vocab, delay, 0, 0
        self.options = SimpleNamespace(n_ctx=n_ctx)
        self.provider = SimpleNamespace(stats=SimpleNamespace(bytes_read=0, requests=0, hits={}))
        self._gen = torch.Generator().manual_seed(seed)

    def can_reset(self, pos: int) -> bool:
        return True

    def reset(self, pos: int = 0) -> None:
        self.pos = pos

    def _logits(self) -> torch.Tensor:
        if self.delay:
            time.sleep(self.delay)
        return torch.randn(self.n_vocab, generator=self._gen) * 3

    def prefill(self, ids: list[int]) -> torch.Tensor:
        self.pos += len(ids)
        return self._logits()

    def decode(self, token: int) -> torch.Tensor:
        self.pos += 1
        self.decodes += 1
        return self._logits()


def tiny_tokenizer(folder: str | Path) -> Any:
    """The tiny synthesised qwen3moe store's tokenizer (with its chat template)."""
    from expertfs.runtime.tokenizer.gguf import GGUFTokenizer
    from expertfs.formats.gguf_read import read_gguf
    from expertfs.synth import SynthConfig, synthesize
    path = synthesize(SynthConfig.tiny("qwen3moe"), str(Path(folder) / "m.gguf"))
    return GGUFTokenizer(read_gguf(path[0] if isinstance(path, list) else path).kv)


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
CHAT = {**COMMON, "max_completion_tokens": small_max, "logprobs": st.booleans() | scalar,
        "top_logprobs": st.integers(-1, 30) | scalar,
        "tools": st.just([TOOL]) | st.lists(json_value, max_size=2) | json_value,
        "tool_choice": st.sampled_from(["auto", "none", "required", None]) | json_value,
        "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]) | json_value,
        "parallel_tool_calls": scalar, "modalities": json_value}
prompt = (text | st.lists(text, max_size=3) | st.lists(st.integers(-5, 1100), max_size=12)
          | st.lists(st.lists(st.integers(0, 1100), max_size=6), max_size=3) | json_value)
COMPLETION = {**COMMON, "logprobs": st.integers(-1, 7) | scalar, "echo": scalar,
              "best_of": scalar, "suffix": scalar}
chat_body = st.fixed_dictionaries({"messages": st.lists(message, max_size=4) | json_value},
                                  optional=CHAT) | json_value
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


# ---- checking answers -------------------------------------------------------------------

def _error_ok(raw: bytes, anthropic: bool) -> bool:
    try:
        body = json.loads(raw)
        err = body["error"]
        if anthropic:
            return (body["type"] == "error" and isinstance(err["message"], str)
                    and bool(err["message"]) and isinstance(err["type"], str))
        return (isinstance(err["message"], str) and bool(err["message"])
                and isinstance(err["type"], str) and "param" in err and "code" in err)
    except (ValueError, KeyError, TypeError):
        return False


def _anthropic_stream_ok(text: str) -> bool:
    """Events in the Messages API's order: message_start first, message_stop last, no error."""
    names = [line[7:] for line in text.split("\n") if line.startswith("event: ")]
    return (bool(names) and names[0] == "message_start" and names[-1] == "message_stop"
            and "error" not in names and names.count("content_block_start")
            == names.count("content_block_stop"))


def verdict(status: int, headers: Any, raw: bytes, path: str = "") -> tuple[str, str | None]:
    """("2xx" | "4xx" | "5xx" | "bad", why) for one answer (to a request for ``path``: errors
    under /v1/messages are Anthropic's shape, the others OpenAI's)."""
    anthropic = path.startswith("/v1/messages")
    if status >= 500:
        return "5xx", raw[:300].decode("utf-8", "replace")
    if status >= 400:
        if not _error_ok(raw, anthropic):
            return "bad", f"{status} not an {'Anthropic' if anthropic else 'OpenAI'} error: " \
                f"{raw[:200]!r}"
        if status == 503 and "Retry-After" not in headers:
            return "bad", "503 without Retry-After"
        return "4xx", None
    if 200 <= status < 300:
        if headers.get("Content-Type", "").startswith("text/event-stream"):
            text = raw.decode()
            if anthropic:
                if not _anthropic_stream_ok(text):
                    return "bad", f"stream: {text[-300:]}"
            elif not text.rstrip().endswith("data: [DONE]") or '"error"' in text:
                return "bad", f"stream: {text[-300:]}"
        elif raw and not headers.get("Content-Type", "").startswith("text/plain"):
            json.loads(raw)
        return "2xx", None
    return "bad", f"status {status}"


class Harness:
    """The application on a test server in this thread's event loop, with ``send`` per case."""

    def __init__(self, session: Any, timeout: float = 20.0, **config: Any) -> None:
        from aiohttp.test_utils import TestClient, TestServer

        from expertfs.runtime.server import ServerConfig, build_app
        self.loop = asyncio.new_event_loop()
        self.timeout = timeout
        self.counts: Counter[str] = Counter()
        self.failures: list[tuple[tuple[str, str, bytes, dict[str, str]], str]] = []
        app = build_app(session, ServerConfig("tiny", **{"max_body": 1 << 20, **config}))

        async def start() -> Any:
            client = TestClient(TestServer(app))
            await client.start_server()
            return client
        self.client = self.loop.run_until_complete(start())

    async def _send(self, method: str, path: str, data: bytes, headers: dict[str, str]
                    ) -> tuple[int, Any, bytes]:
        async with self.client.request(method, path, data=data, headers=headers) as r:
            return r.status, r.headers, await r.read()

    def send(self, case: tuple[str, str, bytes, dict[str, str]]) -> str:
        try:
            status, headers, raw = self.loop.run_until_complete(
                asyncio.wait_for(self._send(*case), self.timeout))
            kind, why = verdict(status, headers, raw, case[1])
        except asyncio.TimeoutError:
            kind, why = "hang", f"no answer in {self.timeout:g} s"
        except Exception as e:                 # the connection died: the server dropped it
            kind, why = "dropped", f"{type(e).__name__}: {e}"
        self.counts[kind] += 1
        if why is not None:
            self.failures.append((case, f"{kind}: {why}"))
        return kind

    def alive(self) -> bool:
        return self.send(("GET", "/health", b"", {})) == "2xx"

    def close(self) -> None:
        self.loop.run_until_complete(self.client.close())
        self.loop.close()


def main(argv: list[str] | None = None) -> int:
    from hypothesis import HealthCheck, Phase, given, seed, settings

    from expertfs.runtime.server.session import Session
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=10000, help="requests in all (10000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-limit", type=float, default=600.0, help="seconds in all (600)")
    ap.add_argument("--timeout", type=float, default=20.0, help="seconds per request (20)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        tok = tiny_tokenizer(d)
    h = Harness(Session(FastEngine(tok.n_vocab, seed=args.seed), tok), timeout=args.timeout)
    t0, per = time.monotonic(), -(-args.count // len(ENDPOINTS))

    class Stop(Exception):
        pass
    for endpoint in ENDPOINTS:
        @seed(args.seed)
        @settings(max_examples=per, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(case=cases(endpoint))
        def one(case: tuple[str, str, bytes, dict[str, str]]) -> None:
            if time.monotonic() - t0 > args.time_limit:
                raise Stop
            h.send(case)
        try:
            one()
        except Stop:
            break
    alive = h.alive()
    h.close()
    c = h.counts
    print(f"requests {sum(c.values()) - 1}  2xx {c['2xx'] - 1}  4xx {c['4xx']}  5xx {c['5xx']}  "
          f"hangs {c['hang']}  malformed {c['bad']}  dropped {c['dropped']}  "
          f"server alive {alive}  {time.monotonic() - t0:.0f} s")
    for case, why in h.failures[:10]:
        print(f"  {case[0]} {case[1]} {case[2][:120]!r}: {why}")
    return 0 if alive and not h.failures else 1


if __name__ == "__main__":
    sys.exit(main())
