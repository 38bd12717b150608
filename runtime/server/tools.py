"""Tool calls: which syntax a chat template teaches its model, and parsing it back out of the
generated text into OpenAI ``tool_calls``, streamed (``ToolStream.push`` as text arrives).

Families, told apart by what their template writes:

- Qwen3 / Hermes: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
- GLM-4.5: ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>``
  (a value is JSON unless the tool's schema says the parameter is a string);
- DeepSeek: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>``
  (V3.1), or ``function<｜tool▁sep｜>NAME`` and the arguments in a fenced json block (R1, V3);
- gpt-oss (harmony): messages ``<|channel|>CHANNEL [to=functions.NAME]<|message|>BODY<|end|>``;
  the ``final`` channel is content, ``analysis`` is reasoning, a recipient makes a call.

Events are ``("content", text)``, ``("reasoning", text)`` and ``("tool", {"name", "arguments"})``
with ``arguments`` a JSON string. Text that does not parse as a call is given back as content,
never dropped.
"""

from __future__ import annotations

import json
import re
from typing import Any, Sequence

__all__ = ["ToolSyntax", "syntax_for", "ToolStream", "parse_all"]

Event = tuple[str, Any]


class ToolSyntax:
    """A family whose calls sit between ``call_start`` and ``call_end`` markers."""

    def __init__(self, name: str, call_start: str, call_end: str, opener: str | None = None,
                 closers: Sequence[str] = (), inner: Sequence[str] = ()) -> None:
        self.name, self.call_start, self.call_end = name, call_start, call_end
        self.opener = opener or call_start
        self.closers = tuple(closers)
        #: every marker the syntax uses: control tokens with these names must be decoded
        self.markers = tuple(sorted({call_start, call_end, self.opener, *closers, *inner}))

    def parse_call(self, body: str, tools: Sequence[dict[str, Any]]) -> dict[str, str] | None:
        """One call's ``{"name", "arguments"}`` from the text between the markers, or None when
        it is not a call (the text then stays content). The marker-delimited families define
        it; harmony's messages are parsed by their own state machine (``_HarmonyState``)."""
        return None


class _Hermes(ToolSyntax):
    def parse_call(self, body, tools):
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        return {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}


_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


class _GLM(ToolSyntax):
    def parse_call(self, body, tools):
        name = body.split("<arg_key>", 1)[0].strip()
        if not name or "\n" in name or "<" in name:
            return None
        props = _properties(tools, name)
        args: dict[str, Any] = {}
        for k, v in _GLM_ARG.findall(body):
            k = k.strip()
            if props.get(k, {}).get("type") == "string":
                args[k] = v
                continue
            try:
                args[k] = json.loads(v)
            except json.JSONDecodeError:
                args[k] = v
        return {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}


_FENCE = re.compile(r"^\s*([^\n`]+?)\s*\n```(?:json)?\s*\n?(.*?)\n?```\s*$", re.S)


class _DeepSeek(ToolSyntax):
    def parse_call(self, body, tools):
        if "<｜tool▁sep｜>" not in body:
            return None
        left, right = body.split("<｜tool▁sep｜>", 1)
        if left.strip() == "function" and (m := _FENCE.match(right)):
            name, raw = m.group(1).strip(), m.group(2)
        else:
            name, raw = left.strip(), right.strip()
        try:
            args = json.loads(raw or "{}")
        except json.JSONDecodeError:
            return None
        if not name or not isinstance(args, dict):
            return None
        return {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}


class _Harmony(ToolSyntax):
    """Harmony's markers (its messages go through ``_HarmonyState``, not ``parse_call``)."""


HERMES = _Hermes("hermes", "<tool_call>", "</tool_call>")
GLM = _GLM("glm", "<tool_call>", "</tool_call>",
           inner=("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"))
DEEPSEEK = _DeepSeek("deepseek", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                     opener="<｜tool▁calls▁begin｜>", closers=("<｜tool▁calls▁end｜>",),
                     inner=("<｜tool▁sep｜>",))
HARMONY = _Harmony("harmony", "<|channel|>", "<|end|>",
                   inner=("<|start|>", "<|message|>", "<|constrain|>", "<|call|>", "<|return|>"))


def syntax_for(template: str) -> ToolSyntax | None:
    """The tool-call syntax ``template`` (a chat template's source) teaches, if a known one."""
    if "<arg_key>" in template and "<tool_call>" in template:
        return GLM
    if "<tool_call>" in template:
        return HERMES
    if "<｜tool▁call▁begin｜>" in template:
        return DEEPSEEK
    if "to=functions" in template or "<|call|>" in template:
        return HARMONY
    return None


def _properties(tools: Sequence[dict[str, Any]], name: str) -> dict[str, Any]:
    for t in tools:
        fn = t.get("function", {})
        if fn.get("name") == name:
            props = (fn.get("parameters") or {}).get("properties") or {}
            return props if isinstance(props, dict) else {}
    return {}


def _partial(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` could begin ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ToolStream:
    """Streamed text → content and tool-call events for one syntax."""

    def __init__(self, syntax: ToolSyntax, tools: Sequence[dict[str, Any]]) -> None:
        self.syntax, self.tools = syntax, tools
        self.buf, self.inside = "", False
        self._h = _HarmonyState() if isinstance(syntax, _Harmony) else None

    def push(self, piece: str) -> list[Event]:
        if self._h is not None:
            return self._h.push(piece)
        self.buf += piece
        out: list[Event] = []
        while True:
            if not self.inside:
                i = self.buf.find(self.syntax.opener)
                if i < 0:
                    k = _partial(self.buf, self.syntax.opener)
                    _content(out, self.buf[:len(self.buf) - k])
                    self.buf = self.buf[len(self.buf) - k:]
                    return out
                _content(out, self.buf[:i])
                self.buf, self.inside = self.buf[i:], True
                if self.syntax.opener != self.syntax.call_start:
                    self.buf = self.buf[len(self.syntax.opener):]
            if not self._calls(out):
                return out

    def _calls(self, out: list[Event]) -> bool:
        """Takes the complete calls in the buffer; True when it left tool mode (more to scan)."""
        s = self.syntax
        while True:
            orig = self.buf
            rest = self.buf.lstrip()
            for c in s.closers:
                if rest.startswith(c):
                    rest = rest[len(c):].lstrip()
            if not rest or s.call_start.startswith(rest) or rest.startswith(s.call_start) \
                    and s.call_end not in rest:
                return False
            if rest.startswith(s.call_start):
                j = rest.index(s.call_end)
                call = s.parse_call(rest[len(s.call_start):j], self.tools)
                if call is None:
                    _content(out, rest[:j + len(s.call_end)])
                else:
                    out.append(("tool", call))
                self.buf = rest[j + len(s.call_end):]
                continue
            if any(c.startswith(rest) for c in s.closers):
                return False
            self.inside = False                 # plain text after the calls
            self.buf = orig if orig.lstrip() == rest else rest
            return True

    def finish(self) -> list[Event]:
        if self._h is not None:
            return self._h.finish()
        out: list[Event] = []
        rest, self.buf = self.buf, ""
        if self.inside and rest.strip().startswith(self.syntax.call_start):
            call = self.syntax.parse_call(rest.strip()[len(self.syntax.call_start):], self.tools)
            if call is not None:                # a call the end of generation closed
                out.append(("tool", call))
                return out
        if rest.strip() and rest.strip() not in self.syntax.closers:
            _content(out, rest)
        return out


def _content(out: list[Event], text: str) -> None:
    if text:
        if out and out[-1][0] == "content":
            out[-1] = ("content", out[-1][1] + text)
        else:
            out.append(("content", text))


_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


class _HarmonyState:
    """Harmony messages: a header up to ``<|message|>``, then a body up to ``<|end|>``."""

    ENDS = ("<|end|>", "<|call|>", "<|return|>")

    def __init__(self) -> None:
        self.buf, self.kind, self.name = "", None, ""   # kind None: in a header

    def push(self, piece: str) -> list[Event]:
        self.buf += piece
        out: list[Event] = []
        while True:
            if self.kind is None:
                i = self.buf.find("<|message|>")
                if i < 0:
                    return out
                header, self.buf = self.buf[:i], self.buf[i + len("<|message|>"):]
                m = _RECIPIENT.search(header)
                ch = _CHANNEL.search(header)
                self.name = m.group(1) if m else ""
                self.kind = "tool" if m else ("reasoning" if ch and ch.group(1) == "analysis"
                                              else "content")
                continue
            ends = [(self.buf.find(e), e) for e in self.ENDS if e in self.buf]
            if ends:
                j, e = min(ends)
                self._body(out, self.buf[:j], True)
                self.buf, self.kind = self.buf[j + len(e):], None
                if self.buf.startswith("<|start|>"):
                    self.buf = self.buf[len("<|start|>"):]
                continue
            k = max(_partial(self.buf, e) for e in self.ENDS)
            if self.kind != "tool":
                self._body(out, self.buf[:len(self.buf) - k], False)
                self.buf = self.buf[len(self.buf) - k:]
            return out

    def _body(self, out: list[Event], text: str, done: bool) -> None:
        if self.kind == "tool":
            if done:
                out.append(("tool", {"name": self.name, "arguments": text.strip() or "{}"}))
            return
        if text:
            if self.kind == "content":
                _content(out, text)
            else:
                out.append(("reasoning", text))

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self.kind is None:
            _content(out, self.buf)
        else:
            self._body(out, self.buf, True)
        self.buf, self.kind = "", None
        return out


def parse_all(syntax: ToolSyntax, tools: Sequence[dict[str, Any]], text: str) -> list[Event]:
    """Every event in a whole generated ``text``."""
    s = ToolStream(syntax, tools)
    return _merge(s.push(text) + s.finish())


def _merge(events: list[Event]) -> list[Event]:
    out: list[Event] = []
    for kind, v in events:
        if kind != "tool" and out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + v)
        else:
            out.append((kind, v))
    return out
