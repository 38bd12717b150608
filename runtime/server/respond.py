"""OpenAI response bodies: whole responses and stream chunks, chat and text completions.

Chat logprobs are ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``; text
completions' are ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` (the
``top_logprobs`` a list of ``{token: logprob}`` maps, ``None`` when none were asked for).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from .schema import CompletionRequest
from .session import Outcome

__all__ = ["response_id", "usage", "chunk", "last_chunk", "final"]


def response_id(req: CompletionRequest) -> str:
    return ("chatcmpl-" if req.chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(out: Outcome) -> dict[str, int]:
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens}


def _chat_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    return {"content": [{k: v for k, v in e.items() if k != "text_offset"} for e in entries],
            "refusal": None}


def _text_logprobs(req: CompletionRequest, entries: list[dict[str, Any]]) -> dict[str, Any]:
    return {"tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": ([{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries]
                             if req.top_logprobs else None),
            "text_offset": [e["text_offset"] for e in entries]}


def _logprobs(req: CompletionRequest, entries: list[dict[str, Any]] | None) -> Any:
    if not req.logprobs:
        return None
    entries = entries or []
    return _chat_logprobs(entries) if req.chat else _text_logprobs(req, entries)


def _finish(out: Outcome) -> str:
    return out.finish_reason if out.finish_reason in ("stop", "tool_calls") else "length"


def chunk(req: CompletionRequest, rid: str, model: str, delta: dict[str, Any],
          finish: str | None = None) -> dict[str, Any]:
    """One stream event for a ``Session`` delta (``{"text"|"content"|..., "logprobs"}``)."""
    lp = _logprobs(req, delta.get("logprobs")) if delta.get("logprobs") or finish is None else None
    if req.chat:
        d = {k: v for k, v in delta.items() if k != "logprobs"}
        if "tool_calls" in d:
            d = {"tool_calls": [dict(c) for c in d["tool_calls"]]}
        choice = {"index": 0, "delta": d, "logprobs": lp, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": delta.get("text", ""), "logprobs": lp, "finish_reason": finish}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model,
            "choices": [choice]}


def last_chunk(req: CompletionRequest, rid: str, model: str, out: Outcome) -> dict[str, Any]:
    c = chunk(req, rid, model, {}, _finish(out))
    c["timings"] = out.timings
    if req.include_usage:
        c["usage"] = usage(out)
    return c


def final(req: CompletionRequest, out: Outcome, model: str) -> dict[str, Any]:
    lp = _logprobs(req, out.logprobs)
    if req.chat:
        msg: dict[str, Any] = {"role": "assistant",
                               "content": out.content if out.content or not out.tool_calls else None}
        if out.reasoning:
            msg["reasoning_content"] = out.reasoning
        if out.tool_calls:
            msg["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in out.tool_calls]
        choice = {"index": 0, "message": msg, "logprobs": lp, "finish_reason": _finish(out)}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": out.text, "logprobs": lp, "finish_reason": _finish(out)}
        obj = "text_completion"
    return {"id": response_id(req), "object": obj, "created": int(time.time()), "model": model,
            "choices": [choice], "usage": usage(out), "timings": out.timings}
