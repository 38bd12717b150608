"""Offline measurements of MTP on a model: acceptance, route predictors, the tail skip's cost.

* ``acceptance(mtp, prompts, params, n_new)``: speculative generation from each prompt;
  acceptance overall and by depth, tokens per step.
* ``route_predictors(mtp, text, ...)``: teacher-forced verify passes over a token stream
  (as ``tools/trace_trained_moe.py`` builds the MTP trace: at each position the text's token
  is the last token, the NextN block drafts k tokens, the trunk verifies ``[t_p, d_1..d_k]``,
  only t_p is kept). Every predictor names, before the pass, a set of experts per layer; it is
  scored against the union the pass routed, as a ``PredictionScore`` (coverage = needed experts
  named; waste = named experts not needed). Predictors: the draft-route predictor at several
  thresholds, the router on each row's NextN state (top-m per row, uncalibrated), the router
  on the token embedding, the NextN block's own routes through a learned co-occurrence table,
  the history predictor (``runtime.prefetch.HistoryPredictor``, everything routed so far)
  and, as the in-pass baseline, next-layer lookahead (``LookaheadStats`` of the same passes).
* ``tail_skip_quality(exact, lossy, text)``: the same teacher-forced decode through an exact
  engine and a ``route_tail_skip`` engine: top-1 agreement and mean KL(exact ‖ lossy) of the
  next-token distributions, experts read.

``mtp`` is the ``runtime.mtp.Speculation`` that ``runtime.mtp.attach`` built on an engine.
Library code: nothing printed (``bench/bench_mtp.py`` prints).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np
import torch

from ..prefetch import HistoryPredictor, PredictionScore
from ..sampling import Sampler, SamplingParams
from ..mtp.draftroute import DraftRoutePredictor

__all__ = ["acceptance", "route_predictors", "tail_skip_quality"]


def acceptance(mtp: Any, prompts: Sequence[Sequence[int]], params: SamplingParams,
               n_new: int) -> dict[str, Any]:
    """Speculative generation of ``n_new`` tokens from each prompt (fresh context each)."""
    from ..generate import generate
    engine, spec = mtp.engine, mtp.speculator
    s0 = spec.stats.as_dict()
    s0["reached"], s0["taken"] = list(spec.stats.reached), list(spec.stats.taken)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.reset()
        sampler = Sampler(SamplingParams(params.temperature, params.top_k, params.top_p,
                                         params.seed + i))
        for _ in generate(engine, list(p), sampler, n_new, spec=spec):
            pass
    s1 = spec.stats
    d = {k: getattr(s1, k) - s0[k] for k in ("steps", "drafted", "accepted", "emitted",
                                             "plain_steps")}
    reached = [a - (s0["reached"][i] if i < len(s0["reached"]) else 0)
               for i, a in enumerate(s1.reached)]
    taken = [a - (s0["taken"][i] if i < len(s0["taken"]) else 0) for i, a in enumerate(s1.taken)]
    d["acceptance"] = d["accepted"] / d["drafted"] if d["drafted"] else 0.0
    d["accept_at_depth"] = [t / r if r else 0.0 for t, r in zip(taken, reached)]
    d["accept_given_previous"] = [taken[0] / reached[0] if reached and reached[0] else 0.0] + [
        taken[i] / taken[i - 1] if taken[i - 1] else 0.0 for i in range(1, len(taken))]
    d["tokens_per_step"] = d["emitted"] / d["steps"] if d["steps"] else 0.0
    d["seconds"] = time.perf_counter() - t0
    return d


class _Cooccur:
    """P(trunk layer l uses e | the NextN block routed f): decayed counts, noisy-OR over f."""

    def __init__(self, n_layers: int, n_mtp: int, n_experts: int) -> None:
        self.c = np.full((n_layers, n_mtp, n_experts), 0.05)
        self.n = np.full((n_layers, n_mtp, 1), 1.0)

    def prob(self, mtp_ids: np.ndarray) -> np.ndarray:          # [rows, k] → [n_layers, E]
        p = self.c[:, mtp_ids] / self.n[:, mtp_ids]              # [n, rows, k, E]
        return 1.0 - np.prod(1.0 - p, axis=(1, 2))

    def learn(self, mtp_ids: np.ndarray, used: np.ndarray) -> None:   # used [rows, n, E]
        for r in range(mtp_ids.shape[0]):
            for f in mtp_ids[r]:
                self.c[:, f] += used[r]
                self.n[:, f] += 1.0


def route_predictors(mtp: Any, text: Sequence[int], *, segment: int = 128, warm: int = 8,
                     segments: int = 8, thresholds: Sequence[float] = (0.1, 0.15, 0.2, 0.3),
                     margins: Sequence[int] = (0, 2, 4), tail: str = "attn") -> dict[str, Any]:
    """Coverage and waste of each route predictor on teacher-forced verify passes.
    ``mtp`` must draft (``mtp=K``) on an engine with next-layer lookahead on
    (``lookahead=True``); ``tail``: how the last row's NextN state is made (``"attn"``, as the
    runtime does, or ``"hidden"``: the full block)."""
    engine, spec, hook = mtp.engine, mtp.speculator, mtp.routing
    cfg = engine.config
    K = spec.fixed or 2
    pred = DraftRoutePredictor(engine)
    layers, E, k = pred.layers, cfg.n_experts, cfg.n_expert_used
    n = len(layers)
    hist = HistoryPredictor(n, E)
    co = _Cooccur(n, E, E)
    L = spec.nextn.layer
    scores: dict[str, PredictionScore] = {}
    taps: dict[int, list[np.ndarray]] = {}

    def tap(layer: int, x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor) -> None:
        taps.setdefault(layer, []).append(ids.cpu().numpy())
    hook.taps.append(tap)
    look = engine.runner.lookahead
    emb = engine.trunk.embed
    t0 = time.perf_counter()
    steps = 0
    try:
        for g in range(segments):
            ids = list(text[g * segment:(g + 1) * segment])
            if len(ids) < warm + K + 2:
                break
            engine.reset()
            taps.clear()
            engine.prefill(ids[:warm])
            _commit(taps, layers, ids[:warm], pred, hist, rows=warm)
            for p in range(warm, len(ids) - K - 1):
                last, P = ids[p], engine.pos
                taps.clear()
                logits = spec._draft0(last, P)
                mtp_ids = [taps[L][-1][-1]]
                hns, drafts = [spec.nextn.hidden[-1:]], []
                for i in range(K):
                    d = int(logits[0].argmax())
                    drafts.append(d)
                    mode = "last" if i + 1 < K else tail        # the last row: as the runtime
                    logits = spec.nextn.forward(torch.tensor([d], device=engine.device),
                                                spec.nextn.hidden[-1:], logits=mode)
                    hns.append(spec.nextn.hidden[-1:])
                    mtp_ids.append(taps[L][-1][-1] if mode != "attn" else mtp_ids[-1])
                rows = [last] + drafts
                h = torch.cat(hns)
                named: dict[str, list[set[int]]] = {}
                pr = pred.predict(h, rows)
                for th in thresholds:
                    named[f"draft (calibrated, p>={th:g})"] = [
                        set(np.nonzero(pr[i] >= th)[0].tolist()) for i in range(n)]
                rb, _ = pred.features(h, rows)
                for m in margins:
                    named[f"router on NextN state, top-{k + m}/row"] = [
                        set(np.nonzero((rb[:, i] < k + m).any(0))[0].tolist()) for i in range(n)]
                e = emb.lookup(torch.tensor(rows, device=engine.device), torch.float32)
                erb, _ = pred.features(e, rows)
                named[f"router on token embedding, top-{k + 2}/row"] = [
                    set(np.nonzero((erb[:, i] < k + 2).any(0))[0].tolist()) for i in range(n)]
                cp = co.prob(np.stack(mtp_ids))
                named["NextN block's routes (co-occurrence, p>=0.15)"] = [
                    set(np.nonzero(cp[i] >= 0.15)[0].tolist()) for i in range(n)]
                named[f"history, {2 * k}/layer"] = [set(hist.predict(i, 2 * k))
                                                    for i in range(n)]
                taps.clear()
                la0 = look.score.copy() if look is not None else None
                engine.verify(rows)
                used = np.zeros((len(rows), n, E), bool)
                for i, la in enumerate(layers):
                    r = taps[la][-1]
                    np.put_along_axis(used[:, i], r, True, axis=1)
                    need = set(r.ravel().tolist())
                    for name, sets in named.items():
                        scores.setdefault(name, PredictionScore()).add(sets[i], need)
                if la0 is not None:
                    name = (f"next-layer lookahead, top-{look.margin + k}/row "
                            "(in-pass, one layer ahead)")
                    scores[name] = scores.get(name, PredictionScore()) + (look.score - la0)
                pred.learn(used)
                co.learn(np.stack(mtp_ids), used)
                engine.reset(P + 1)
                spec.nextn.reset(min(spec.nextn.pos, P + 1))
                _commit(taps, layers, [last], pred, hist, rows=1)
                steps += 1
    finally:
        hook.taps.remove(tap)
    out = {name: {"coverage": s.coverage, "waste": s.waste,
                  "named_per_needed": s.predicted_per_needed} for name, s in scores.items()}
    return {"steps": steps, "drafts": K, "seconds": time.perf_counter() - t0,
            "predictors": out}


def _commit(taps: dict[int, list[np.ndarray]], layers: list[int], tokens: list[int],
            pred: DraftRoutePredictor, hist: HistoryPredictor, rows: int) -> None:
    """The committed rows' routes: token memory and history (token-major, layers in order)."""
    if not all(la in taps for la in layers):
        return
    routes = [taps[la][-1] for la in layers]
    for r in range(rows):
        pred.memory.add(int(tokens[r]), np.stack([x[r] for x in routes]))
        for i, x in enumerate(routes):
            hist.observe(i, x[r].tolist())


@torch.inference_mode()
def tail_skip_quality(exact: Any, lossy: Any, text: Sequence[int], *, segment: int = 128,
                      warm: int = 8, segments: int = 4) -> dict[str, Any]:
    """Teacher-forced decode of ``text`` through both engines (one token per window)."""
    agree = n = 0
    kl = 0.0
    b0 = (exact.provider.stats.bytes_read, lossy.provider.stats.bytes_read)
    r0 = (exact.provider.stats.requests, lossy.provider.stats.requests)
    times = [0.0, 0.0]
    for g in range(segments):
        ids = list(text[g * segment:(g + 1) * segment])
        if len(ids) <= warm + 1:
            break
        for e in (exact, lossy):
            e.reset()
            e.prefill(ids[:warm])
        for t in ids[warm:]:
            t0 = time.perf_counter()
            a = exact.decode(t)
            t1 = time.perf_counter()
            b = lossy.decode(t)
            t2 = time.perf_counter()
            times[0] += t1 - t0
            times[1] += t2 - t1
            pa, lb = a.float().log_softmax(-1), b.float().log_softmax(-1)
            kl += float((pa.exp() * (pa - lb)).sum())
            agree += int(a.argmax()) == int(b.argmax())
            n += 1
    return {"positions": n, "top1_agreement": agree / n if n else 0.0,
            "mean_kl": kl / n if n else 0.0,
            "experts_exact": exact.provider.stats.requests - r0[0],
            "experts_lossy": lossy.provider.stats.requests - r0[1],
            "mb_read_exact": (exact.provider.stats.bytes_read - b0[0]) / 1e6,
            "mb_read_lossy": (lossy.provider.stats.bytes_read - b0[1]) / 1e6,
            "decode_s_exact": times[0], "decode_s_lossy": times[1]}
