"""The routed-expert FFN of one layer: route → one host sync → provider.get → compute → combine.

Per layer and batch, the router runs on the device; the only host synchronisation is one copy
of the expert ids needed to ask the provider (for a batch: per-expert token counts), together
with the next layer's lookahead prediction when that is on. Each touched expert is fetched once
per batch and computed on all of its tokens (gather, SwiGLU, weight, ``index_add`` scatter);
a decode step (T=1) skips the gather. The provider's weights are released after the layer.

T=tokens, k=experts per token, E=experts, D=n_embd.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import UsageError
from ..experts.protocol import BoundedGet, ExpertProvider, SplitGet
from .dqcache import DequantCache
from .expert_groups import as_computed, group_rows, groupable
from .ffn import DenseFFN, expert_ffn
from ..prefetch.lookahead import LookaheadStats
from .native_experts import (native_combine, native_down_rows, native_expert_tokens,
                             native_hidden)
from .qmatvec import fused_experts
from .router import Router, RouterWeights

__all__ = ["MoEWeights", "ExpertRunner", "MoEStats"]

log = logging.getLogger(__name__)


@dataclass
class MoEWeights:
    router: RouterWeights
    shared: DenseFFN | None = None
    limit: float = 0.0           # the routed experts' swiglu clamp (0 = none)
    alpha: float = 0.0           # gpt-oss's swiglu_oai (0 = plain SwiGLU; its experts also
                                 # carry bias parts, which the expert weights bring)


@dataclass
class MoEStats:
    tokens: int = 0              # token × layer routings
    pairs: int = 0               # token × expert products computed
    fetches: int = 0             # experts asked of the provider (once per batch and layer)
    dq_hits: int = 0             # experts served by the dequantized cache
    overlapped: int = 0          # decode steps that computed resident experts during reads
    streamed: int = 0            # batch experts computed before the batch's last read landed

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class ExpertRunner:
    """What the MoE layers share: provider, dequant cache, routing and lookahead state."""

    provider: ExpertProvider
    router: Router
    dtype: torch.dtype
    dq: DequantCache = field(default_factory=lambda: DequantCache(0))
    lookahead: LookaheadStats | None = None
    stats: MoEStats = field(default_factory=MoEStats)
    record: list[tuple[int, torch.Tensor, torch.Tensor]] | None = None   # trace rows
    fused: bool = False          # decode matvecs through qmatvec (native or compiled, CPU)
    act_quant: str = "off"       # "q8": llama.cpp's 8-bit activations (lossy, opt-in; native)
    decoding: bool = False       # the forward running is a decode step or a verify pass, not
                                 # prefill (a router may treat those windows differently)
    grouped: bool = False        # experts dequantized ``group_max`` at a time, each role in
                                 # one call (``expert_groups``: the device path's launches)
    group_max: int = 8           # at most the experts the device workspace holds dequantized
    group_products: bool = False  # a decode step's products a group at once (``group_rows``)

    def __post_init__(self) -> None:
        p = self.provider
        self._split = p if isinstance(p, SplitGet) else None        # overlapped decode reads
        self._bounded = p if isinstance(p, BoundedGet) else None    # prefill gets in parts

    def set_router(self, router: Router) -> None:
        """Route with ``router`` from now on (a ``Router`` with hooks: same selection)."""
        self.router = router

    def set_act_quant(self, mode: str) -> None:
        """``"off"`` (exact, the default) or ``"q8"``: the native expert products quantize
        their activations as llama.cpp does (lossy, opt-in; see ``runtime.kernels``). Without
        the native kernels or the fused path the products stay exact (logged)."""
        from .. import kernels
        try:
            kernels.act_quant_mode(mode)
        except ValueError as e:
            raise UsageError(str(e), fix="use --act-quant off or q8") from None
        self.act_quant = mode
        if mode != "off" and not (self.fused and kernels.available()):
            log.warning("--act-quant %s needs the native CPU kernels and the fused path; "
                        "expert products stay exact", mode)

    def _dq_hits(self, layer: int, experts: list[int]) -> tuple[dict[int, Any], list[int]]:
        """(the dequant cache's float experts among ``experts``, the others to fetch)."""
        if not self.dq.enabled:
            return {}, experts
        hits: dict[int, Any] = {}
        need = []
        for e in experts:
            f = self.dq.get(layer, e)
            if f is None:
                need.append(e)
            else:
                hits[e] = f
        self.stats.dq_hits += len(experts) - len(need)
        return hits, need

    def _fetched(self, layer: int, experts: list[int]) -> tuple[dict[int, Any], dict[int, Any]]:
        """(the dequant cache's hits among ``experts``, the others' weights, fetched at once)."""
        floats, need = self._dq_hits(layer, experts)
        got = self.provider.get(layer, need) if need else {}
        self.stats.fetches += len(need)
        return floats, got

    def _weights(self, layer: int, experts: list[int]) -> dict[int, Any]:
        """Weights of ``experts`` of ``layer`` as the products take them, fetched at once."""
        return dict(self._in_groups(layer, experts, *self._fetched(layer, experts), None))

    def _weights_each(self, layer: int, experts: list[int],
                      then: Callable[[], None] | None = None, *, arrival: bool = False
                      ) -> Iterator[tuple[int, Any]]:
        """``(expert, weights)`` of ``experts`` in their order, each as soon as it is ready: the
        misses' reads are all issued first (full queue depth), then each is awaited only when its
        turn comes, so the products of the experts already in run while the rest are read. The
        same weights as ``_weights`` (dequant-cache hits included), in the same order.
        ``then()`` runs once the reads are issued (prefetches queue behind them). ``arrival``:
        the ready ones first, then the rest in the order their reads land."""
        if self._split is None:                           # all of them fetched at once
            floats, got = self._fetched(layer, experts)
            if then is not None:
                then()
            yield from self._in_groups(layer, experts, floats, got, None)
            return
        floats, need = self._dq_hits(layer, experts)
        ready, finish = self._split.get_begin(layer, need) if need else ({}, None)
        self.stats.fetches += len(need)
        if then is not None:
            then()
        late = [e for e in need if e not in ready]
        if arrival:
            if late and len(late) < len(experts):
                self.stats.overlapped += 1
            order = [e for e in experts if e not in late]
            now = self._as_floats(layer, {e: ready[e] for e in order if e not in floats})
            for e in order:
                yield e, floats[e] if e in floats else now[e]
            while late:
                got = finish(late, some=True)
                late = [e for e in late if e not in got]
                yield from self._as_floats(layer, got).items()
            return
        if late:
            self.stats.streamed += experts.index(late[-1])
        yield from self._in_groups(layer, experts, floats, ready, finish)

    def _in_groups(self, layer: int, experts: list[int], floats: dict[int, Any],
                   ready: dict[int, Any], finish: Callable[..., dict[int, Any]] | None
                   ) -> Iterator[tuple[int, Any]]:
        """``(expert, weights)`` in ``experts``' order: dequant-cache hits ``floats``, the
        ``ready`` weights (``grouped``: half ``group_max`` at a time, as the caller holds the
        last of the group before while the next is made), the others through ``finish``."""
        done: dict[int, Any] = {}
        half = max(1, self.group_max // 2)
        for i, e in enumerate(experts):
            f = floats.get(e) or done.pop(e, None)        # (weights are never falsy)
            if f is None and e in ready and self.grouped:
                nxt = [x for x in experts[i:] if x in ready and x not in floats]
                done = self._as_floats(layer, {x: ready[x] for x in nxt[:half]})
                f = done.pop(e)
            elif f is None:
                w = ready.get(e)
                w = finish([e])[e] if w is None else w
                f = self._as_floats(layer, {e: w})[e] if self.grouped or self.dq.enabled else w
            yield e, f

    def _as_floats(self, layer: int, got: dict[int, Any]) -> dict[int, Any]:
        """``got`` (expert → provider weights) as the products take them (``as_computed``)."""
        return as_computed(layer, got, self.dtype, self.dq, self.grouped, self.group_max)

    def _overlapped(self, layer: int, x: torch.Tensor, w: torch.Tensor, experts: list[int],
                    shared: DenseFFN | None, then: Callable[[], None], limit: float = 0.0,
                    alpha: float = 0.0
                    ) -> tuple[torch.Tensor | None, dict[int, Any] | None, torch.Tensor | None]:
        """One decode step that computes each expert's rows (gate/up, then down) as soon as it
        is in: the resident experts and the shared expert while the missing ones are read, then
        the missing ones in the order their reads land, each group while the later reads run;
        the weighted sum is taken in routing order: bit for bit the one-call product
        (``native_experts.native_hidden``, ``native_down_rows``, ``native_combine``: each
        expert's rows depend on its weights and ``x`` only). On the device path (not ``fused``)
        the same with each group's rows from ``expert_groups.group_rows`` and the sum as one
        product. Returns (routed output, the weights, the shared expert's output), each None
        when not done here: on the native path every expert resident (one call does it), or
        no such path for the types, and the caller computes from the weights as usual.
        ``then()`` runs once this layer's reads are issued (the next layer's prefetch: it
        queues behind them)."""
        if self._split is None:
            return None, None, None
        ready, finish = self._split.get_begin(layer, experts)
        then()
        self.stats.fetches += len(experts)
        if len(ready) == len(experts) and self.fused:
            return None, ready, None
        weights = dict(ready)
        group = [e for e in experts if e in ready]              # computable now
        late = [e for e in experts if e not in ready]           # still being read
        rows: list[torch.Tensor] = []
        order: list[int] = []                                   # experts of the rows, in order
        sh = None
        during = False                                          # computed while reads ran
        while True:
            if group:
                v = self._rows(x, [weights[e] for e in group], limit, alpha)
                if v is None:                                   # no such path for these types
                    weights.update(finish())
                    return None, weights, sh
                rows.append(v)
                order += group
                during = during or bool(late)
            if sh is None and shared is not None:               # independent of the reads
                sh = shared(x).float()
            if not late:
                break
            got = finish(late, some=True)
            weights.update(got)
            group = [e for e in late if e in got]
            late = [e for e in late if e not in got]
        if during:
            self.stats.overlapped += 1
        row = {e: i for i, e in enumerate(order)}               # rows of the cat below
        return self._weighted_sum(torch.cat(rows), w, [row[e] for e in experts]), weights, sh

    def _rows(self, x: torch.Tensor, ws: list, limit: float, alpha: float
              ) -> torch.Tensor | None:
        """Each of the experts ``ws``' unweighted output row ``[n, D]`` for one token ``x``:
        the native kernels' two phases, or on the device path ``expert_groups.group_rows``;
        None where neither takes these experts."""
        if not self.fused:
            return group_rows(x, ws, limit, alpha) if groupable(ws) else None
        h = native_hidden(x, ws, self.act_quant, limit, alpha)
        return None if h is None else native_down_rows(h, ws, x.shape[1], self.act_quant)

    def _weighted_sum(self, v: torch.Tensor, w: torch.Tensor, at: list[int]) -> torch.Tensor:
        """``Σ_j w[j] · v[at[j]]`` in routing order j, ``[1, D]``: native, the one-call
        product's bits; on the device path one product over the rows stacked in that order
        (views: no index tensor copied to the device)."""
        if self.fused:
            return native_combine(v, w, at)
        return (w.to(v.dtype) @ torch.stack([v[i] for i in at])).unsqueeze(0)

    def prefetch(self, layer: int, ids: torch.Tensor) -> None:
        """Prefetch the union of ``ids`` for ``layer`` (used after a dense layer; one sync)."""
        nxt = set(ids.flatten().tolist())
        self.provider.prefetch(layer, sorted(nxt))
        if self.lookahead is not None:
            self.lookahead.predict(layer, nxt)

    def forward(self, layer: int, x: torch.Tensor, w: MoEWeights,
                predict: tuple[int, torch.Tensor] | None = None) -> torch.Tensor:
        """``x [T, D]`` (normed FFN input) → routed (+ shared) expert output ``[T, D]``.

        ``predict = (next_layer, ids [T, k+m])`` is the lookahead prediction to prefetch.
        """
        T = x.shape[0]
        ids, wts, _ = self.router(x, w.router)                         # [T, k], [T, k]
        k = ids.shape[1]
        if self.record is not None:
            self.record.append((layer, ids, wts))
        if T == 1:
            host = ids[0] if predict is None else torch.cat((ids[0], predict[1][0]))
            hv = host.tolist()                                           # the one sync
            experts, pred = hv[:k], hv[k:]
        else:
            E = w.router.weight.shape[0]
            flat = ids.flatten()     # (not bincount: on CUDA it syncs for the ids' range)
            counts = torch.zeros(E, dtype=flat.dtype, device=flat.device).scatter_add_(
                0, flat, torch.ones_like(flat))
            host = counts if predict is None else torch.cat((counts, predict[1].flatten()))
            hv = host.tolist()                                           # the one sync
            counts_h, pred = hv[:E], hv[E:]
            experts = [e for e in range(E) if counts_h[e]]
        if self.lookahead is not None:
            self.lookahead.on_route(layer, set(experts))
        pending = predict is not None

        def prefetch_next() -> None:
            """The lookahead's prefetch of the next layer (best first), once: after this
            layer's reads are issued where the provider lets the layer start before they land."""
            nonlocal pending
            if pending:
                pending = False
                # a batch's predictions most wanted first; one token's in rank order
                ranked = [e for e, _ in Counter(pred).most_common()] if T > 1 else \
                    list(dict.fromkeys(pred))
                self.provider.prefetch(predict[0], ranked)
                if self.lookahead is not None:
                    self.lookahead.predict(predict[0], set(ranked))
        self.stats.tokens += T
        self.stats.pairs += T * k
        try:
            out = weights = shared = None
            whole = self.fused                          # the one-call layer products
            if T == 1 and (whole or self.group_products) and not self.dq.enabled:
                out, weights, shared = self._overlapped(layer, x, wts[0], experts, w.shared,
                                                        prefetch_next, w.limit, w.alpha)
            if T > 1:
                out = self._batched(layer, x, ids, wts, experts, counts_h, w.limit, w.alpha,
                                    prefetch_next)
            elif out is None and weights is None and not whole and self._split is not None:
                out = self._arriving(layer, x, wts[0], experts, w.limit, w.alpha, prefetch_next)
            elif out is None:
                prefetch_next()
                if weights is None:
                    weights = self._weights(layer, experts)
                if whole:
                    out = fused_experts(x, wts[0], [weights[e] for e in experts],
                                        self.act_quant, w.limit, w.alpha)
                if out is None:
                    out = torch.zeros(1, x.shape[1], dtype=torch.float32, device=x.device)
                    for j, e in enumerate(experts):
                        out.add_(expert_ffn(x, weights[e], self.fused, self.act_quant,
                                            w.limit, w.alpha).float() * wts[0, j])
        finally:
            self.provider.release(layer)
        if w.shared is not None:
            out.add_(shared if shared is not None else w.shared(x).float())
        return out.to(x.dtype)

    def _arriving(self, layer: int, x: torch.Tensor, w: torch.Tensor, experts: list[int],
                  limit: float, alpha: float, then: Callable[[], None]) -> torch.Tensor:
        """One token's routed output (the device path: no one-call products), each expert
        computed as soon as it is ready: the resident ones first, then the others in the order
        their reads land (a device tier queues each upload as its read lands), not routing
        order. The weighted sum is added in routing order afterwards: bit for bit the product
        of the whole get. ``then()`` runs once the reads are issued."""
        ys: dict[int, torch.Tensor] = {}
        for e, we in self._weights_each(layer, experts, then, arrival=True):
            ys[e] = expert_ffn(x, we, self.fused, self.act_quant, limit, alpha).float()
        out = torch.zeros(1, x.shape[1], dtype=torch.float32, device=x.device)
        for j, e in enumerate(experts):
            out.add_(ys[e] * w[j])
        return out

    def _batched(self, layer: int, x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor,
                 experts: list[int], counts: list[int], limit: float = 0.0,
                 alpha: float = 0.0, then: Callable[[], None] | None = None) -> torch.Tensor:
        """A batch's routed output: each used expert (ascending) applied to its tokens, each as
        soon as its read lands (``_weights_each``). When the layer needs more experts than the
        compute tier holds at once, they are fetched in parts, each computed and released
        before the next; the caller releases the last. ``then()`` (the next layer's prefetch)
        runs once this layer's reads are issued, when the layer is fetched in one part (in
        parts the tier has no room to read ahead).

        Each token's weighted expert outputs are added in ascending expert order, starting
        from zero: the sum a per-expert ``index_add_`` into a zero output gives, bit for bit,
        without its cost (on the CPU it walks the indices one by one). Each expert writes its
        rows into one contiguous run of a pair buffer (pairs sorted by expert); then for each
        rank r, one ``index_select`` of every token's r-th expert row and one add over
        ``[T, D]``."""
        T, k = ids.shape
        ids, perm = ids.sort(dim=1)                  # each token's experts ascending
        wts = wts.gather(1, perm)
        order = torch.argsort(ids.flatten(), stable=True)                # [T*k], by expert
        tok = order // k                                                 # token of each pair
        wsorted = wts.flatten().index_select(0, order)
        start = list(itertools.accumulate(counts, initial=0))           # first pair per expert
        pairs = torch.empty((T * k, x.shape[1]), dtype=torch.float32, device=x.device)
        # experts as plain ggml bytes: one native call each (expert_ffn's bits, none of its
        # Python between the products)
        fast = self.fused and x.is_cpu and x.dtype == torch.float32
        xf = x.contiguous() if fast else x
        room = self._bounded.max_experts_per_get if self._bounded is not None else 0
        room = room if 0 < room < len(experts) else max(1, len(experts))
        for p in range(0, len(experts), room):
            if p:
                self.provider.release(layer)
            for e, we in self._weights_each(layer, experts[p:p + room],
                                            then if room >= len(experts) else None):
                a, b = start[e], start[e] + counts[e]
                if fast and native_expert_tokens(xf, tok[a:b], wsorted[a:b], pairs[a:b], we,
                                                 self.act_quant, limit, alpha):
                    continue                  # the native kernels' one call for the expert
                y = expert_ffn(x.index_select(0, tok[a:b]), we, self.fused,
                               self.act_quant, limit, alpha).float()
                torch.mul(y, wsorted[a:b, None], out=pairs[a:b])
        row = torch.argsort(order).view(T, k)          # token t's r-th expert: pairs[row[t, r]]
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for r in range(k):
            out.add_(pairs.index_select(0, row[:, r]))
        return out
