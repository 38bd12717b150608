"""Chat templates rendered as transformers' ``apply_chat_template`` renders them.

The Jinja environment is transformers' (``utils/chat_template_utils.py``): an immutable sandbox
with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension and the
``{% generation %}`` block (rendered as its body), ``tojson`` taking ``ensure_ascii``,
``indent``, ``separators`` and ``sort_keys`` (never escaping HTML), ``raise_exception``,
``strftime_now`` and transformers' restricted ``dict`` and ``namespace``. The template sees
``messages``, ``tools`` and ``documents`` (``None`` when not given), ``add_generation_prompt``,
the special tokens the model has and any extra keyword. Messages are prepared the same way:
keys whose value is ``None`` are dropped, and reasoning is aliased (``reasoning_content``,
``thinking`` or ``reasoning`` fills both ``reasoning_content`` and ``thinking``, the name gpt-oss
reads). One addition: tool-call arguments given as a JSON string of an object are decoded once,
as templates index into them. Anything the template refuses is a ``ChatTemplateError``.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Mapping, Sequence

from ...errors import UsageError

__all__ = ["ChatTemplateError", "render_chat", "template_messages"]

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(UsageError):
    """The model's chat template refused these messages (or could not be compiled)."""


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict(...)`` for templates, without the attribute access a real type gives."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


@lru_cache(maxsize=1)
def _environment() -> Any:
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}``: the body, as transformers renders it."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """``namespace(...)`` that refuses underscore-prefixed attributes."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot store underscore-prefixed attributes on a "
                    f"namespace, but got {name!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = Namespace
    return env


@lru_cache(maxsize=16)
def _compiled(template: str) -> Any:
    return _environment().from_string(template)


def _plain(value: Any) -> Any:
    """A deep copy of JSON-like data, so nothing a template sees is shared with the caller."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return value


def _decoded_call(call: Any) -> Any:
    """A tool call whose ``function.arguments`` JSON string is decoded once, when it holds an
    object (anything else stays the string it was)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        return call
    if not isinstance(args, dict):
        return call
    return {**call, "function": {**fn, "arguments": args}}


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The messages as the template sees them (see the module docstring)."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"messages[{i}] is a {type(m).__name__}, not an object")
        msg = {k: _plain(v) for k, v in m.items() if v is not None}
        if isinstance(msg.get("tool_calls"), list):
            msg["tool_calls"] = [_decoded_call(c) for c in msg["tool_calls"]]
        reasoning = next((msg[k] for k in _REASONING_FIELDS if msg.get(k) is not None), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        out.append(msg)
    return out


def render_chat(template: str, messages: Sequence[Mapping[str, Any]], *,
                tools: Sequence[Mapping[str, Any]] | None = None,
                documents: Sequence[Mapping[str, Any]] | None = None,
                add_generation_prompt: bool = True, **kwargs: Any) -> str:
    """``template`` rendered over ``messages`` (``kwargs``: the special tokens, such as
    ``bos_token``, and any variable the template reads, such as ``enable_thinking``)."""
    from jinja2 import TemplateError
    try:
        compiled = _compiled(template)
    except TemplateError as e:
        raise ChatTemplateError(f"the model's chat template cannot be compiled: {e}") from None
    msgs = template_messages(messages)
    try:
        return compiled.render(
            messages=msgs, tools=_plain(list(tools)) if tools is not None else None,
            documents=_plain(list(documents)) if documents is not None else None,
            add_generation_prompt=add_generation_prompt, **_plain(kwargs))
    except TemplateError as e:
        raise ChatTemplateError(f"the chat template failed on these messages: {e}") from None
    except (TypeError, ValueError, AttributeError, KeyError, IndexError,
            ArithmeticError, RecursionError) as e:
        raise ChatTemplateError(f"the chat template failed on these messages: "
                                f"{type(e).__name__}: {e}") from None
