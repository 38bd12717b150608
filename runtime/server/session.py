"""One generation at a time on an ``Engine``: prompt-prefix reuse, stop strings, timings.

``Session.run`` is blocking (the server calls it on its single generation thread). The KV
cache keeps the previous request's tokens; a new prompt that starts with them (a chat that
grows turn by turn) only prefills the new part. Figures follow llama.cpp's server ``timings``
(prompt_n, prompt_ms, prompt_per_second, predicted_n, predicted_ms, predicted_per_second,
cache_n) plus the expert hit rates and bytes read for this request. Given a speculator
(``spec``: a ``runtime.mtp.Speculator`` attached to the engine), tokens come from speculative
steps (same greedy tokens, same sampled distribution) and the timings add the drafts accepted
and verified.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..sampling import Sampler, SamplingParams
from .schema import CompletionRequest, RequestError

__all__ = ["Session", "Outcome", "StopMatcher"]


class StopMatcher:
    """Finds stop strings in streamed text, holding back what could be the start of one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.sent = 0

    def push(self, piece: str) -> tuple[str, bool]:
        """Add ``piece``; returns (text safe to emit now, stopped)."""
        self.text += piece
        cut = min((i for i in (self.text.find(s, max(0, self.sent - self.hold))
                               for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
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


class Session:
    def __init__(self, engine: Any, tokenizer: Any, spec: Any = None) -> None:
        self.engine, self.tok, self.spec = engine, tokenizer, spec
        self.cached: list[int] = []            # the tokens whose K/V the engine holds

    def prompt_ids(self, req: CompletionRequest) -> list[int]:
        if req.chat:
            try:
                text = self.tok.apply_chat_template(list(req.messages))
            except Exception as e:             # a template that raises is the request's fault
                raise RequestError(400, f"the chat template failed on these messages: {e}",
                                   param="messages") from None
            ids = self.tok.encode(text, add_bos=False)
            if self.tok.bos_id is not None and self.tok.add_bos and (not ids or ids[0] != self.tok.bos_id) \
                    and not text.startswith(self.tok.tokens[self.tok.bos_id]):
                ids = [self.tok.bos_id] + ids
        else:
            ids = self.tok.encode(req.prompt)
        if not ids:
            raise RequestError(400, "the prompt is empty", param="prompt")
        n_ctx = self.engine.options.n_ctx
        if len(ids) + req.max_tokens > n_ctx:
            raise RequestError(400, f"the prompt ({len(ids)} tokens) plus max_tokens "
                               f"({req.max_tokens}) exceeds the context of {n_ctx} tokens",
                               param="max_tokens", code="context_length_exceeded")
        return ids

    def run(self, req: CompletionRequest, ids: list[int], emit: Callable[[str], None],
            cancelled: Callable[[], bool]) -> Outcome:
        eng, tok = self.engine, self.tok
        stats = eng.provider.stats
        b0, r0, h0 = stats.bytes_read, stats.requests, dict(stats.hits)
        common = 0
        for a, b in zip(self.cached, ids):
            if a != b:
                break
            common += 1
        keep = min(common, len(ids) - 1)
        if not eng.can_reset(keep):            # a recurrent state that cannot go back that far
            keep = 0
        self.cached = []                       # until the prefill succeeds the cache is unknown
        eng.reset(keep)
        t0 = time.perf_counter()
        logits = eng.prefill(ids[keep:])
        t1 = time.perf_counter()
        self.cached = list(ids)
        sampler = Sampler(SamplingParams(req.temperature, req.top_k, req.top_p, req.seed))
        stop = StopMatcher(req.stop)
        detok = tok.detokenizer()
        spec = self.spec
        m0 = (spec.stats.drafted, spec.stats.accepted) if spec is not None else (0, 0)
        seq: list[int] = []                    # tokens taken, in order
        queue: list[int] = []                  # a speculative step's tokens not taken yet
        n, finish = 0, "length"
        while n < req.max_tokens:
            if cancelled():
                finish = "cancelled"
                break
            if not seq:
                t = sampler(logits)
            elif spec is not None:
                if not queue:
                    queue = spec.step(seq[-1], sampler, req.max_tokens - n)
                t = queue.pop(0)
            else:
                t = sampler(eng.decode(seq[-1]))
            seq.append(t)
            if t in tok.stop_ids:
                finish = "stop"
                break
            n += 1
            piece, hit = stop.push(detok.push(t))
            if piece:
                emit(piece)
            if hit:
                finish = "stop"
                break
        self.cached = (ids + seq + queue)[:eng.pos]     # what the KV cache holds
        rest = stop.flush() if finish != "stop" else ""
        if rest:
            emit(rest)
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
        return Outcome(stop.text, len(ids), n, finish, timings)
