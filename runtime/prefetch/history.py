"""A history-based expert predictor: which experts will layer L use, from the routes seen so far.

Pure (numpy only; no I/O, no clock). Fed every route as it happens (``observe(layer, experts)``
with layer *indices* 0..n_layers-1, in execution order: token-major, layers in order), it ranks
the experts of a layer (``predict(layer, budget)``) by the probability that the layer's next
route uses them, from three estimates, each a calibrated probability per expert:

* **recency**: an expert of the previous token's route at that layer is used again with the
  layer's measured reuse rate (consecutive tokens reuse experts);
* **transition**: ``P(e at L | f at L-1)`` = decayed co-occurrences ÷ decayed occurrences of
  ``f``, combined over the route just seen at L-1 by noisy-OR (routing paths run across layers;
  the last layer links to the first layer of the next token);
* **frequency**: the decayed share of the layer's tokens that used the expert (hot experts).

They are mixed by an online logistic regression (one small weight vector for all layers,
updated on every route against what was predicted for it), so a sticky model leans on recency,
a path-structured one on transitions and a skewed one on frequency, and the ranking is never
worse than the best single estimate by more than noise (``tests/runtime/prefetch/test_prefetch_history.py``).
Counts decay with a half-life in tokens. Memory: ``n_layers × n_experts²`` float32 for the
transitions (31 MB for 94 layers × 288 experts).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from expertfs.errors import UsageError

__all__ = ["HistoryPredictor", "COMPONENTS"]

COMPONENTS = ("recency", "transition", "frequency")
_RENORM = 1e30


class HistoryPredictor:
    name = "history"

    def __init__(self, n_layers: int, n_experts: int, *, half_life: float = 128.0,
                 learn_rate: float = 0.05) -> None:
        if n_layers < 1 or n_experts < 1:
            raise UsageError(f"history predictor for {n_layers} layers × {n_experts} experts",
                             fix="give at least one layer and one expert")
        if half_life <= 0:
            raise UsageError(f"half-life {half_life}", fix="give a half-life > 0 tokens")
        L, E = n_layers, n_experts
        self.n_layers, self.n_experts = L, E
        self.trans = np.zeros((L, E, E), np.float32)     # [l, f at l, e at l+1] co-occurrences
        self.occ = np.zeros((L, E), np.float64)          # [l, f]: uses of f followed by layer l+1
        self.freq = np.zeros((L, E), np.float64)         # [l, e]: uses
        self.tokens = np.zeros(L, np.float64)            # [l]: routes seen
        self.reuse = np.full(L, 0.5)                     # [l]: share of a route used again next
        self.prev: list[np.ndarray | None] = [None] * L
        self._prev_ids: list[set[int]] = [set() for _ in range(L)]
        self.coef = np.array([2.0, 2.0, 2.0, -3.0])       # recency, transition, frequency, bias
        self.learn_rate = learn_rate
        self._growth = 2.0 ** (1.0 / half_life)          # increments grow instead of decaying
        self._unit = 1.0
        self._last: tuple[int, np.ndarray] | None = None
        self._pending: dict[int, np.ndarray] = {}        # layer -> features it was predicted with

    # -- learning -----------------------------------------------------------------------------
    def observe(self, layer: int, experts: Sequence[int]) -> None:
        """The route of ``layer`` (an index) for the current token."""
        ids = sorted({int(e) for e in experts})
        if not ids:
            return
        route = np.array(ids, dtype=np.int64)
        self._learn(layer, route)
        last = self._last
        if last is None or layer <= last[0]:                   # a new token
            self._unit *= self._growth
            if self._unit > _RENORM:
                self._rebase()
        u = self._unit
        if last is not None and last[0] == (layer - 1) % self.n_layers:
            self.trans[last[0]][np.ix_(last[1], route)] += np.float32(u)
            self.occ[last[0], last[1]] += u
        prev = self.prev[layer]
        if prev is not None:
            kept = len(self._prev_ids[layer].intersection(ids)) / len(ids)
            self.reuse[layer] += self.learn_rate * (kept - self.reuse[layer])
        self._prev_ids[layer] = set(ids)
        self.freq[layer, route] += u
        self.tokens[layer] += u
        self.prev[layer] = route
        self._last = (layer, route)

    def _rebase(self) -> None:
        u = self._unit
        self.trans /= np.float32(u)
        self.occ /= u
        self.freq /= u
        self.tokens /= u
        self._unit = 1.0

    def _learn(self, layer: int, route: np.ndarray) -> None:
        """One logistic-regression step on what was predicted for this layer."""
        X = self._pending.pop(layer, None)
        if X is None:
            return
        y = np.zeros(self.n_experts)
        y[route] = 1.0
        p = 1.0 / (1.0 + np.exp(-(X @ self.coef)))
        self.coef -= self.learn_rate * (X.T @ (p - y)) / route.size

    # -- predicting ---------------------------------------------------------------------------
    def features(self, layer: int) -> np.ndarray:
        """``[n_experts, 4]``: the recency, transition and frequency probabilities of each expert
        of ``layer``, and a constant 1 (the regression's bias)."""
        X = np.zeros((self.n_experts, 4))
        X[:, 3] = 1.0
        prev = self.prev[layer]
        if prev is not None:
            X[prev, 0] = self.reuse[layer]
        last = self._last
        src = (layer - 1) % self.n_layers
        if last is not None and last[0] == src:
            f = last[1]
            occ = self.occ[src, f]
            seen = occ > 0
            if seen.any():
                p = self.trans[src][f[seen]] * (1.0 / occ[seen])[:, None]   # P(e | f)
                np.minimum(p, 1.0, out=p)
                X[:, 1] = 1.0 - np.prod(1.0 - p, axis=0)
        t = self.tokens[layer]
        if t > 0:
            np.minimum(self.freq[layer] * (1.0 / t), 1.0, out=X[:, 2])
        return X

    def components(self, layer: int) -> np.ndarray:
        """``[3, n_experts]``: recency, transition and frequency estimates for ``layer``."""
        return self.features(layer)[:, :3].T.copy()

    def predict(self, layer: int, budget: int) -> list[int]:
        """Up to ``budget`` experts of ``layer``, most likely first; only experts some estimate
        gives a chance (so fewer, or none, before anything is known)."""
        X = self.features(layer)
        self._pending[layer] = X
        if budget < 1:
            return []
        cand = np.flatnonzero(X[:, :3].any(axis=1))
        if cand.size == 0:
            return []
        score = (X @ self.coef)[cand]
        if cand.size > budget:
            top = np.argpartition(-score, budget - 1)[:budget]
            cand, score = cand[top], score[top]
        return cand[np.argsort(-score, kind="stable")].tolist()

    @property
    def weights(self) -> dict[str, float]:
        """The mixture's coefficient of each estimate (they are all probabilities, so the
        coefficients compare)."""
        return dict(zip(COMPONENTS, self.coef[:3].tolist()))
