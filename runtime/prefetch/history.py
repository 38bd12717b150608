"""A history-based expert predictor: which experts will layer L use, from the routes seen so far.

Pure (numpy only; no I/O, no clock). Fed every route as it happens (``observe(layer, experts)``
in execution order: token-major, layers in order), it ranks the experts of the next layer
(``predict(layer, budget)``) by a mixture of three estimates, each an expected count over the
layer's experts that sums to about one route:

* **recency**: the previous token's route at that layer (consecutive tokens reuse experts);
* **transition**: from the route just seen at the layer before, how often each expert followed
  each of those experts in earlier tokens (routing paths run across layers; the last layer
  links to the first layer of the next token);
* **frequency**: each expert's decayed use count at that layer (a few experts are hot).

Counts decay with a half-life in tokens. The mixture weights are learnt online, per predictor:
each component's hit rate on the routes it predicted (its top-``k`` against the actual route),
exponentially averaged, so a sticky model leans on recency and a path-structured one on
transitions. Memory: ``n_layers × n_experts²`` float32 for the transitions (31 MB for 94 × 288).
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
                 learn_rate: float = 0.05, prior: Sequence[float] = (0.5, 0.3, 0.2)) -> None:
        if n_layers < 1 or n_experts < 1:
            raise UsageError(f"history predictor for {n_layers} layers × {n_experts} experts",
                             fix="give at least one layer and one expert")
        if half_life <= 0:
            raise UsageError(f"half-life {half_life}", fix="give a half-life > 0 tokens")
        self.n_layers, self.n_experts = n_layers, n_experts
        self.trans = np.zeros((n_layers, n_experts, n_experts), np.float32)  # [l, from, to(l+1)]
        self.freq = np.zeros((n_layers, n_experts), np.float64)
        self.prev: list[np.ndarray | None] = [None] * n_layers   # last route per layer
        self.skill = np.asarray(prior, np.float64)               # components' recent hit rates
        self.learn_rate = learn_rate
        self._growth = 2.0 ** (1.0 / half_life)     # increments grow instead of counts decaying
        self._unit = 1.0
        self._last: tuple[int, np.ndarray] | None = None        # the route just observed
        self._pending: dict[int, tuple[np.ndarray, ...]] = {}   # layer -> components' top-k

    # -- learning -----------------------------------------------------------------------------
    def observe(self, layer: int, experts: Sequence[int]) -> None:
        """The route of ``layer`` (an index 0..n_layers-1) for the current token."""
        route = np.asarray(experts, dtype=np.int64)
        if route.size == 0:
            return
        self._score(layer, route)
        last = self._last
        if last is None or layer <= last[0]:           # a new token
            self._unit *= self._growth
            if self._unit > _RENORM:
                self.trans /= np.float32(self._unit)
                self.freq /= self._unit
                self._unit = 1.0
        if last is not None and last[0] == (layer - 1) % self.n_layers:
            self.trans[last[0]][np.ix_(last[1], route)] += np.float32(self._unit)
        self.freq[layer, route] += self._unit
        self.prev[layer] = route
        self._last = (layer, route)

    def _score(self, layer: int, route: np.ndarray) -> None:
        """Update the mixture weights from what each component predicted for this route."""
        tops = self._pending.pop(layer, None)
        if tops is None:
            return
        actual = set(route.tolist())
        rate = self.learn_rate
        for i, top in enumerate(tops):
            if top.size:
                hit = sum(1 for x in top.tolist() if x in actual) / min(top.size, len(actual))
                self.skill[i] += rate * (hit - self.skill[i])

    # -- predicting ---------------------------------------------------------------------------
    def components(self, layer: int) -> np.ndarray:
        """``[3, n_experts]``: recency, transition and frequency estimates for ``layer``."""
        E = self.n_experts
        out = np.zeros((3, E))
        prev = self.prev[layer]
        if prev is not None:
            out[0, prev] = 1.0
        last = self._last
        src = (layer - 1) % self.n_layers
        if last is not None and last[0] == src:
            rows = self.trans[src][last[1]].astype(np.float64)       # [k, E]
            tot = rows.sum(axis=1, keepdims=True)
            np.divide(rows, tot, out=rows, where=tot > 0)
            out[1] = rows.sum(axis=0)
        f = self.freq[layer]
        s = f.sum()
        if s > 0:
            width = prev.size if prev is not None else 1
            out[2] = f * (width / s)
        return out

    def predict(self, layer: int, budget: int) -> list[int]:
        """Up to ``budget`` experts of ``layer``, most likely first (fewer when nothing is
        known yet)."""
        comps = self.components(layer)
        w = np.maximum(self.skill, 1e-3)
        score = w @ comps
        k = max(1, min(budget, self.n_experts))
        tops = []
        width = self.prev[layer].size if self.prev[layer] is not None else k
        for c in comps:
            nz = np.flatnonzero(c)
            tops.append(nz[np.argsort(-c[nz], kind="stable")][:width] if nz.size else nz)
        self._pending[layer] = tuple(tops)
        nz = np.flatnonzero(score > 0)
        if nz.size == 0:
            return []
        order = nz[np.argsort(-score[nz], kind="stable")]
        return order[:k].tolist()

    @property
    def weights(self) -> dict[str, float]:
        w = np.maximum(self.skill, 1e-3)
        return dict(zip(COMPONENTS, (w / w.sum()).tolist()))
