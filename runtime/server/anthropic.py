"""Anthropic Messages API bodies: a request → ``CompletionRequest``, an ``Outcome`` → a message,
session deltas → stream events, and errors in Anthropic's shape.

Requests (``POST /v1/messages``, ``/v1/messages/count_tokens``): ``model``, ``system`` (a string
or text blocks), ``messages`` (``user``/``assistant``; content a string or ``text``,
``tool_use``, ``tool_result``, ``thinking`` and ``redacted_thinking`` blocks), ``max_tokens``
(required), ``stop_sequences``, ``temperature``, ``top_p``, ``top_k``, ``tools`` (custom tools
with an ``input_schema``), ``tool_choice`` (``auto``, ``none``, and ``any`` and ``tool``, which
force a call through constrained decoding), ``stream``, ``metadata``, ``service_tier``,
``thinking`` (``disabled`` only), and the fields that describe the caller (``service_tier``,
``cache_control``, ``inference_geo``, ...). Any other field, and any other block type (images,
documents), is a 400 that names it. The messages become the OpenAI-style ones the chat
template takes: ``tool_use`` blocks the assistant's ``tool_calls``, ``tool_result`` blocks
``tool`` messages.

Responses: ``{"id": "msg_…", "type": "message", "role": "assistant", "content": [text,
thinking and tool_use blocks], "stop_reason": end_turn | max_tokens | stop_sequence |
tool_use, "stop_sequence", "usage": {"input_tokens", "output_tokens"}}``. A tool call whose
arguments are not a JSON object is given back as text, never dropped.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from .schema import MAX_TOKENS_CAP, CompletionRequest, RequestError, _flag, _num
from .session import Outcome

__all__ = ["parse_messages", "message", "StreamShaper", "error_body", "ERROR_TYPES",
           "MAX_STOP_SEQUENCES"]

MAX_STOP_SEQUENCES = 64
#: about the caller or the billing, not the generation (``cache_control``: the server reuses
#: the previous prompt's KV cache whatever the hint)
_CALLER = {"metadata", "service_tier", "cache_control", "inference_geo", "user_profile_id",
           "workspace_id", "speed"}
_COUNT = {"model", "messages", "system", "tools", "tool_choice", "thinking", "output_config",
          "cache_control", "speed", "user_profile_id", "workspace_id"}
_KNOWN = _COUNT | _CALLER | {"max_tokens", "stop_sequences", "temperature", "top_p", "top_k",
                             "stream", "diagnostics"}
#: HTTP status → Anthropic's error type
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
               413: "request_too_large", 415: "invalid_request_error", 429: "rate_limit_error",
               503: "overloaded_error", 529: "overloaded_error"}


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error" if status >= 500
                                                               else "invalid_request_error"),
                                       "message": message}}


def _bad(msg: str, param: str) -> RequestError:
    return RequestError(400, msg, param=param, code="invalid_value")


def _unsupported(msg: str, param: str) -> RequestError:
    return RequestError(400, msg, param=param, code="unsupported_parameter")


def _text_blocks(v: Any, param: str) -> str:
    """A string, or a list of ``text`` blocks, as one string."""
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise _bad(f"{param} must be a string or a list of text blocks", param)
    out = []
    for j, b in enumerate(v):
        if not isinstance(b, dict) or b.get("type") != "text":
            kind = b.get("type") if isinstance(b, dict) else None
            raise _unsupported(f"{param}[{j}]: only text blocks are supported here"
                               + (f" (got {kind!r})" if isinstance(kind, str) else ""),
                               f"{param}[{j}]")
        if not isinstance(b.get("text"), str):
            raise _bad(f"{param}[{j}].text must be a string", f"{param}[{j}].text")
        out.append(b["text"])
    return "".join(out)


def _message(m: Any, i: int) -> list[dict[str, Any]]:
    """One Anthropic message → the OpenAI-style messages the chat template takes."""
    param = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise _bad(f"{param} needs a 'role' of user or assistant", f"{param}.role")
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise _bad(f"{param}.content must be a string or a list of content blocks",
                   f"{param}.content")
    text, reasoning, calls, results = [], [], [], []
    for j, b in enumerate(content):
        where = f"{param}.content[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            if not isinstance(b.get("text"), str):
                raise _bad(f"{where}.text must be a string", f"{where}.text")
            text.append(b["text"])
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(b.get("name"), str) or not b["name"]:
                raise _bad(f"{where} needs a 'name'", f"{where}.name")
            args = b.get("input", {})
            if not isinstance(args, dict):
                raise _bad(f"{where}.input must be an object", f"{where}.input")
            cid = b.get("id") if isinstance(b.get("id"), str) else f"toolu_{i}_{j}"
            calls.append({"id": cid, "type": "function",
                          "function": {"name": b["name"], "arguments": args}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(b.get("tool_use_id"), str):
                raise _bad(f"{where} needs a 'tool_use_id'", f"{where}.tool_use_id")
            body = b.get("content", "")
            res = _text_blocks(body if body is not None else "", f"{where}.content")
            if b.get("is_error") is True:
                res = f"Error: {res}"
            results.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": res})
        elif kind == "thinking" and role == "assistant":
            if not isinstance(b.get("thinking"), str):
                raise _bad(f"{where}.thinking must be a string", f"{where}.thinking")
            reasoning.append(b["thinking"])
        elif kind == "redacted_thinking" and role == "assistant":
            continue                           # opaque: nothing a local template can show
        else:
            raise _unsupported(f"{where}: content blocks of type {kind!r} are not supported "
                               f"in a {role} message", f"{where}.type")
    if role == "user":
        return results + ([{"role": "user", "content": "".join(text)}] if text or not results
                          else [])
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if calls:
        msg["tool_calls"] = calls
    if reasoning:
        msg["reasoning_content"] = "".join(reasoning)
    return [msg]


def _tools(body: dict[str, Any]) -> tuple[tuple[dict[str, Any], ...] | None, Any, bool]:
    """(OpenAI-style tools, tool_choice, one call only)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    single = False
    if choice is not None:
        if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
            raise _bad("'tool_choice' must be an object with a 'type' of auto, any, tool or none",
                       "tool_choice")
        single = _flag(choice, "disable_parallel_tool_use")
        if choice["type"] == "tool":
            if not isinstance(choice.get("name"), str) or not choice["name"]:
                raise _bad("tool_choice {'type': 'tool'} needs a 'name'", "tool_choice.name")
            choice = {"type": "function", "function": {"name": choice["name"]}}
        else:
            choice = {"any": "required"}.get(choice["type"], choice["type"])
    if tools is None or tools == []:
        if choice not in (None, "auto", "none"):
            raise _bad("tool_choice 'any' or 'tool' needs 'tools'", "tool_choice")
        return None, None, False
    if not isinstance(tools, list):
        raise _bad("'tools' must be a list", "tools")
    out = []
    for j, t in enumerate(tools):
        if not isinstance(t, dict):
            raise _bad(f"tools[{j}] must be an object", f"tools[{j}]")
        if t.get("type") not in (None, "custom"):
            raise _unsupported(f"tools[{j}]: server tools ({t.get('type')!r}) are not "
                               "supported; give custom tools with an input_schema",
                               f"tools[{j}].type")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise _bad(f"tools[{j}] needs a 'name'", f"tools[{j}].name")
        schema = t.get("input_schema")
        if not isinstance(schema, dict):
            raise _bad(f"tools[{j}] needs an 'input_schema' object", f"tools[{j}].input_schema")
        fn: dict[str, Any] = {"name": t["name"], "parameters": schema}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    if isinstance(choice, dict) and choice["function"]["name"] not in {t["name"] for t in tools}:
        raise _bad(f"tool_choice names the tool {choice['function']['name']!r}, which is not in "
                   "'tools'", "tool_choice.name")
    return tuple(out), choice or "auto", single


def parse_messages(body: Any, count_only: bool = False) -> tuple[CompletionRequest, bool]:
    """(the request, whether only one tool call may be made) for a Messages API body."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object", code="invalid_json")
    known = _COUNT if count_only else _KNOWN
    for k in body:
        if k not in known:
            raise _unsupported(f"the parameter '{k}' is not supported by this server", k)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("'model' must be a string", "model")
    if not count_only and body.get("max_tokens") is None:
        raise _bad("'max_tokens' is required", "max_tokens")
    max_tokens = 1 if count_only else _num(body, "max_tokens", 1, 1, MAX_TOKENS_CAP, integer=True)
    thinking = body.get("thinking")
    if thinking is not None and not (isinstance(thinking, dict)
                                     and thinking.get("type") == "disabled"):
        raise _unsupported("only thinking {'type': 'disabled'} is supported (the chat template "
                           "decides whether the model reasons)", "thinking")
    out_cfg = body.get("output_config")
    if out_cfg is not None and not (isinstance(out_cfg, dict)
                                    and all(v is None for v in out_cfg.values())):
        raise _unsupported("output_config (effort, structured output format) is not supported",
                           "output_config")
    if body.get("diagnostics") is not None:
        raise _unsupported("'diagnostics' (prompt-cache reports) is not supported", "diagnostics")
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise _bad("'metadata' must be an object", "metadata")
    stops = body.get("stop_sequences")
    if stops is None:
        stops = []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) \
            or len(stops) > MAX_STOP_SEQUENCES:
        raise _bad(f"'stop_sequences' must be a list of up to {MAX_STOP_SEQUENCES} strings",
                   "stop_sequences")
    msgs: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        text = _text_blocks(system, "system")
        if text:
            msgs.append({"role": "system", "content": text})
    given = body.get("messages")
    if not isinstance(given, list) or not given:
        raise _bad("'messages' must be a non-empty list", "messages")
    for i, m in enumerate(given):
        msgs.extend(_message(m, i))
    tools, choice, single = _tools(body)
    req = CompletionRequest(
        chat=True, messages=tuple(msgs), prompt=None, model=model, max_tokens=max_tokens,
        temperature=_num(body, "temperature", 1.0, 0.0, 1.0),
        top_p=max(_num(body, "top_p", 1.0, 0.0, 1.0), 1e-6),
        top_k=_num(body, "top_k", 0, 0, 1 << 20, integer=True), seed=0,
        stop=tuple(s for s in stops if s), stream=_flag(body, "stream"), include_usage=True,
        tools=tools, tool_choice=choice, parallel_tool_calls=not single)
    return req, single


def message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def _stop_reason(out: Outcome) -> str:
    if out.finish_reason == "tool_calls":
        return "tool_use"
    if out.finish_reason == "stop":
        return "stop_sequence" if out.stop_sequence is not None else "end_turn"
    return "max_tokens"


def tool_block(call: dict[str, Any]) -> dict[str, Any]:
    """A session tool call as a ``tool_use`` block (or a text block holding it when its
    arguments are not a JSON object)."""
    fn = call["function"]
    try:
        args = json.loads(fn.get("arguments") or "{}")
    except (TypeError, json.JSONDecodeError):
        args = None
    if not isinstance(args, dict):
        return {"type": "text", "text": json.dumps({"name": fn["name"],
                                                    "arguments": fn.get("arguments")})}
    return {"type": "tool_use", "id": _toolu(call), "name": fn["name"], "input": args}


def _toolu(call: dict[str, Any]) -> str:
    cid = str(call.get("id", ""))
    return "toolu_" + (cid[5:] if cid.startswith("call_") else uuid.uuid4().hex[:24])


def usage(out: Outcome) -> dict[str, int]:
    return {"input_tokens": out.prompt_tokens, "output_tokens": out.completion_tokens}


def message(out: Outcome, model: str, single: bool = False) -> dict[str, Any]:
    """The whole response for a finished generation."""
    content: list[dict[str, Any]] = []
    if out.reasoning:
        content.append({"type": "thinking", "thinking": out.reasoning, "signature": ""})
    if out.content:
        content.append({"type": "text", "text": out.content})
    calls = out.tool_calls[:1] if single else out.tool_calls
    content.extend(tool_block(c) for c in calls)
    return {"id": message_id(), "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": _stop_reason(out),
            "stop_sequence": out.stop_sequence, "usage": usage(out)}


class StreamShaper:
    """Session deltas → Messages API stream events (``(event name, data)`` pairs)."""

    def __init__(self, model: str, input_tokens: int, single: bool = False) -> None:
        self.model, self.input_tokens, self.single = model, input_tokens, single
        self.index, self.open, self.calls = -1, None, 0
        self.skip: set[int] = set()             # calls past the first when only one may be made

    def start(self) -> list[tuple[str, dict[str, Any]]]:
        msg = {"id": message_id(), "type": "message", "role": "assistant", "model": self.model,
               "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": self.input_tokens, "output_tokens": 0}}
        return [("message_start", {"type": "message_start", "message": msg}),
                ("ping", {"type": "ping"})]

    def _close(self) -> list[tuple[str, dict[str, Any]]]:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _block(self, kind: str, block: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        if self.open == kind and kind != "tool_use":
            return []
        ev = self._close()
        self.index += 1
        self.open = kind
        return ev + [("content_block_start", {"type": "content_block_start", "index": self.index,
                                              "content_block": block})]

    def _delta(self, delta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return ("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                        "delta": delta})

    def push(self, d: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        ev: list[tuple[str, dict[str, Any]]] = []
        if d.get("content"):
            ev += self._block("text", {"type": "text", "text": ""})
            ev.append(self._delta({"type": "text_delta", "text": d["content"]}))
        if d.get("reasoning_content"):
            ev += self._block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            ev.append(self._delta({"type": "thinking_delta", "thinking": d["reasoning_content"]}))
        for call in d.get("tool_calls") or ():
            fn = call.get("function") or {}
            if "id" not in call:                 # more of a streaming call's arguments
                if call["index"] not in self.skip and fn.get("arguments"):
                    ev.append(self._delta({"type": "input_json_delta",
                                           "partial_json": fn["arguments"]}))
                continue
            if self.single and self.calls:
                self.skip.add(call["index"])
                continue
            self.calls += 1
            if not fn.get("arguments"):          # its arguments follow as they are written
                ev += self._block("tool_use", {"type": "tool_use", "id": _toolu(call),
                                               "name": fn["name"], "input": {}})
                continue
            b = tool_block(call)
            if b["type"] == "text":
                ev += self._block("text", {"type": "text", "text": ""})
                ev.append(self._delta({"type": "text_delta", "text": b["text"]}))
                continue
            ev += self._block("tool_use", {**b, "input": {}})
            ev.append(self._delta({"type": "input_json_delta",
                                   "partial_json": json.dumps(b["input"])}))
            ev += self._close()
        return ev

    def finish(self, out: Outcome) -> list[tuple[str, dict[str, Any]]]:
        return self._close() + [
            ("message_delta", {"type": "message_delta",
                               "delta": {"stop_reason": _stop_reason(out),
                                         "stop_sequence": out.stop_sequence},
                               "usage": usage(out)}),
            ("message_stop", {"type": "message_stop"})]
