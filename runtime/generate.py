"""Generation: prefill the prompt, then decode one token at a time until a stop or the limit.

``generate(engine, prompt_ids, sampler, max_new, stop_ids)`` yields a ``Step`` per generated
token with timings (time to first token, per-token seconds) so the CLI can stream text and draw
its status line; the library itself never prints. Given a speculator (``spec``: a
``runtime.mtp.Speculator`` attached to this engine, ``runtime.mtp.attach``) each decode step is
a speculative step that may yield several tokens; their ``seconds`` share the step's time. The
tokens (and, sampled, their distribution) are the same. The engine itself decodes one token at
a time and knows nothing of speculation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Protocol, Sequence

from .engine import Engine
from .sampling import Sampler

__all__ = ["Step", "Speculative", "generate"]


class Speculative(Protocol):
    """What ``generate`` runs decode steps with (``runtime.mtp.Speculator``)."""

    def step(self, last: int, sampler: Sampler, limit: int) -> list[int]:
        """The tokens after ``last`` (at least one, at most ``limit``)."""


@dataclass(frozen=True)
class Step:
    index: int                   # 0 for the first generated token
    token: int
    seconds: float               # wall time spent producing this token (prefill for index 0)
    elapsed: float               # since generate() started
    stop: bool                   # the token is a stop token (not part of the answer)


def generate(engine: Engine, prompt: Sequence[int], sampler: Sampler, max_new: int,
             stop_ids: set[int] | frozenset[int] = frozenset(),
             spec: Speculative | None = None) -> Iterator[Step]:
    """Yield each generated token; the first one's ``seconds`` is the time to first token.
    With ``spec``, decode steps are its speculative steps."""
    t0 = last = time.perf_counter()
    logits = engine.prefill(list(prompt))
    engine.expect_decode(max(0, max_new - 1))  # decode steps at most (a stop ends them sooner)
    try:
        for i in range(max_new):
            chosen = sampler.sample(logits)        # on the logits' device
            tok = int(chosen)                      # the token's one host copy
            now = time.perf_counter()
            stop = tok in stop_ids
            yield Step(i, tok, now - last, now - t0, stop)
            last = now
            if stop or i + 1 == max_new:
                return
            if spec is not None:
                yield from _speculative(spec, sampler, tok, i + 1, max_new, stop_ids, t0, last)
                return
            logits = engine.decode(chosen)         # the id stays on the device
    finally:
        engine.expect_decode(None)


def _speculative(spec: Speculative, sampler: Sampler, tok: int, i: int, max_new: int,
                 stop_ids: set[int] | frozenset[int], t0: float, last: float) -> Iterator[Step]:
    while i < max_new:
        toks = spec.step(tok, sampler, max_new - i)
        now = time.perf_counter()
        share = (now - last) / len(toks)
        for tok in toks:
            stop = tok in stop_ids
            yield Step(i, tok, share, now - t0, stop)
            i += 1
            if stop or i == max_new:
                return
        last = now
