"""The utility gate: how deep to draft, when to stop a draft chain, and which predicted experts
are worth a read — from what this run has measured, not from constants.

**Depth.** A step with k drafts emits ``E(k) = 1 + a_1 + a_1 a_2 + ... + a_1..a_k`` tokens on
average (``a_i``: the measured rate at which draft i is accepted once drafts 1..i-1 were) and
costs ``C(k)`` seconds (the NextN rows plus a verify pass over k+1 rows: an EMA of the measured
step time per k; an unmeasured k is extrapolated linearly from the measured ones). The gate
runs the k with the best ``E(k) / C(k)`` (tokens per second), 0 = plain decoding, and now and
then (every ``explore`` steps) a neighbouring depth so the estimates stay current. This is
Colibri's value(k) = E(k)/cost(k) gate with both sides measured online; the cost side sees the
extra expert reads of every verify row (the Cascade effect) because it is wall time.

**Chain stop.** After draft i, one more draft is worth it when its expected gain (the chance
that drafts 1..i+1 all pass, from the draft head's own confidences scaled by the measured
acceptance) per extra second is at least the current tokens per second.

**What to fetch.** A predicted expert that the pass needs with probability p saves about one
read's stall; one it does not need costs a read that competes with demand reads in
proportion to how busy the disk is (ρ: measured read time per step ÷ step time). Fetching pays
when ``p > ρ / (1 + ρ)``, clipped to [``min_threshold``, 0.5]; until ρ is measured the
threshold is ``DEFAULT_THRESHOLD``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["UtilityGate"]


class UtilityGate:
    def __init__(self, max_depth: int = 4, *, prior_accept: float = 0.5, explore: int = 16,
                 ema: float = 0.2, min_threshold: float = 0.1) -> None:
        self.max_depth = max(1, int(max_depth))
        self.explore, self.alpha = max(2, explore), ema
        self.min_threshold = min_threshold
        n = self.max_depth + 1
        self.prior_accept = prior_accept
        self.reached = [0.0] * n                  # drafts i verified after 1..i-1 passed
        self.taken = [0.0] * n                    # ... and accepted
        self.cost: list[float | None] = [None] * n    # seconds per step with k drafts
        self.steps = 0
        self.last_depth = 1
        self.rho: float | None = None             # disk busy share (set by the prefetcher)
        self._conf_sum, self._conf_n = 0.0, 0     # the draft head's confidences seen

    # --- estimates -------------------------------------------------------------------------
    def accept(self, i: int) -> float:
        """a_i: P(draft i accepted | drafts before it accepted), i = 1..max_depth; shrunk (two
        pseudo-counts) toward a_{i-1}, so an unmeasured depth looks like the one before."""
        prior = self.prior_accept if i <= 1 else self.accept(i - 1)
        return (self.taken[i] + 2.0 * prior) / (self.reached[i] + 2.0)

    def expected_tokens(self, k: int) -> float:
        e, run = 1.0, 1.0
        for i in range(1, k + 1):
            run *= self.accept(i)
            e += run
        return e

    def step_cost(self, k: int) -> float | None:
        c = self.cost[k]
        if c is not None:
            return c
        known = [(j, v) for j, v in enumerate(self.cost) if v is not None]
        if not known:
            return None
        if len(known) == 1:                       # assume each row costs half a plain step
            j, v = known[0]
            base = v / (1 + 0.5 * j)
            return base * (1 + 0.5 * k)
        (j0, v0), (j1, v1) = known[0], known[-1]
        slope = max(0.0, (v1 - v0) / (j1 - j0))
        return v1 + slope * (k - j1) if k > j1 else v0 + slope * (k - j0)

    def value(self, k: int) -> float | None:
        c = self.step_cost(k)
        return None if c is None or c <= 0 else self.expected_tokens(k) / c

    # --- the Speculator's questions ----------------------------------------------------------
    def depth(self, limit: int) -> int:
        top = max(0, min(self.max_depth, limit - 1))
        if top >= 1 and self.cost[1] is None:
            best = 1                               # measure a speculative step first
        elif self.cost[0] is None:
            best = 0                               # then a plain one
        else:
            best = max((self.value(k) or 0.0, -k) for k in range(top + 1))[1] * -1
        if top and self.steps % self.explore == self.explore - 1:
            best = best + 1 if best < top else best - 1
        self.last_depth = best
        return best

    def more(self, i: int, chain_conf: float, confs: list[float]) -> bool:
        """Draft i was just made (draft confidences ``confs``); draft another?"""
        if i >= self.last_depth:
            return False
        scale = self.accept(1) / max(1e-6, self._mean_conf())
        p_chain = 1.0
        for c in confs:
            p_chain *= min(1.0, c * scale)
        p_next = p_chain * self.accept(i + 1)
        c_i, c_n = self.step_cost(i), self.step_cost(i + 1)
        if c_i is None or c_n is None or c_n <= c_i:
            return True
        rate = self.expected_tokens(i) / c_i
        return p_next / (c_n - c_i) >= rate

    def _mean_conf(self) -> float:
        return self._conf_sum / self._conf_n if self._conf_n else 0.5

    def update(self, k: int, accepted: int, mtp_s: float, verify_s: float) -> None:
        """A step with k drafts, ``accepted`` of them accepted, took these times."""
        self.steps += 1
        for i in range(1, k + 1):
            if i > accepted + 1:
                break
            self.reached[i] += 1
            self.taken[i] += i <= accepted
        t = mtp_s + verify_s
        c = self.cost[k]
        self.cost[k] = t if c is None else (1 - self.alpha) * c + self.alpha * t

    def note_confidence(self, conf: float) -> None:
        """The draft head's probability of a first draft (calibrates ``more``)."""
        self._conf_sum += conf
        self._conf_n += 1

    def note_stall(self, stall_s: float, step_s: float) -> None:
        """Seconds of a step spent waiting on storage: the disk's busy share ρ (an EMA)."""
        if step_s <= 0:
            return
        r = min(1.0, max(0.0, stall_s / step_s))
        self.rho = r if self.rho is None else (1 - self.alpha) * self.rho + self.alpha * r

    # --- what to fetch -------------------------------------------------------------------------
    def fetch_threshold(self) -> float:
        from .draftroute import DEFAULT_THRESHOLD
        if self.rho is None:
            return DEFAULT_THRESHOLD
        return min(0.5, max(self.min_threshold, self.rho / (1.0 + self.rho)))

    def as_dict(self) -> dict[str, Any]:
        return {"max_depth": self.max_depth, "last_depth": self.last_depth,
                "accept": [round(self.accept(i), 4) for i in range(1, self.max_depth + 1)],
                "step_s": [None if c is None else round(c, 5) for c in self.cost],
                "tokens_per_s": [None if self.value(k) is None else round(self.value(k), 2)
                                 for k in range(self.max_depth + 1)],
                "fetch_threshold": round(self.fetch_threshold(), 4),
                "disk_busy": None if self.rho is None else round(self.rho, 4)}
