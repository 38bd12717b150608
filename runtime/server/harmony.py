"""Harmony's messages (gpt-oss), parsed as they stream, and the text helpers the tool-call
parsers share (``tools``).

A message is a header up to ``<|message|>`` (``<|channel|>CHANNEL``, and ``to=functions.NAME``
for a call), then a body up to ``<|end|>``, ``<|call|>`` or ``<|return|>``: the ``final`` channel
is content, ``analysis`` reasoning, a recipient a call whose body (its JSON arguments) streams
as ``tool_args`` pieces between ``tool_start`` and ``tool_end``.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["Event", "HarmonyState", "partial", "add_content", "send_args"]

Event = tuple[str, Any]


def partial(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` could begin ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def send_args(out: list[Event], st: Any, safe: str) -> None:
    """The arguments shown so far are ``safe``: what ``st`` has not sent of them goes out."""
    if len(safe) > len(st.sent) and safe.startswith(st.sent):
        out.append(("tool_args", safe[len(st.sent):]))
        st.sent = safe


def add_content(out: list[Event], text: str) -> None:
    if text:
        if out and out[-1][0] == "content":
            out[-1] = ("content", out[-1][1] + text)
        else:
            out.append(("content", text))


_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


class HarmonyState:
    """Harmony messages: a header up to ``<|message|>``, then a body up to ``<|end|>``."""

    ENDS = ("<|end|>", "<|call|>", "<|return|>")

    def __init__(self) -> None:
        self.buf, self.kind, self.name = "", None, ""   # kind None: in a header
        self.sent = ""                                  # the call's arguments sent so far

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
                if m:
                    self.sent = ""
                    out.append(("tool_start", self.name))
                continue
            ends = [(self.buf.find(e), e) for e in self.ENDS if e in self.buf]
            if ends:
                j, e = min(ends)
                self._body(out, self.buf[:j], True)
                self.buf, self.kind = self.buf[j + len(e):], None
                if self.buf.startswith("<|start|>"):
                    self.buf = self.buf[len("<|start|>"):]
                continue
            k = max(partial(self.buf, e) for e in self.ENDS)
            if self.kind != "tool":
                self._body(out, self.buf[:len(self.buf) - k], False)
                self.buf = self.buf[len(self.buf) - k:]
            else:
                send_args(out, self, self.buf[:len(self.buf) - k].strip())
            return out

    def _body(self, out: list[Event], text: str, done: bool) -> None:
        if self.kind == "tool":
            if done:
                out.append(("tool_end", (text.strip() or "{}")[len(self.sent):]))
            return
        if text:
            if self.kind == "content":
                add_content(out, text)
            else:
                out.append(("reasoning", text))

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self.kind is None:
            add_content(out, self.buf)
        else:
            self._body(out, self.buf, True)
        self.buf, self.kind = "", None
        return out
