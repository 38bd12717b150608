"""OpenAI request bodies → ``CompletionRequest``, or a ``RequestError`` with status and message.

Covers ``/v1/chat/completions`` (``messages``) and ``/v1/completions`` (``prompt``): model,
max_tokens (max_completion_tokens), temperature, top_p, top_k, seed, stop, stream, n (1 only).
Unknown fields are ignored, as OpenAI-compatible servers do; wrong types and ranges are 400s
that name the parameter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["RequestError", "CompletionRequest", "parse_chat", "parse_completion", "MAX_TOKENS_CAP"]

MAX_TOKENS_CAP = 1 << 16
_ROLES = ("system", "user", "assistant", "tool", "developer")


class RequestError(Exception):
    """A request the server refuses: HTTP ``status``, an OpenAI-style error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


@dataclass(frozen=True)
class CompletionRequest:
    chat: bool
    messages: tuple[dict[str, str], ...] | None
    prompt: str | None
    model: str | None
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


def _bad(msg: str, param: str) -> RequestError:
    return RequestError(400, msg, param=param, code="invalid_value")


def _num(body: dict[str, Any], key: str, default: float, lo: float, hi: float,
         integer: bool = False) -> Any:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise _bad(f"'{key}' must be {'an integer' if integer else 'a number'}", key)
    if not lo <= v <= hi:
        raise _bad(f"'{key}' must be between {lo} and {hi}, got {v}", key)
    return int(v) if integer else float(v)


def _common(body: Any, default_max: int) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object", code="invalid_json")
    n = body.get("n", 1)
    if n != 1:
        raise _bad("only n=1 is supported", "n")
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,) if stop else ()
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
        stops = tuple(s for s in stop if s)
    else:
        raise _bad("'stop' must be a string or a list of up to 4 strings", "stop")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("'model' must be a string", "model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("'stream' must be true or false", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise _bad("'stream_options' must be an object", "stream_options")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return {
        "model": model,
        "max_tokens": _num(body, key, default_max, 0, MAX_TOKENS_CAP, integer=True),
        "temperature": _num(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": _num(body, "top_p", 1.0, 1e-6, 1.0),
        "top_k": _num(body, "top_k", 0, 0, 1 << 20, integer=True),
        "seed": _num(body, "seed", 0, -(1 << 63), (1 << 63) - 1, integer=True),
        "stop": stops, "stream": stream, "include_usage": bool(opts.get("include_usage", False)),
    }


def parse_chat(body: Any, default_max: int = 256) -> CompletionRequest:
    c = _common(body, default_max)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise _bad(f"messages[{i}] needs a 'role' of {', '.join(_ROLES)}", f"messages[{i}].role")
        content = m.get("content", "")
        if isinstance(content, list):          # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" and
                       isinstance(p.get("text"), str) for p in content):
                raise _bad(f"messages[{i}].content: only text parts are supported",
                           f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise _bad(f"messages[{i}].content must be a string", f"messages[{i}].content")
        out.append({"role": m["role"], "content": content})
    return CompletionRequest(True, tuple(out), None, **c)


def parse_completion(body: Any, default_max: int = 16) -> CompletionRequest:
    c = _common(body, default_max)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise _bad("'prompt' must be a string", "prompt")
    return CompletionRequest(False, None, prompt, **c)
