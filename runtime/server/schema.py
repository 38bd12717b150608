"""OpenAI request bodies → ``CompletionRequest``, or a ``RequestError`` with status and message.

Covers ``/v1/chat/completions`` (``messages``, ``tools``, ``tool_choice``) and
``/v1/completions`` (``prompt``: a string or token ids, or a list of one of either): model, max_tokens / max_completion_tokens, temperature, top_p,
top_k, seed, stop, stream, stream_options, logprobs / top_logprobs, presence_penalty,
frequency_penalty, logit_bias, n (1 only); chat also ``response_format`` (text, json_object,
json_schema), ``tool_choice`` (none, auto, required, or a named function) and
``parallel_tool_calls`` (false: the reply ends with its first call). Every other field is refused with a 400 that names it (a field
the server would otherwise drop changes what a client gets back), except the few that describe
the caller rather than the generation (``user``, ``metadata``, ...), which are accepted as such.
Wrong types and ranges are 400s that name the parameter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["RequestError", "CompletionRequest", "parse_chat", "parse_completion", "MAX_TOKENS_CAP",
           "MAX_TOP_LOGPROBS"]

MAX_TOKENS_CAP = 1 << 16
MAX_TOP_LOGPROBS = 20
_ROLES = ("system", "user", "assistant", "tool", "developer")
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
           "stream_options", "n", "presence_penalty", "frequency_penalty", "logprobs", "logit_bias",
           # about the caller, not the generation
           "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"}
_CHAT = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                   "parallel_tool_calls", "response_format", "modalities"}
#: message fields that are text when given
_TEXT_FIELDS = ("name", "tool_call_id", "reasoning_content", "thinking", "reasoning")
_COMPLETION = _COMMON | {"prompt", "echo", "best_of", "suffix"}


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
    messages: tuple[dict[str, Any], ...] | None
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool = False
    top_logprobs: int = 0
    tools: tuple[dict[str, Any], ...] | None = None
    tool_choice: Any = None
    prompt_tokens: tuple[int, ...] | None = None     # a prompt given as token ids
    logit_bias: dict[int, float] | None = None
    response_format: dict[str, Any] | None = None    # json_object or json_schema (not text)
    parallel_tool_calls: bool = True                 # False: the reply ends after one call

    @property
    def forced_tool(self) -> str | None:
        """The tool a named ``tool_choice`` forces."""
        c = self.tool_choice
        return c["function"]["name"] if isinstance(c, dict) else None

    @property
    def must_call(self) -> bool:
        """Whether the reply must be a tool call (``required`` or a named function)."""
        return bool(self.tools) and (self.tool_choice == "required" or self.forced_tool is not None)


def _bad(msg: str, param: str) -> RequestError:
    return RequestError(400, msg, param=param, code="invalid_value")


def _unsupported(msg: str, param: str) -> RequestError:
    return RequestError(400, msg, param=param, code="unsupported_parameter")


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


def _flag(body: dict[str, Any], key: str) -> bool:
    v = body.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _bad(f"'{key}' must be true or false", key)
    return v


def _common(body: Any, default_max: int, known: set[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object", code="invalid_json")
    for k in body:
        if k not in known:
            raise _unsupported(f"the parameter '{k}' is not supported by this server", k)
    n = body.get("n", 1)
    if n not in (1, None):
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
    stream = _flag(body, "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise _bad("'stream_options' must be an object", "stream_options")
    for k in opts:
        if k != "include_usage":
            raise _unsupported(f"stream_options.{k} is not supported", f"stream_options.{k}")
    if body.get("store"):
        raise _unsupported("'store': true is not supported (nothing is stored)", "store")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return {
        "logit_bias": _logit_bias(body.get("logit_bias")),
        "model": model,
        "max_tokens": _num(body, key, default_max, 0, MAX_TOKENS_CAP, integer=True),
        "temperature": _num(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": _num(body, "top_p", 1.0, 1e-6, 1.0),
        "top_k": _num(body, "top_k", 0, 0, 1 << 20, integer=True),
        "seed": _num(body, "seed", 0, -(1 << 63), (1 << 63) - 1, integer=True),
        "presence_penalty": _num(body, "presence_penalty", 0.0, -2.0, 2.0),
        "frequency_penalty": _num(body, "frequency_penalty", 0.0, -2.0, 2.0),
        "stop": stops, "stream": stream, "include_usage": bool(opts.get("include_usage", False)),
    }


def _logit_bias(v: Any) -> dict[int, float] | None:
    """``{"token id": bias}``: ids as decimal strings, biases between -100 and 100."""
    if v is None or v == {}:
        return None
    if not isinstance(v, dict):
        raise _bad("'logit_bias' must be an object mapping token ids to biases", "logit_bias")
    out: dict[int, float] = {}
    for k, b in v.items():
        if not (isinstance(k, str) and k.strip().isdigit() and k.strip().isascii()
                and len(k.strip()) <= 12):
            raise _bad(f"logit_bias: the key {k[:24]!r} is not a token id (a non-negative "
                       "integer as a string)", "logit_bias")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
            raise _bad(f"logit_bias[{k!r}] must be a number between -100 and 100, got {b!r}",
                       "logit_bias")
        out[int(k)] = float(b)
    return out


def _response_format(rf: Any) -> dict[str, Any] | None:
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("name"), str) or not js["name"]:
            raise _bad("response_format.json_schema must be an object with a 'name'",
                       "response_format.json_schema")
        if not isinstance(js.get("schema", {}), dict):
            raise _bad("response_format.json_schema.schema must be a JSON Schema object",
                       "response_format.json_schema.schema")
        if js.get("strict") is not None and not isinstance(js["strict"], bool):
            raise _bad("response_format.json_schema.strict must be true or false",
                       "response_format.json_schema.strict")
        return {"type": "json_schema", "json_schema": js}
    raise _unsupported(f"response_format type {kind!r} is not supported: use text, json_object "
                       "or json_schema", "response_format")


def _content(m: dict[str, Any], i: int) -> str | None:
    """A message's text (``None`` when it has none: templates get ``""``)."""
    content = m.get("content")
    if isinstance(content, list):          # [{"type": "text", "text": ...}, ...]
        if not all(isinstance(p, dict) and p.get("type") == "text" and
                   isinstance(p.get("text"), str) for p in content):
            raise _unsupported(f"messages[{i}].content: only text parts are supported",
                               f"messages[{i}].content")
        content = "".join(p["text"] for p in content)
    if content is not None and not isinstance(content, str):
        raise _bad(f"messages[{i}].content must be a string", f"messages[{i}].content")
    return content


def _tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """The calls as given (each whole: the template reads ``id``, ``type`` and ``function``);
    ``function.arguments`` may be an object or its JSON string, which rendering decodes once."""
    param = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise _bad(f"{param} must be a list", param)
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(f"{param}[{j}] needs function.name", f"{param}[{j}]")
        if not isinstance(fn.get("arguments", ""), (str, dict)):
            raise _bad(f"{param}[{j}].function.arguments must be an object or its JSON string",
                       f"{param}[{j}].function.arguments")
    return calls


def _tools(body: dict[str, Any]) -> tuple[tuple[dict[str, Any], ...] | None, Any]:
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise _bad("'tool_choice' needs 'tools'", "tool_choice")
        return None, None
    if not isinstance(tools, list):
        raise _bad("'tools' must be a list", "tools")
    for j, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise _unsupported(f"tools[{j}]: only function tools are supported", f"tools[{j}]")
        fn = t.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad(f"tools[{j}] needs function.name", f"tools[{j}].function.name")
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or \
                not isinstance(fn.get("name"), str):
            raise _unsupported("tool_choice must be 'none', 'auto', 'required' or "
                               "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
        if fn["name"] not in {t["function"]["name"] for t in tools}:
            raise _bad(f"tool_choice names the function {fn['name']!r}, which is not in "
                       "'tools'", "tool_choice")
        choice = {"type": "function", "function": {"name": fn["name"]}}
    elif choice not in ("auto", "none", "required"):
        raise _bad(f"tool_choice {choice!r} is not one of none, auto, required or a named "
                   "function", "tool_choice")
    return tuple({"type": "function", **t} for t in tools), choice


def parse_chat(body: Any, default_max: int = 256) -> CompletionRequest:
    c = _common(body, default_max, _CHAT)
    rf = _response_format(body.get("response_format"))
    mods = body.get("modalities")
    if mods is not None and mods != ["text"]:
        raise _unsupported("only the 'text' modality is supported", "modalities")
    logprobs = _flag(body, "logprobs")
    top = _num(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS, integer=True)
    if body.get("top_logprobs") is not None and not logprobs:
        raise _bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise _bad(f"messages[{i}] needs a 'role' of {', '.join(_ROLES)}", f"messages[{i}].role")
        # the whole message reaches the template, less null fields (as transformers drops
        # them); a missing or null content is "", which every template takes
        msg: dict[str, Any] = {k: v for k, v in m.items() if v is not None}
        msg["content"] = _content(m, i) or ""
        if "tool_calls" in msg:
            msg["tool_calls"] = _tool_calls(msg["tool_calls"], i)
        for k in _TEXT_FIELDS:
            if k in msg and not isinstance(msg[k], str):
                raise _bad(f"messages[{i}].{k} must be a string", f"messages[{i}].{k}")
        out.append(msg)
    tools, choice = _tools(body)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    return CompletionRequest(True, tuple(out), None, **c, logprobs=logprobs, top_logprobs=top,
                             tools=tools, tool_choice=choice, response_format=rf,
                             parallel_tool_calls=parallel is not False)


def parse_completion(body: Any, default_max: int = 16) -> CompletionRequest:
    c = _common(body, default_max, _COMPLETION)
    if body.get("echo"):
        raise _unsupported("'echo': true is not supported", "echo")
    if body.get("best_of") not in (None, 1):
        raise _unsupported("only best_of=1 is supported", "best_of")
    if body.get("suffix"):
        raise _unsupported("'suffix' (insertion) is not supported", "suffix")
    lp = body.get("logprobs")
    if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= 5):
        raise _bad("'logprobs' must be an integer between 0 and 5", "logprobs")
    prompt, tokens = _prompt(body.get("prompt"))
    return CompletionRequest(False, None, prompt, **c, logprobs=lp is not None,
                             top_logprobs=lp or 0, prompt_tokens=tokens)


def _is_ids(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in v)


def _prompt(prompt: Any) -> tuple[str | None, tuple[int, ...] | None]:
    """The API's four prompt forms: a string, token ids, or a list of either (a batch: one
    prompt per request is served here)."""
    if isinstance(prompt, str):
        return prompt, None
    if _is_ids(prompt):
        return None, tuple(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and (
            all(isinstance(p, str) for p in prompt) or all(_is_ids(p) for p in prompt)):
        raise _unsupported(f"a batch of {len(prompt)} prompts is not supported: send one "
                           "prompt per request", "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0], None
    if isinstance(prompt, list) and len(prompt) == 1 and _is_ids(prompt[0]):
        return None, tuple(prompt[0])
    raise _bad("'prompt' must be a string, a list of token ids (integers), or a list holding "
               "one of either", "prompt")
