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
with ``arguments`` a JSON string. A call streams as it is written once its name is: ``("tool_start",
name)``, then ``("tool_args", text)`` pieces of the arguments as the model writes them (held
back where they could be the call's closing), then ``("tool_end", text)``, the rest; the pieces
join into the call's arguments (GLM's, not JSON as written, come whole in ``tool_end``). Text
that does not parse as a call, and whose name was not seen, is given back as content, never
dropped.
"""

from __future__ import annotations

import json
import re
from typing import Any, Sequence

from .harmony import Event, HarmonyState, add_content, partial, send_args

__all__ = ["ToolSyntax", "syntax_for", "ToolStream", "parse_all", "assemble"]


class ToolSyntax:
    """A family whose calls sit between ``call_start`` and ``call_end`` markers."""

    def __init__(self, name: str, call_start: str, call_end: str, opener: str | None = None,
                 closers: Sequence[str] = (), inner: Sequence[str] = (),
                 forced: tuple[str, str, str] = ("", "", "")) -> None:
        self.name, self.call_start, self.call_end = name, call_start, call_end
        #: how a call is written right after the generation prompt: (the text before the
        #: name, between the name and the arguments, after the arguments)
        self.forced = forced
        self.opener = opener or call_start
        self.closers = tuple(closers)
        #: every marker the syntax uses: control tokens with these names must be decoded
        self.markers = tuple(sorted({call_start, call_end, self.opener, *closers, *inner}))

    def parse_call(self, body: str, tools: Sequence[dict[str, Any]]) -> dict[str, str] | None:
        """One call's ``{"name", "arguments"}`` from the text between the markers, or None when
        it is not a call (the text then stays content). The marker-delimited families define
        it; harmony's messages are parsed by their own state machine (``_HarmonyState``)."""
        return None

    #: whether the arguments are written as JSON text (streamed as written) or not (GLM)
    raw_args = True

    def head(self, body: str) -> tuple[str, int] | None:
        """(the name, where the arguments start in ``body``) once a call's opening is whole."""
        return None

    def tail(self, args: str) -> str:
        """The arguments' text, less what closes the call after them."""
        return args.strip()


_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]+)"\s*,\s*"arguments"\s*:\s*')


class _Hermes(ToolSyntax):
    def head(self, body):
        m = _HERMES_HEAD.match(body)
        return (m.group(1), m.end()) if m else None

    def tail(self, args):
        args = args.rstrip()
        return (args[:-1] if args.endswith("}") else args).strip()   # the object around it

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


_GLM_HEAD = re.compile(r"\s*([^\s<]+)\s*(?=<|\n)")


class _GLM(ToolSyntax):
    raw_args = False

    def head(self, body):
        m = _GLM_HEAD.match(body)
        return (m.group(1), m.end()) if m else None

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


_DS_HEAD = re.compile(r"\s*function<｜tool▁sep｜>([^\n`]+?)\s*\n```(?:json)?[ \t]*\n|"
                      r"\s*(?!function<)([^<\n]+?)<｜tool▁sep｜>")


class _DeepSeek(ToolSyntax):
    def head(self, body):
        m = _DS_HEAD.match(body)
        return ((m.group(1) or m.group(2)).strip(), m.end()) if m else None

    def tail(self, args):
        return args.strip().rstrip("`").strip()                      # R1's closing fence

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


HERMES = _Hermes("hermes", "<tool_call>", "</tool_call>",
                 forced=('<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>"))
GLM = _GLM("glm", "<tool_call>", "</tool_call>",
           inner=("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
           forced=("<tool_call>", "\n", "</tool_call>"))
_DS = dict(opener="<｜tool▁calls▁begin｜>", closers=("<｜tool▁calls▁end｜>",), inner=("<｜tool▁sep｜>",))
DEEPSEEK = _DeepSeek("deepseek", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", **_DS,
                     forced=("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
                             "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"))
#: R1 and V3: ``function<｜tool▁sep｜>NAME`` and the arguments in a fenced json block
DEEPSEEK_R1 = _DeepSeek("deepseek-r1", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", **_DS,
                        forced=("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>",
                                "\n```json\n", "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"))
HARMONY = _Harmony("harmony", "<|channel|>", "<|end|>",
                   inner=("<|start|>", "<|message|>", "<|constrain|>", "<|call|>", "<|return|>"),
                   forced=(" to=functions.", "<|channel|>commentary json<|message|>", "<|call|>"))


def syntax_for(template: str) -> ToolSyntax | None:
    """The tool-call syntax ``template`` (a chat template's source) teaches, if a known one."""
    if "<arg_key>" in template and "<tool_call>" in template:
        return GLM
    if "<tool_call>" in template:
        return HERMES
    if "<｜tool▁call▁begin｜>" in template:
        return DEEPSEEK_R1 if "```json" in template else DEEPSEEK
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


class ToolStream:
    """Streamed text → content and tool-call events for one syntax."""

    def __init__(self, syntax: ToolSyntax, tools: Sequence[dict[str, Any]]) -> None:
        self.syntax, self.tools = syntax, tools
        self.buf, self.inside = "", False
        self.open: str | None = None            # the name of the call being streamed
        self.at, self.sent = 0, ""              # where its arguments start; what went out
        self._h = HarmonyState() if isinstance(syntax, _Harmony) else None

    def push(self, piece: str) -> list[Event]:
        if self._h is not None:
            return self._h.push(piece)
        self.buf += piece
        out: list[Event] = []
        while True:
            if not self.inside:
                i = self.buf.find(self.syntax.opener)
                if i < 0:
                    k = partial(self.buf, self.syntax.opener)
                    add_content(out, self.buf[:len(self.buf) - k])
                    self.buf = self.buf[len(self.buf) - k:]
                    return out
                add_content(out, self.buf[:i])
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
            if not rest or s.call_start.startswith(rest):
                return False
            if rest.startswith(s.call_start) and s.call_end not in rest:
                self._stream(out, rest[len(s.call_start):])
                return False
            if rest.startswith(s.call_start):
                j = rest.index(s.call_end)
                body = rest[len(s.call_start):j]
                if self.open is None:
                    self._stream(out, body)
                if self.open is not None:
                    self._close(out, body)
                elif (call := s.parse_call(body, self.tools)) is None:
                    add_content(out, rest[:j + len(s.call_end)])
                else:
                    out.append(("tool", call))
                self.buf = rest[j + len(s.call_end):]
                continue
            if any(c.startswith(rest) for c in s.closers):
                return False
            self.inside = False                 # plain text after the calls
            self.buf = orig if orig.lstrip() == rest else rest
            return True

    def _stream(self, out: list[Event], body: str) -> None:
        """The news of the unclosed call whose text so far is ``body``."""
        s = self.syntax
        if self.open is None:
            h = s.head(body)
            if h is None:
                return
            self.open, self.at, self.sent = h[0], h[1], ""
            out.append(("tool_start", h[0]))
        if s.raw_args:
            args = body[self.at:]
            send_args(out, self, s.tail(args[:len(args) - partial(args, s.call_end)]))

    def _close(self, out: list[Event], body: str) -> None:
        if self.syntax.raw_args:
            final = self.syntax.tail(body[self.at:]) or "{}"
        else:
            call = self.syntax.parse_call(body, self.tools)
            final = call["arguments"] if call is not None else "{}"
        out.append(("tool_end", final[len(self.sent):]))
        self.open = None

    def finish(self) -> list[Event]:
        if self._h is not None:
            return self._h.finish()
        out: list[Event] = []
        rest, self.buf = self.buf, ""
        if self.open is not None:               # a call the end of generation closed
            self._close(out, rest.strip()[len(self.syntax.call_start):])
            return out
        if self.inside and rest.strip().startswith(self.syntax.call_start):
            call = self.syntax.parse_call(rest.strip()[len(self.syntax.call_start):], self.tools)
            if call is not None:                # a call the end of generation closed
                out.append(("tool", call))
                return out
        if rest.strip() and rest.strip() not in self.syntax.closers:
            add_content(out, rest)
        return out


def parse_all(syntax: ToolSyntax, tools: Sequence[dict[str, Any]], text: str) -> list[Event]:
    """Every event in a whole generated ``text``, streamed calls assembled (``assemble``)."""
    s = ToolStream(syntax, tools)
    return assemble(s.push(text) + s.finish())


def assemble(events: list[Event]) -> list[Event]:
    """``events`` with each streamed call (``tool_start``, ``tool_args``..., ``tool_end``) as
    one ``("tool", {"name", "arguments"})`` and neighbouring texts of a kind joined."""
    out: list[Event] = []
    for kind, v in events:
        if kind == "tool_start":
            out.append(("tool", {"name": v, "arguments": ""}))
        elif kind in ("tool_args", "tool_end"):
            out[-1][1]["arguments"] += v
        elif kind != "tool" and out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + v)
        else:
            out.append((kind, v))
    return out
