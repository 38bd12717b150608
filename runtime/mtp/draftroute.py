"""Draft-route prefetch: as soon as the drafts exist, predict the experts the verify pass will
route to at every layer and prefetch them for the whole step.

The verify pass runs rows ``[last, d_1 .. d_k]``. Each row's state at every layer is unknown
until the pass reaches it, but the NextN block has already computed, for every row, a hidden
state that predicts the row's next token exactly as the trunk's final state does (``hn``: row
0's from (last, h_{P-1}), row i's from (d_i, hn_{i-1}); the last row's from one more NextN
step taken only up to its attention, so no expert is read for it: the same coverage within a
point, measured). The predictor (``DraftRoutePredictor``), per row and trunk MoE layer l:

* **proxy routing**: layer l's router (its own FFN norm, selection bias) on ``rms(hn)``; an
  expert's rank there is the main feature (on the trained model it places far more of the
  verify experts in each row's top ranks than the token embedding or the previous row's state
  do, and fitted mixes of them gain little: bench/README.md);
* **token route memory**: how many of the token's last two committed occurrences used the
  expert at layer l (most rows' tokens were seen before, and most of their route repeats);
* **calibration**: ``P(row uses e | rank bucket, memory count)`` per layer, counted online
  from every verify pass (a prior until then); rows combine by noisy-OR into the probability
  that the pass needs ``e``.

``DraftRoutePrefetcher`` takes every expert whose probability clears the threshold (expected
stall saved against bytes read in vain: ``p > ρ/(1+ρ)``, ρ the measured share of the verify
pass spent waiting on storage, clipped to [0.1, 0.5]; 0.15 until measured) for the whole
step, through ``provider.prefetch(layer, ids, source="draft")``: the predicted experts already
resident are claimed at once (soft-pinned until their layer runs: no read, and no eviction by
this step's other reads); the others are read in layer order, best first, keeping at most
``max_in_flight`` prefetch reads in flight and topping up as the verify pass reaches each
layer (a deep queue of prefetches would hold demand reads behind it, and a small RAM tier
would evict what the pass is about to use). Predictions for a layer the pass has reached are
dropped (its demand read takes over). It scores itself against what the pass then routed
(coverage = needed experts predicted; waste = predicted experts not needed; bytes), while the
provider's ``prefetch_report()["draft"]`` adds timing (in time, late bytes, reads wasted).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..experts.protocol import PrefetchReport, TierState
from ..model.config import GATING_SIGMOID, GATING_SOFTMAX
from ..model.rope import rms_norm
from ..prefetch.score import PredictionScore
from .speculative import DraftState

__all__ = ["DraftRoutePredictor", "DraftRoutePrefetcher", "RouteScore", "TokenRouteMemory"]

DEFAULT_THRESHOLD = 0.15        # until the disk wait is measured


class TokenRouteMemory:
    """token → its last ``depth`` committed routes at every MoE layer (LRU over tokens)."""

    def __init__(self, n_layers: int, n_experts: int, depth: int = 2,
                 max_tokens: int = 1 << 16) -> None:
        self.n, self.E, self.depth, self.max_tokens = n_layers, n_experts, depth, max_tokens
        self._m: OrderedDict[int, list[np.ndarray]] = OrderedDict()

    def add(self, token: int, routes: np.ndarray) -> None:
        """``routes [n_layers, k]`` (expert ids; -1 = none) of one committed occurrence."""
        old = self._m.pop(token, [])
        self._m[token] = ([routes] + old)[:self.depth]
        if len(self._m) > self.max_tokens:
            self._m.popitem(last=False)

    def counts(self, tokens: list[int]) -> np.ndarray:
        """``[rows, n_layers, E]`` uint8: in how many remembered occurrences the expert ran."""
        out = np.zeros((len(tokens), self.n, self.E), np.uint8)
        li = np.arange(self.n)[:, None]
        for r, t in enumerate(tokens):
            for routes in self._m.get(t, ()):
                ok = routes >= 0
                used = np.zeros((self.n, self.E), np.uint8)
                used[np.broadcast_to(li, routes.shape)[ok], routes[ok]] = 1   # once per route
                out[r] += used
        return out

    def __len__(self) -> int:
        return len(self._m)


class DraftRoutePredictor:
    """P(the verify pass routes to expert e at layer l) from the rows' NextN hidden states."""

    def __init__(self, engine: Any, *, memory_depth: int = 2, prior_weight: float = 8.0) -> None:
        cfg = engine.config
        blocks = [b for b in engine.trunk.blocks if b.moe is not None]
        self.layers = [b.layer for b in blocks]
        self.index = {la: i for i, la in enumerate(self.layers)}
        self.E, self.k, self.eps = cfg.n_experts, cfg.n_expert_used, cfg.rms_eps
        self.gating = cfg.gating
        # router weights with each layer's FFN norm folded in: one matmul for every layer
        self.W = torch.cat([b.moe.router.weight * b.ffn_norm[None, :] for b in blocks])
        self.bias = torch.stack([b.moe.router.probs_bias if b.moe.router.probs_bias is not None
                                 else torch.zeros(self.E, device=self.W.device) for b in blocks])
        self.NR = min(self.E, 4 * self.k)                      # rank buckets (last: the rest)
        self.memory = TokenRouteMemory(len(blocks), self.E, memory_depth)
        n, M = len(blocks), memory_depth + 1
        j = np.minimum(np.arange(self.NR), self.NR - 1)
        p0 = 0.8 * np.exp(-j / (0.9 * self.k))                # own-row prior by rank
        prior = np.stack([1 - (1 - p0) * (1 - m) for m in np.linspace(0, 0.8, M)], 1)
        self.hits = np.broadcast_to(prior * prior_weight, (n, self.NR, M)).copy()
        self.total = np.full((n, self.NR, M), prior_weight)
        self._last: tuple[np.ndarray, np.ndarray] | None = None

    def features(self, hidden: torch.Tensor, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(rank bucket, memory count), each ``[rows, n_layers, E]``."""
        h = rms_norm(hidden.float(), None, self.eps)
        logits = (h @ self.W.T).view(h.shape[0], len(self.layers), self.E)
        if self.gating == GATING_SIGMOID:
            probs = logits.sigmoid()
        elif self.gating == GATING_SOFTMAX:
            probs = logits.softmax(-1)
        else:
            probs = logits
        sel = probs + self.bias
        order = sel.argsort(-1, descending=True)
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(
            self.E, device=order.device).expand_as(order).contiguous())
        rb = rank.clamp_max(self.NR - 1).cpu().numpy()
        return rb, self.memory.counts(tokens)

    def predict(self, hidden: torch.Tensor, tokens: list[int]) -> np.ndarray:
        """``[n_layers, E]`` probability that the pass over ``tokens`` needs each expert."""
        rb, mem = self.features(hidden, tokens)
        self._last = (rb, mem)
        li = np.arange(len(self.layers))[None, :, None]
        p = self.hits[li, rb, mem] / self.total[li, rb, mem]          # [rows, n, E]
        return 1.0 - np.prod(1.0 - p, axis=0)

    def learn(self, used: np.ndarray) -> None:
        """``used [rows, n_layers, E]`` bool: what each row of the last predicted pass routed."""
        if self._last is None:
            return
        rb, mem = self._last
        rows = min(used.shape[0], rb.shape[0])
        li = np.broadcast_to(np.arange(len(self.layers))[None, :, None], rb[:rows].shape)
        np.add.at(self.total, (li, rb[:rows], mem[:rows]), 1.0)
        np.add.at(self.hits, (li, rb[:rows], mem[:rows]), used[:rows].astype(np.float64))
        self._last = None


@dataclass
class RouteScore:
    """Predictions against the verify passes' needs (per layer visit, union over rows): a
    ``PredictionScore`` and the bytes of the experts predicted."""

    steps: int = 0
    score: PredictionScore = field(default_factory=PredictionScore)
    predicted_bytes: int = 0
    wasted_bytes: int = 0        # bytes of the predicted experts not needed

    def add(self, predicted: set[int], needed: set[int], nbytes: int) -> None:
        """One layer of a verify pass; ``nbytes``: one expert's size at that layer."""
        h = self.score.add(predicted, needed)
        self.predicted_bytes += len(predicted) * nbytes
        self.wasted_bytes += (len(predicted) - h) * nbytes

    def as_dict(self) -> dict[str, Any]:
        sc = self.score
        return {"steps": self.steps, "predicted": sc.predicted, "needed": sc.needed,
                "hits": sc.hits, "predicted_bytes": self.predicted_bytes,
                "wasted_bytes": self.wasted_bytes, **sc.ratios("coverage", "waste", digits=4)}


class DraftRoutePrefetcher:
    def __init__(self, engine: Any, *, threshold: float | None = None,
                 max_per_layer: int | None = None, max_in_flight: int = 16) -> None:
        self.engine = engine
        self.predictor = DraftRoutePredictor(engine)
        self.threshold = threshold
        self.max_per_layer = max_per_layer or 4 * self.predictor.k * 2
        self.max_in_flight = max_in_flight
        self.score = RouteScore()
        self._routes: dict[int, np.ndarray] = {}
        self._pred: dict[int, list[int]] = {}
        self._queue: list[tuple[int, int]] = []      # (layer, expert) still to read, in order
        self._verify = False
        self.claimed = self.issued = self.dropped = 0
        self.rho: float | None = None          # share of a step spent waiting on storage
        self._t0 = self._stall0 = 0.0
        prov = engine.provider
        self._in_flight = prov.prefetch_in_flight if isinstance(prov, TierState) else None
        self._report = prov.prefetch_report if isinstance(prov, PrefetchReport) else None
        from .routing import resident_fn
        self._resident = resident_fn(engine.provider, engine.runner.dq)
        store = engine.store
        self._bytes = {la: int(store.extent(la, 0).length) for la in self.predictor.layers}

    def install(self, spec: Any, routing: Any) -> DraftRoutePrefetcher:
        """Hook into ``spec`` (a ``Speculator``) and tap ``routing`` (its ``RouterHook``)."""
        spec.tail_hidden = True
        spec.tail_mode = "attn"
        spec.route_hooks.append(self.before_verify)
        spec.verify_hooks.append(self.after_verify)
        spec.observe_hooks.append(self.on_forward)
        spec.draft_prefetcher = self
        routing.taps.append(self.tap)
        self.spec = spec
        return self

    def current_threshold(self) -> float:
        """A fixed threshold if given; else the utility rule p > ρ/(1+ρ) (ρ: the share of a
        step spent waiting on storage; a wasted read costs bandwidth in proportion to it),
        clipped to [0.1, 0.5], from the gate's ρ or this prefetcher's own."""
        if self.threshold is not None:
            return self.threshold
        gate = self.spec.gate
        if gate is not None and hasattr(gate, "fetch_threshold"):
            return gate.fetch_threshold()
        if self.rho is None:
            return DEFAULT_THRESHOLD
        return min(0.5, max(0.1, self.rho / (1.0 + self.rho)))

    # --- the hooks ---------------------------------------------------------------------------
    def tap(self, layer: int, x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor) -> None:
        if layer in self._bytes:
            r = ids.cpu().numpy()
            k = self.predictor.k
            if r.shape[1] < k:                 # a one-token window under the tail skip
                r = np.concatenate((r, np.full((r.shape[0], k - r.shape[1]), -1, r.dtype)), 1)
            self._routes[layer] = r
            if self._verify and self._queue:
                self._pump(layer)

    def _pump(self, reached: int) -> None:
        """Drop predictions for layers the pass has reached; read the next ones while fewer
        than ``max_in_flight`` prefetch reads are in flight."""
        q = self._queue
        i = 0
        while i < len(q) and q[i][0] <= reached:
            i += 1
        self.dropped += i
        del q[:i]
        room = (self.max_in_flight - self._in_flight()) if self._in_flight else len(q)
        if room <= 0 or not q:
            return
        take, self._queue = q[:room], q[room:]
        prov = self.engine.provider
        j = 0
        while j < len(take):
            la = take[j][0]
            ids = []
            while j < len(take) and take[j][0] == la:
                ids.append(take[j][1])
                j += 1
            prov.prefetch(la, ids, source="draft")
            self.issued += len(ids)

    def on_forward(self, tokens: list[int]) -> None:
        """A trunk forward finished: outside verify passes, its rows are committed."""
        routes, self._routes = self._routes, {}
        if self._verify or not routes or len(routes) != len(self.predictor.layers):
            if self._verify:
                self._routes = routes
            return
        self._remember(tokens, routes, len(tokens))

    def _remember(self, tokens: list[int], routes: dict[int, np.ndarray], rows: int) -> None:
        stack = np.stack([routes[la] for la in self.predictor.layers], 1)    # [T, n, k]
        for r in range(min(rows, len(tokens))):
            self.predictor.memory.add(int(tokens[r]), stack[r])

    def before_verify(self, ds: DraftState) -> None:
        if len(ds.mtp_hidden) < len(ds.tokens):
            return
        p = self.predictor.predict(torch.cat(ds.mtp_hidden), ds.tokens)
        th = self.current_threshold()
        prov = self.engine.provider
        self._pred = {}
        self._queue = []
        for i, la in enumerate(self.predictor.layers):
            row = p[i]
            ids = np.nonzero(row >= th)[0]
            ids = ids[np.argsort(-row[ids], kind="stable")][:self.max_per_layer].tolist()
            self._pred[la] = ids
            have = [e for e in ids if self._resident(la, e)]
            if have:                           # claim: soft-pinned until the layer runs
                prov.prefetch(la, have, source="draft")
                self.claimed += len(have)
            self._queue += [(la, e) for e in ids if e not in have]
        self._verify = True
        self._routes = {}
        self._pump(-1)
        self._t0 = time.perf_counter()
        self._stall0 = prov.stats.stall_seconds

    def after_verify(self, ds: DraftState, n_accepted: int) -> None:
        self._verify = False
        st = self.engine.provider.stats
        dt = time.perf_counter() - self._t0
        if dt > 0:
            r = min(1.0, max(0.0, (st.stall_seconds - self._stall0) / dt))
            self.rho = r if self.rho is None else 0.8 * self.rho + 0.2 * r
        self.dropped += len(self._queue)
        self._queue = []
        routes, self._routes = self._routes, {}
        if len(routes) != len(self.predictor.layers):
            return
        rows = len(ds.tokens)
        n, E = len(self.predictor.layers), self.predictor.E
        used = np.zeros((rows, n, E), bool)
        sc = self.score
        sc.steps += 1
        for i, la in enumerate(self.predictor.layers):
            r = routes[la][:rows]
            rr, cc = np.nonzero(r >= 0)
            used[rr, i, r[rr, cc]] = True
            need = set(r[r >= 0].tolist())
            sc.add(set(self._pred.get(la, ())), need, self._bytes[la])
        self.predictor.learn(used)
        self._remember(ds.tokens, routes, n_accepted + 1)

    def as_dict(self) -> dict[str, Any]:
        d = self.score.as_dict()
        d["threshold"] = round(self.current_threshold(), 4)
        d["disk_wait_share"] = None if self.rho is None else round(self.rho, 4)
        d.update(claimed=self.claimed, issued=self.issued, dropped=self.dropped,
                 max_in_flight=self.max_in_flight)
        d["memory_tokens"] = len(self.predictor.memory)
        if self._report is not None:
            src = self._report().get("draft")
            if src is not None:
                d["provider"] = {k: (round(v, 4) if isinstance(v, float) else v)
                                 for k, v in src.items()}
        return d
