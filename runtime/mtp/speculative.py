"""MTP speculative decoding: draft with the NextN block, verify in one batched forward, accept
by the sampling rule, roll both KV caches back.

One ``step(last)`` (``last``: the token just chosen, not yet in the KV cache, at position P)::

    1. MTP catch-up + draft 0   the NextN block on every position it has not seen yet, each
                                token t_q paired with the trunk's h_{q-1} (llama.cpp's
                                ``process``: the first prompt token gets a zero h), ending with
                                (last, h_{P-1}) at P → logits of d_1
    2. chained drafts           (d_i, the block's own hn of the previous row) at P+i → d_{i+1};
                                the gate may stop early on a low-confidence chain
    3. draft-route prefetch     (optional) every layer's verify experts predicted and
                                prefetched before the verify pass starts
    4. verify                   the trunk on [last, d_1..d_k] at P..P+k, logits of every row
    5. accept                   greedy: while argmax == draft; sampled: speculative sampling
    6. roll back                trunk KV to P+1+accepted; NextN KV to P+1 (its rows past P were
                                fed its own hn, not the trunk's: the next catch-up redoes them)

It returns the accepted drafts and the next token (at least one token per step). The
speculator observes the engine (``Engine.add_observer``): the trunk's last hidden state of every
position is kept (``observe``), and an engine reset rolls the speculator back (``reset``), so the
catch-up and a prefix-reusing reset need nothing recomputed. The verify pass is
``Engine.verify``; the whole step's time goes to ``Engine.count_decode``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..sampling import Sampler
from .accept import accept_greedy, accept_sampled, draft
from .nextn import NextN

__all__ = ["Speculator", "SpecStats", "DraftState"]


@dataclass
class SpecStats:
    steps: int = 0
    drafted: int = 0             # draft tokens verified
    accepted: int = 0
    emitted: int = 0             # tokens returned (accepted + one per step)
    reached: list[int] = field(default_factory=list)      # per depth i: drafts verified
    taken: list[int] = field(default_factory=list)        # per depth i: of those, accepted
    mtp_rows: int = 0            # NextN rows run (catch-up + drafts)
    mtp_s: float = 0.0
    prefetch_s: float = 0.0
    verify_s: float = 0.0
    plain_steps: int = 0         # steps the gate ran without drafts

    def add(self, k: int, n: int) -> None:
        while len(self.reached) < k:
            self.reached.append(0)
            self.taken.append(0)
        for i in range(k):
            self.reached[i] += 1
            self.taken[i] += i < n

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["acceptance"] = round(self.acceptance, 4)
        d["acceptance_by_depth"] = [round(t / r, 4) if r else 0.0
                                    for r, t in zip(self.reached, self.taken)]
        d["tokens_per_step"] = round(self.emitted / self.steps, 4) if self.steps else 0.0
        return d


@dataclass
class DraftState:
    """What a step knows before verification, for the route predictor and the gate."""

    pos: int                                  # position of ``tokens[0]``
    tokens: list[int]                         # [last, d_1 .. d_k]: the verify rows
    mtp_hidden: list[torch.Tensor]            # hn of the NextN row of each verify row (its
                                              # input token); the last row's only with tail_hidden
    h_prev: torch.Tensor                      # the trunk's h_{P-1}
    confidence: list[float]                   # q(d_i) of each draft


class Speculator:
    """``depth``: drafts per step (an int), or a callable gate with ``depth(limit)``,
    ``more(i, chain_conf)`` and ``update(...)`` (``expertfs.runtime.mtp.gate``)."""

    def __init__(self, engine: Any, nextn: NextN, depth: int | Any = 2) -> None:
        """Speculate on ``engine`` (from now on it tells this speculator of its forwards)."""
        self.engine, self.nextn = engine, nextn
        self.gate = depth if not isinstance(depth, int) else None
        self.fixed = depth if isinstance(depth, int) else 0
        self.route_hooks: list[Callable[[DraftState], None]] = []     # before verification
        self.verify_hooks: list[Callable[[DraftState, int], None]] = []   # after acceptance
        self.observe_hooks: list[Callable[[list[int]], None]] = []    # after any trunk forward
        self.tail_hidden = False                  # also run the NextN block on the last draft
        self.tail_mode = "hidden"                 # its FFN too ("hidden") or not ("attn")
        self.draft_prefetcher: Any = None         # (hn for its route prediction)
        self.stats = SpecStats()
        self.draft_fn = draft                     # (logits, params, gen) -> (token, q, q(token))
        d = engine.config.n_embd
        self._hist = torch.zeros(64, d, dtype=torch.float32, device=engine.device)
        self.tokens: list[int] = []               # token at every trunk position
        engine.add_observer(self)

    # --- the trunk's history ------------------------------------------------------------
    def observe(self, tokens: list[int], hidden: torch.Tensor) -> None:
        """The trunk ran ``tokens`` ending at its current position; ``hidden [T, D]``."""
        end = self.engine.pos
        a = end - len(tokens)
        del self.tokens[a:]
        self.tokens.extend(int(t) for t in tokens)
        if end > self._hist.shape[0]:
            new = torch.zeros(max(end, 2 * self._hist.shape[0]), self._hist.shape[1],
                              dtype=self._hist.dtype, device=self._hist.device)
            new[:a] = self._hist[:a]
            self._hist = new
        self._hist[a:end] = hidden.float()
        for hook in self.observe_hooks:
            hook(self.tokens[a:end])

    def reset(self, pos: int) -> None:
        del self.tokens[pos:]
        self.nextn.reset(min(self.nextn.pos, pos))

    def h_at(self, a: int, b: int) -> torch.Tensor:
        """Trunk hidden rows of positions a..b-1 (position -1: zeros, as llama.cpp pairs the
        first prompt token)."""
        if a >= 0:
            return self._hist[a:b]
        z = torch.zeros(-a, self._hist.shape[1], dtype=self._hist.dtype, device=self._hist.device)
        return torch.cat((z, self._hist[:max(0, b)]))

    # --- one step -------------------------------------------------------------------------
    def _ids(self, toks: list[int]) -> torch.Tensor:
        return torch.tensor(toks, dtype=torch.long, device=self.engine.device)

    def _draft0(self, last: int, P: int) -> torch.Tensor:
        """Catch the NextN block up to P-1 and run (last, h_{P-1}) at P; logits of d_1."""
        nx, eng = self.nextn, self.engine
        c0 = nx.pos
        step = max(1, eng.options.prefill_batch)
        while P - c0 + 1 > step:                     # a long catch-up (the prompt) in batches
            nx.forward(self._ids(self.tokens[c0:c0 + step]), self.h_at(c0 - 1, c0 + step - 1),
                       logits="none")
            self.stats.mtp_rows += step
            c0 += step
        toks = self.tokens[c0:P] + [last]
        self.stats.mtp_rows += len(toks)
        return nx.forward(self._ids(toks), self.h_at(c0 - 1, P), logits="last")

    def depth(self, limit: int) -> int:
        k = self.gate.depth(limit) if self.gate is not None else self.fixed
        room = self.engine.options.n_ctx - self.engine.pos - 1
        return max(0, min(k, limit - 1, room))

    def step(self, last: int, sampler: Sampler, limit: int = 1 << 30) -> list[int]:
        """Tokens after ``last`` (accepted drafts, then one chosen by the target), at most
        ``limit`` of them."""
        eng, nx, st = self.engine, self.nextn, self.stats
        P = eng.pos
        kmax = self.depth(limit)
        if kmax <= 0:
            t0 = time.perf_counter()
            tok = sampler(eng.decode(last))
            st.plain_steps += 1
            st.steps += 1
            st.emitted += 1
            if self.gate is not None:
                self.gate.update(0, 0, 0.0, time.perf_counter() - t0)
            return [tok]
        t0 = time.perf_counter()
        stall0 = eng.provider.stats.stall_seconds
        params, gen = sampler.params, sampler.gen
        logits = self._draft0(last, P)
        drafts: list[int] = []
        qs: list[torch.Tensor | None] = []
        conf: list[float] = []
        hns: list[torch.Tensor] = []
        chain = 1.0
        while True:
            d, q, c = self.draft_fn(logits[0], params, gen)
            drafts.append(d)
            qs.append(q)
            conf.append(c)
            hns.append(nx.hidden[-1:])
            chain *= c
            i = len(drafts)
            if i == 1 and self.gate is not None:
                self.gate.note_confidence(c)
            if i >= kmax or (self.gate is not None and not self.gate.more(i, chain, conf)):
                break
            logits = nx.forward(self._ids([d]), nx.hidden[-1:], logits="last")
            st.mtp_rows += 1
        if self.tail_hidden:
            nx.forward(self._ids([drafts[-1]]), nx.hidden[-1:], logits=self.tail_mode)
            hns.append(nx.hidden[-1:])
            st.mtp_rows += 1
        t1 = time.perf_counter()
        ds = DraftState(P, [last] + drafts, hns, self.h_at(P - 1, P), conf)
        for hook in self.route_hooks:
            hook(ds)
        t2 = time.perf_counter()
        target = eng.verify([last] + drafts)
        if params.greedy:
            n, nxt = accept_greedy(target, drafts)
        else:
            n, nxt = accept_sampled(target, drafts, qs, params, gen)     # type: ignore[arg-type]
        eng.reset(P + 1 + n)
        nx.reset(min(nx.pos, P + 1))
        for hook in self.verify_hooks:
            hook(ds, n)
        t3 = time.perf_counter()
        k = len(drafts)
        st.steps += 1
        st.drafted += k
        st.accepted += n
        st.emitted += n + 1
        st.add(k, n)
        st.mtp_s += t1 - t0
        st.prefetch_s += t2 - t1
        st.verify_s += t3 - t2
        eng.count_decode(t3 - t0, n + 1)
        if self.gate is not None:
            self.gate.update(k, n, t1 - t0, t3 - t1)
            self.gate.note_stall(eng.provider.stats.stall_seconds - stall0, t3 - t0)
        return drafts[:n] + [nxt]
