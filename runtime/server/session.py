"""One generation at a time on an ``Engine``: prompt-prefix reuse, stop strings, logprobs,
penalties, tool calls, timings.

``Session.run`` is blocking (the server calls it on its single generation thread). The KV
cache keeps the previous request's tokens; a new prompt that starts with them (a chat that
grows turn by turn) only prefills the new part; a model that keeps only some positions to go
back to (a sliding window's ring, a recurrent state) resumes from the longest shared prefix it
can (``resume_point``). Figures follow llama.cpp's server ``timings``
(prompt_n, prompt_ms, prompt_per_second, predicted_n, predicted_ms, predicted_per_second,
cache_n) plus the expert hit rates and bytes read for this request. Given a speculator
(``spec``: a ``runtime.mtp.Speculator`` attached to the engine), tokens come from speculative
steps (same greedy tokens, same sampled distribution) and the timings add the drafts accepted
and verified; a request with penalties or logprobs decodes one token at a time instead.

Logprobs are the log-softmax of the logits the sampler was given (after the presence and
frequency penalties, ``logit_bias`` and a grammar's mask, before temperature, top-k and top-p).
A grammar (``grammar``: ``response_format`` JSON, or a forced tool call, whose opening the
prompt ends with) masks each step's logits and ends the generation once it is complete; a
request with a grammar or ``logit_bias`` decodes one token at a time too. Each token's entry
goes out with the first text it shows, so a token held back as a possible stop string is
reported when its text is, and one cut by a stop string is reported only if some of its text
was shown.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..sampling import Sampler, SamplingParams, allow, bias, penalize
from ..tokenizer.chat import ChatTemplateError
from . import grammar
from .schema import CompletionRequest, RequestError
from .tools import ToolStream, ToolSyntax, syntax_for

__all__ = ["Session", "Outcome", "StopMatcher", "resume_point"]


class StopMatcher:
    """Finds stop strings in streamed text, holding back what could be the start of one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.sent = 0
        self.matched: str | None = None        # the stop string that cut the text

    def push(self, piece: str) -> tuple[str, bool]:
        """Add ``piece``; returns (text safe to emit now, stopped)."""
        self.text += piece
        cut = min((i for i in (self.text.find(s, max(0, self.sent - self.hold))
                               for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.matched = next(s for s in self.stops if self.text.startswith(s, cut))
            self.text = self.text[:cut]
            out, self.sent = self.text[self.sent:], len(self.text)
            return out, True
        safe = max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent:safe], safe
        return out, False

    def flush(self) -> str:
        out, self.sent = self.text[self.sent:], len(self.text)
        return out


@dataclass
class Outcome:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    timings: dict[str, Any] = field(default_factory=dict)
    content: str = ""                          # chat: text that is not a tool call
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    stop_sequence: str | None = None           # the stop string that ended it, if one did


#: ``on_delta(delta)``: ``{"text"}`` (raw text), ``{"content"}``, ``{"reasoning_content"}`` or
#: ``{"tool_calls": [call]}`` (OpenAI's stream deltas: a call's first has its ``id``, ``type`` and
#: ``function.name``, the next ones more of ``function.arguments``), each with the
#: ``"logprobs"`` entries it carries (maybe empty).
Emit = Callable[[dict[str, Any]], None]


def resume_point(engine: Any, pos: int) -> int:
    """The longest prefix of at most ``pos`` positions ``engine`` can go back to: a sliding
    window's ring or a recurrent state keeps only some (recent ones, checkpoints after recent
    prompts), so probe downwards; 0 always can."""
    while pos > 0 and not engine.can_reset(pos):
        pos -= 1
    return pos


class Session:
    def __init__(self, engine: Any, tokenizer: Any, spec: Any = None) -> None:
        self.engine, self.tok, self.spec = engine, tokenizer, spec
        self.cached: list[int] = []            # the tokens whose K/V the engine holds
        self._keep: dict[str, frozenset[int]] = {}
        self._longest: int | None = None

    def tool_syntax(self, req: CompletionRequest) -> ToolSyntax | None:
        """The syntax tool calls come back in, for a chat request that offers tools."""
        if not req.chat or not req.tools or req.tool_choice == "none":
            return None
        return syntax_for(str(getattr(self.tok, "chat_template", "") or ""))

    def render(self, req: CompletionRequest) -> str:
        """The chat prompt: the messages (and the tools) through the model's chat template."""
        msgs = [dict(m) for m in req.messages or ()]
        try:
            text = self.tok.apply_chat_template(msgs)
            if req.tools and req.tool_choice != "none":
                with_tools = self.tok.apply_chat_template(
                    msgs, tools=[dict(t) for t in req.tools], tool_choice=req.tool_choice)
                if with_tools == text:
                    raise RequestError(400, "the model's chat template does not take tools "
                                       "(it renders the same prompt with and without them)",
                                       param="tools", code="tools_unsupported")
                if self.tool_syntax(req) is None:
                    raise RequestError(400, "the model's chat template takes tools in a syntax "
                                       "this server cannot parse back", param="tools",
                                       code="tools_unsupported")
                text = with_tools
                text += self.grammar(req)[0]
        except RequestError:
            raise
        except Exception as e:                 # a template that raises is the request's fault
            msg = str(e) if isinstance(e, ChatTemplateError) else (
                f"the chat template failed on these messages: {e}")
            raise RequestError(400, msg, param="messages") from None
        return text

    def grammar(self, req: CompletionRequest) -> tuple[str, str | None, frozenset[int]]:
        """(the text the prompt ends with, the grammar, the tokens decoded as text) for a
        request that forces a tool call or a JSON reply; ``("", None, ...)`` for the rest."""
        syntax = self.tool_syntax(req)
        keep = self._preserved(syntax) if syntax is not None else frozenset()
        if req.must_call and syntax is not None:
            grammar.need("tool_choice")
            prefix, g = grammar.call_grammar(syntax, req.tools or (), req.forced_tool)
            grammar.check(g, self.tok, keep, "tool_choice")
            return prefix, g, keep
        if req.response_format is not None:
            grammar.need("response_format")
            g = grammar.json_grammar(req.response_format)
            grammar.check(g, self.tok, keep, "response_format")
            return "", g, keep
        return "", None, keep

    def prompt_ids(self, req: CompletionRequest) -> list[int]:
        if req.logit_bias:
            bad = next((t for t in req.logit_bias if t >= self.tok.n_vocab), None)
            if bad is not None:
                raise RequestError(400, f"logit_bias: token id {bad} is not in the vocabulary "
                                   f"(0..{self.tok.n_vocab - 1})", param="logit_bias",
                                   code="invalid_value")
        if req.chat:
            text = self.render(req)            # checks a forced call's grammar
            if req.response_format is not None and not req.must_call:
                self.grammar(req)              # a 400 here for a schema that cannot be enforced
            self._fits(text, req.max_tokens)
            ids = self.tok.encode(text, add_bos=False)
            if self.tok.bos_id is not None and self.tok.add_bos and (not ids or ids[0] != self.tok.bos_id) \
                    and not text.startswith(self.tok.tokens[self.tok.bos_id]):
                ids = [self.tok.bos_id] + ids
        elif req.prompt_tokens is not None:     # token ids go to the model as they are
            ids = list(req.prompt_tokens)
            n = self.tok.n_vocab
            bad = next((i for i, t in enumerate(ids) if not 0 <= t < n), None)
            if bad is not None:
                raise RequestError(400, f"prompt[{bad}]: token id {ids[bad]} is not in the "
                                   f"vocabulary (0..{n - 1})", param="prompt",
                                   code="invalid_value")
        else:
            self._fits(req.prompt, req.max_tokens)
            ids = self.tok.encode(req.prompt)
        if not ids:
            raise RequestError(400, "the prompt is empty", param="prompt")
        n_ctx = self.engine.options.n_ctx
        if len(ids) + req.max_tokens > n_ctx:
            raise RequestError(400, f"the prompt ({len(ids)} tokens) plus max_tokens "
                               f"({req.max_tokens}) exceeds the context of {n_ctx} tokens",
                               param="max_tokens", code="context_length_exceeded")
        return ids

    def _fits(self, text: str, max_tokens: int) -> None:
        """Refuse, before tokenizing it, a text too long for the context whatever its tokens
        (each token spells at most as many characters as its longest entry in the vocabulary)."""
        if self._longest is None:
            self._longest = max((len(t) for t in getattr(self.tok, "tokens", ()) or ()), default=0)
        n_ctx = self.engine.options.n_ctx
        if self._longest and len(text) > (n_ctx - max_tokens) * max(self._longest, 1):
            raise RequestError(400, f"the prompt ({len(text)} characters) plus max_tokens "
                               f"({max_tokens}) exceeds the context of {n_ctx} tokens",
                               param="max_tokens", code="context_length_exceeded")

    def _preserved(self, syntax: ToolSyntax) -> frozenset[int]:
        """Control tokens the syntax's markers are: decoded as text so the parser sees them."""
        if syntax.name not in self._keep:
            names = set(syntax.markers)
            self._keep[syntax.name] = frozenset(i for i, t in enumerate(self.tok.tokens) if t in names)
        return self._keep[syntax.name]

    def _entry(self, logits: torch.Tensor, t: int, top: int) -> dict[str, Any]:
        lp = torch.log_softmax(logits.float(), dim=-1)
        e = self._tok_entry(t, float(lp[t]))
        if top:
            vals, idx = torch.topk(lp, min(top, lp.numel()))
            e["top_logprobs"] = [self._tok_entry(int(i), float(v)) for v, i in zip(vals, idx)
                                 if torch.isfinite(v)]       # not the tokens a mask forbids
        else:
            e["top_logprobs"] = []
        return e

    def _tok_entry(self, t: int, lp: float) -> dict[str, Any]:
        b = self.tok.token_bytes(t)
        return {"token": b.decode("utf-8", errors="replace"), "logprob": lp, "bytes": list(b)}

    def run(self, req: CompletionRequest, ids: list[int], emit: Callable[[str], None],
            cancelled: Callable[[], bool], on_delta: Emit | None = None) -> Outcome:
        """Generate for ``req``: ``emit`` gets the shown text piece by piece, ``on_delta`` the
        response deltas (content, tool calls, logprobs) built from it."""
        eng, tok = self.engine, self.tok
        stats = eng.provider.stats
        b0, r0, h0 = stats.bytes_read, stats.requests, dict(stats.hits)
        common = next((i for i, (a, b) in enumerate(zip(self.cached, ids)) if a != b),
                      min(len(self.cached), len(ids)))
        keep = resume_point(eng, min(common, len(ids) - 1))
        self.cached = []                       # until the prefill succeeds the cache is unknown
        eng.reset(keep)
        t0 = time.perf_counter()
        logits = eng.prefill(ids[keep:])
        t1 = time.perf_counter()
        self.cached = list(ids)
        sampler = Sampler(SamplingParams(req.temperature, req.top_k, req.top_p, req.seed))
        penal = bool(req.presence_penalty or req.frequency_penalty)
        prefix, g, text_ids = self.grammar(req) if req.chat else ("", None, frozenset())
        rule = grammar.Constraint(g, tok, text_ids) if g is not None else None
        counts: Counter[int] = Counter()
        stop = StopMatcher(req.stop)
        syntax = self.tool_syntax(req)
        tools = ToolStream(syntax, req.tools or ()) if syntax is not None else None
        detok = tok.detokenizer(self._preserved(syntax)) if syntax is not None else tok.detokenizer()
        out = _Collector(req.chat, on_delta or (lambda d: None), tools)
        if prefix:                             # a forced call's opening, in the prompt
            out.push(prefix, 0)
        spec = self.spec if not (penal or req.logprobs or req.logit_bias or rule) else None
        m0 = (spec.stats.drafted, spec.stats.accepted) if spec is not None else (0, 0)
        seq: list[int] = []                    # tokens taken, in order
        chosen = None                          # the last sampled id, on the device
        queue: list[int] = []                  # a speculative step's tokens not taken yet
        n, finish, cut = 0, "length", False
        while n < req.max_tokens:
            if cancelled():
                finish = "cancelled"
                break
            if spec is not None and seq:
                if not queue:
                    queue = spec.step(seq[-1], sampler, req.max_tokens - n)
                t, chosen = queue.pop(0), None
            else:
                lg = logits if not seq else eng.decode(seq[-1] if chosen is None else chosen)
                if penal:
                    lg = penalize(lg, counts, req.presence_penalty, req.frequency_penalty)
                if req.logit_bias:
                    lg = bias(lg, req.logit_bias)
                if rule is not None:
                    lg = allow(lg, rule.allowed())
                chosen = sampler.sample(lg)         # the id stays on the device for decode
                t = int(chosen)
                if req.logprobs:
                    out.pending.append((len(stop.text), self._entry(lg, t, req.top_logprobs)))
            seq.append(t)
            counts[t] += 1
            if t in tok.stop_ids:
                out.pending = [p for p in out.pending if p[0] < len(stop.text)]
                finish = "stop"
                break
            n += 1
            if rule is not None:
                rule.consume(t)
            piece, hit = stop.push(detok.push(t))
            if piece:
                emit(piece)
            out.push(piece, stop.sent if not hit else len(stop.text))
            if hit:
                finish, cut = "stop", True
                break
            if rule is not None and rule.done or out.ended and not req.parallel_tool_calls:
                finish = "stop"                 # the grammar is complete, or the one call is
                break
        self.cached = (ids + seq + queue)[:eng.pos]     # what the KV cache holds
        if not cut and finish != "cancelled":
            rest = stop.flush()
            if rest:
                emit(rest)
            out.push(rest, len(stop.text) + 1)
        out.finish(len(stop.text) + (0 if cut else 1))
        t2 = time.perf_counter()
        reqs = max(1, stats.requests - r0)
        hits = {k: (v - h0.get(k, 0)) / reqs for k, v in stats.hits.items()}
        prompt_n = len(ids) - keep
        timings = {
            "cache_n": keep, "prompt_n": prompt_n, "prompt_ms": 1e3 * (t1 - t0),
            "prompt_per_token_ms": 1e3 * (t1 - t0) / max(1, prompt_n),
            "prompt_per_second": prompt_n / (t1 - t0) if t1 > t0 else 0.0,
            "predicted_n": n, "predicted_ms": 1e3 * (t2 - t1),
            "predicted_per_token_ms": 1e3 * (t2 - t1) / max(1, n),
            "predicted_per_second": n / (t2 - t1) if t2 > t1 and n else 0.0,
            "expert_hit_rate": hits, "expert_requests": stats.requests - r0,
            "mb_read": (stats.bytes_read - b0) / 1e6,
        }
        if spec is not None:
            timings["draft_n"] = spec.stats.drafted - m0[0]
            timings["draft_n_accepted"] = spec.stats.accepted - m0[1]
        if out.tool_calls and finish == "stop":
            finish = "tool_calls"
        return Outcome(stop.text, len(ids), n, finish, timings, content=out.content,
                       reasoning=out.reasoning, tool_calls=out.tool_calls, logprobs=out.logprobs,
                       stop_sequence=stop.matched)


class _Collector:
    """Shown text → emitted deltas (through the tool parser for a chat with tools), each
    carrying the logprob entries of the tokens whose text starts before what is shown."""

    def __init__(self, chat: bool, emit: Emit, tools: ToolStream | None) -> None:
        self.chat, self.emit, self.tools = chat, emit, tools
        self.pending: list[tuple[int, dict[str, Any]]] = []   # (text offset, entry)
        self.logprobs: list[dict[str, Any]] = []
        self.carry: list[dict[str, Any]] = []                 # released, not sent yet
        self.content, self.reasoning = "", ""
        self.tool_calls: list[dict[str, Any]] = []
        self.ended = False                                    # a call has been closed

    def _release(self, upto: int) -> None:
        while self.pending and self.pending[0][0] < upto:
            off, e = self.pending.pop(0)
            e["text_offset"] = off
            self.logprobs.append(e)
            self.carry.append(e)

    def push(self, piece: str, shown: int) -> None:
        self._release(shown)
        if not self.chat:
            if piece or self.carry:
                self.emit({"text": piece, "logprobs": self.carry})
                self.carry = []
            self.content += piece
            return
        events = self.tools.push(piece) if self.tools is not None else (
            [("content", piece)] if piece else [])
        self._events(events)

    def _events(self, events: list[tuple[str, Any]]) -> None:
        for kind, v in events:
            self.ended = self.ended or kind in ("tool", "tool_end")
            if kind in ("tool", "tool_start"):       # a whole call, or one that streams
                fn = v if kind == "tool" else {"name": v, "arguments": ""}
                call = {"index": len(self.tool_calls), "id": "call_" + uuid.uuid4().hex[:24],
                        "type": "function", "function": dict(fn)}
                self.tool_calls.append(call)
                self.emit({"tool_calls": [{**call, "function": dict(fn)}],
                           "logprobs": self.carry})
            elif kind in ("tool_args", "tool_end"):  # the next piece of its arguments
                call = self.tool_calls[-1]
                call["function"]["arguments"] += v
                if v or self.carry:
                    self.emit({"tool_calls": [{"index": call["index"],
                                               "function": {"arguments": v}}],
                               "logprobs": self.carry})
            elif kind == "reasoning":
                self.reasoning += v
                self.emit({"reasoning_content": v, "logprobs": self.carry})
            else:
                self.content += v
                self.emit({"content": v, "logprobs": self.carry})
            self.carry = []

    def finish(self, upto: int) -> None:
        self._release(upto)
        self.pending = []
        if self.chat and self.tools is not None:
            self._events(self.tools.finish())
        if self.carry:                          # entries with no text left to go with
            self.emit({"logprobs": self.carry})
            self.carry = []
