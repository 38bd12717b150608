"""Constrained decoding: ``response_format`` and forced tool calls as grammars over the
tokenizer's vocabulary, through llguidance (the ``serve`` extra; without it these requests are
400s that name the library).

``Constraint`` holds one llguidance matcher: ``allowed()`` is the token mask for the next step
(a bool tensor over the vocabulary, handed to ``sampling.allow``), ``consume(token)`` advances
it, ``done`` says no token but an end of generation can follow. The vocabulary llguidance sees
is the GGUF tokenizer's, token by token as bytes; control, unknown and unused tokens are marked
special (a grammar's text never matches them), except the markers of the request's tool-call
syntax, which the session decodes as text and so are text here too.

Grammars: ``json_object`` is any JSON object, ``json_schema`` the given schema; a forced tool
call is the family's call syntax with the name (one tool) or a choice of names, and arguments
that match the tool's ``parameters`` schema (GLM: ``<arg_key>``/``<arg_value>`` pairs in the
schema's order, each value per its property's schema). JSON is written compactly (``", "`` and ``": "`` between
items, no other whitespace), so a model cannot spend its tokens on blanks.
"""

from __future__ import annotations

import json
import weakref
from typing import Any, Sequence

import torch

from .schema import RequestError

try:
    import llguidance as _llg
except ImportError:                             # the serve extra is not installed
    _llg = None

__all__ = ["available", "Constraint", "json_grammar", "call_grammar", "check", "JSON_OPTIONS"]

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_SPECIAL = (2, 3, 5)                            # GGUF token types: unknown, control, unused


def available() -> bool:
    return _llg is not None


def need(param: str) -> None:
    """A 400 naming ``param`` when llguidance is not installed."""
    if _llg is None:
        raise RequestError(400, f"'{param}' needs constrained decoding, and the grammar "
                           "library llguidance is not installed on this server (pip install "
                           "'expertfs[serve]' or llguidance)", param=param,
                           code="unsupported_parameter")


class _Vocab:
    """What llguidance's ``TokenizerWrapper`` reads from a tokenizer."""

    def __init__(self, tok: Any, keep: frozenset[int]) -> None:
        self.tok = tok
        self.eos_token_id = min(tok.stop_ids) if tok.stop_ids else tok.eos_id
        self.bos_token_id = tok.bos_id
        special = [i for i, ty in enumerate(tok.types) if ty in _SPECIAL and i not in keep]
        marks = set(special)
        self.tokens = [b"\xff" + tok.token_bytes(i) if i in marks else tok.token_bytes(i)
                       for i in range(tok.n_vocab)]
        self.special_token_ids = special
        self._by_bytes: dict[bytes, int] = {}
        for i, b in enumerate(self.tokens):
            if b and i not in marks:
                self._by_bytes.setdefault(b, i)
        self._longest = max(map(len, self._by_bytes), default=1)

    def __call__(self, data: bytes) -> list[int]:
        """``data``'s tokens, spelling exactly ``data`` (a SentencePiece tokenizer's would
        start with a space it adds: then the longest tokens that match, left to right)."""
        ids = self.tok.encode(data.decode("utf-8", errors="replace"), add_bos=False,
                              parse_special=False)
        if b"".join(self.tokens[i] for i in ids if 0 <= i < len(self.tokens)) == data:
            return ids
        out, i = [], 0
        while i < len(data):
            for n in range(min(self._longest, len(data) - i), 0, -1):
                t = self._by_bytes.get(data[i:i + n])
                if t is not None:
                    out.append(t)
                    i += n
                    break
            else:                               # a byte no token spells: leave it out
                i += 1
        return out


_CACHE: weakref.WeakKeyDictionary[Any, dict[frozenset[int], Any]] = weakref.WeakKeyDictionary()


def _lltokenizer(tok: Any, keep: frozenset[int]) -> Any:
    """llguidance's view of ``tok`` (built once per tokenizer and set of text markers)."""
    known = _CACHE.setdefault(tok, {})
    if keep not in known:
        stops = sorted(tok.stop_ids) or [tok.eos_id]
        known[keep] = _llg.LLTokenizer(_llg.TokenizerWrapper(_Vocab(tok, keep)), eos_token=stops)
    return known[keep]


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _schema(schema: Any) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS})


def json_grammar(fmt: dict[str, Any]) -> str:
    """The grammar of a ``response_format`` (``json_object`` or ``json_schema``)."""
    if fmt["type"] == "json_object":
        return _llg.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    return _llg.LLMatcher.grammar_from_json_schema(fmt["json_schema"].get("schema") or {},
                                                   defaults=JSON_OPTIONS)


def _params(tool: dict[str, Any]) -> dict[str, Any]:
    p = tool["function"].get("parameters")
    return p if isinstance(p, dict) and p else {"type": "object"}


def _glm_args(tool: dict[str, Any], rule: str) -> list[str]:
    """GLM's ``<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n`` pairs, one per property in
    the schema's order, the required ones not optional; a string value is raw text (up to its
    ``maxLength``), any other a JSON value per its schema."""
    params = _params(tool)
    props = params.get("properties") or {}
    required = set(params.get("required") or ())
    parts, lines = [], []
    for j, (k, sub) in enumerate(props.items() if isinstance(props, dict) else ()):
        sub = sub if isinstance(sub, dict) else {}
        if sub.get("type") == "string":
            n = sub.get("maxLength")
            value = f"/[^<]{{0,{int(n)}}}/" if isinstance(n, int) else "/[^<]*/"
        else:
            value = _schema(sub)
        lines.append(f"{rule}_v{j}: {value}")
        pair = (f'{_lit("<arg_key>" + str(k) + "</arg_key>" + chr(10) + "<arg_value>")} '
                f'{rule}_v{j} {_lit("</arg_value>" + chr(10))}')
        parts.append(pair if k in required else f"({pair})?")
    lines.insert(0, f"{rule}: {' '.join(parts)}" if parts else f'{rule}: ""')
    return lines


def call_grammar(syntax: Any, tools: Sequence[dict[str, Any]], name: str | None) -> tuple[str, str]:
    """(the text that opens the call, prefilled after the generation prompt; the grammar of
    the rest) for a call of tool ``name``, or of any of ``tools`` when ``name`` is None."""
    before, between, after = syntax.forced
    chosen = [t for t in tools if name is None or t["function"]["name"] == name]
    lines, alts = [], []
    for j, t in enumerate(chosen):
        rule = f"args{j}"
        if syntax.name == "glm":
            lines += _glm_args(t, rule)
        else:
            lines.append(f"{rule}: {_schema(_params(t))}")
        head = "" if name is not None else _lit(t["function"]["name"] + between) + " "
        alts.append(f"{head}{rule} {_lit(after)}")
    prefix = before + (name + between if name is not None else "")
    lark = "start: " + " | ".join(alts) + "\n" + "\n".join(lines) + "\n"
    return prefix, _llg.LLMatcher.grammar_from_lark(lark)


def check(grammar: str, tok: Any, keep: frozenset[int], param: str) -> None:
    """A 400 naming ``param`` when ``grammar`` does not compile (a schema llguidance refuses)."""
    err, msgs = _llg.LLMatcher.validate_grammar_with_warnings(grammar, _lltokenizer(tok, keep))
    if err:
        raise RequestError(400, f"'{param}' cannot be enforced: {msgs[0] if msgs else 'invalid'}",
                           param=param, code="invalid_value")


class Constraint:
    """One generation's grammar over ``tok``'s vocabulary."""

    def __init__(self, grammar: str, tok: Any, keep: frozenset[int]) -> None:
        self.n_vocab = tok.n_vocab
        self.m = _llg.LLMatcher(_lltokenizer(tok, keep), grammar, log_level=0)
        if self.m.is_error():
            raise RequestError(400, f"the grammar cannot be enforced: {self.m.get_error()}",
                               code="invalid_value")
        self._bits = torch.arange(32, dtype=torch.int32)

    def allowed(self) -> torch.Tensor:
        words = torch.frombuffer(bytearray(self.m.compute_bitmask()), dtype=torch.int32)
        bits = (words.unsqueeze(1) >> self._bits) & 1
        mask = bits.flatten()[:self.n_vocab].bool()
        if self.m.is_error() or not bool(mask.any()):
            self._failed()
        return mask

    def consume(self, token: int) -> None:
        if not self.m.consume_token(int(token)):
            self._failed()

    def _failed(self) -> None:
        """The matcher gave up (a limit on its work per token, say): the request ends with a
        400 naming it, never an unconstrained token."""
        raise RequestError(400, "the grammar could not be enforced on this reply: "
                           f"{self.m.get_error() or 'no token can continue it'}",
                           code="grammar_failed")

    @property
    def done(self) -> bool:
        return self.m.is_stopped()
