"""A request body → a JSON value, within explicit limits, or a 4xx ``RequestError``.

The limits (``ServerConfig`` and ``expertfs serve`` options, each named in its error):

- ``max_body`` bytes (413 ``body_too_large``);
- ``body_timeout`` seconds for the whole body to arrive (408 ``body_timeout``), so a client
  that sends it a byte at a time holds a connection for a bounded time;
- ``max_depth`` levels of nested arrays and objects (400 ``body_too_deep``);
- ``header_timeout`` seconds for a request's head (its request line and headers) to arrive,
  counted from the connection's opening or the end of its previous response (so an idle
  keep-alive connection too): a client that sends its headers a byte at a time, or nothing,
  is disconnected (no response can be framed before the head is whole).

The JSON is strict: UTF-8 (or the UTF-16/32 that RFC 8259 detection names), no ``NaN`` or
``Infinity``, integers of at most 4,300 digits; a duplicated key keeps its last value (as
Python's and JavaScript's parsers do). A string holding a lone UTF-16 surrogate (``"\\ud800"``,
valid JSON escape but no Unicode text) is refused naming where it is, before it can reach
the tokenizer or the chat template.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from .schema import RequestError

__all__ = ["MAX_DEPTH", "BODY_TIMEOUT", "HEADER_TIMEOUT", "read_json", "decode_json"]

MAX_DEPTH = 64
BODY_TIMEOUT = 30.0
HEADER_TIMEOUT = 30.0


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _where(path: list[str | int]) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "body"


def _surrogate(s: str) -> int:
    """Index of the first lone surrogate in ``s``, or -1."""
    try:
        s.encode("utf-8")
        return -1
    except UnicodeEncodeError as e:
        return e.start


def _check(value: Any, max_depth: int) -> None:
    """Depth and text checks, iteratively (a deep value cannot exhaust the stack here)."""
    stack: list[tuple[Any, list[str | int]]] = [(value, [])]
    while stack:
        v, path = stack.pop()
        if isinstance(v, str):
            i = _surrogate(v)
            if i >= 0:
                where = _where(path)
                raise RequestError(400, f"{where} holds a lone UTF-16 surrogate "
                                   f"(\\u{ord(v[i]):04x} at character {i}), which is not text",
                                   param=None if where == "body" else where,
                                   code="invalid_unicode")
            continue
        if not isinstance(v, (dict, list)):
            continue
        if len(path) >= max_depth:
            raise RequestError(400, f"the body nests arrays and objects deeper than the limit "
                               f"of {max_depth} levels (--max-depth)", code="body_too_deep")
        if isinstance(v, dict):
            for k, x in v.items():
                if _surrogate(k) >= 0:
                    raise RequestError(400, f"a key in {_where(path)} holds a lone UTF-16 "
                                       "surrogate, which is not text", code="invalid_unicode")
                if isinstance(x, (str, dict, list)):
                    stack.append((x, path + [k]))
        else:
            stack.extend((x, path + [i]) for i, x in enumerate(v)
                         if isinstance(x, (str, dict, list)))


def decode_json(raw: bytes, max_depth: int = MAX_DEPTH) -> Any:
    """``raw`` as a JSON value (``None`` for an empty body), or a 400 naming the problem."""
    if not raw.strip():
        return None
    try:
        value = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise RequestError(400, f"the body nests arrays and objects deeper than the limit of "
                           f"{max_depth} levels (--max-depth)", code="body_too_deep") from None
    except UnicodeDecodeError as e:
        raise RequestError(400, f"the body is not valid UTF-8: {e.reason} at byte {e.start}",
                           code="invalid_json") from None
    except ValueError as e:                    # JSONDecodeError, NaN, over-long integers
        raise RequestError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    _check(value, max_depth)
    return value


async def read_json(request: Any, *, max_body: int, timeout: float = BODY_TIMEOUT,
                    max_depth: int = MAX_DEPTH) -> Any:
    """The request's body read within ``timeout`` seconds and decoded by ``decode_json``."""
    try:
        raw = await asyncio.wait_for(request.read(), timeout)
    except asyncio.TimeoutError:
        raise RequestError(408, f"the request body did not arrive within {timeout:g} s "
                           "(--body-timeout)", code="body_timeout") from None
    except Exception as e:
        if getattr(e, "status", None) == 413:
            raise RequestError(413, f"the request body is larger than the limit of {max_body} "
                               "bytes (--max-body)", code="body_too_large") from None
        raise
    return decode_json(raw, max_depth)
