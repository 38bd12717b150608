"""Synthetic routing traces with controllable skew, temporal locality and cross-layer correlation.

The process, per token t and layer l (deterministic from ``seed``):

* **skew**: layer l's experts have popularity ∝ rank^-zipf under a per-layer random permutation
  drawn from ``model_seed`` (each layer has its own hot experts, the same in every run of that
  "model"); fresh picks are drawn without replacement from it. ``zipf_spread`` makes layers
  differ: the exponent runs linearly from zipf·(1-spread) at the first layer to zipf·(1+spread);
* **temporal locality**: each of the previous token's k experts at layer l is kept with
  probability ``stickiness`` (a sticky Markov chain); the remaining slots are fresh picks;
* **cross-layer correlation**: with probability ``cross_layer`` a fresh pick follows a fixed random
  link from an expert chosen at layer l-1 for the same token (a routing "path");
* **phases**: every ``phase_tokens`` tokens the permutations are redrawn (a new prompt or topic);
* **drafts**: ``n_draft`` MTP draft routes per row, each expert the main route's with probability
  ``draft_overlap``, otherwise fresh.

Uniform routing (zipf 0, stickiness 0) is what a random-weight model gives; real MoE routers are
skewed and sticky, which is what caches live on. Presets in ``PRESETS``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ...errors import UsageError
from .file import TraceChunk, TraceHeader, TraceWriter

__all__ = ["SyntheticSpec", "PRESETS", "synthetic_header", "synthetic_chunks", "write_synthetic",
           "parse_spec"]

_KEEP = 1e9        # score of a kept expert: always chosen before any fresh pick
_LINK = 1e6        # score of a cross-layer linked expert: chosen before plain fresh picks


@dataclass(frozen=True)
class SyntheticSpec:
    n_layers: int = 16
    n_experts: int = 64
    k: int = 8
    n_tokens: int = 2048
    expert_bytes: int = 4 << 20          # every layer's expert size in bytes
    zipf: float = 1.0                    # popularity exponent over ranks (0 = uniform)
    zipf_spread: float = 0.0             # layers' exponents span zipf·(1 ± spread)
    stickiness: float = 0.5              # P(keep each of the previous token's experts)
    cross_layer: float = 0.0             # P(a fresh pick follows the previous layer's path)
    decode_after: int = 0                # tokens before this one are the prompt: from it on,
    decode_stickiness: float = -1.0      # stickiness is this (< 0: the same as before), and
    reuse: float = 0.0                   # P(a fresh pick is one of the run's earlier experts)
    phase_tokens: int = 0                # hot sets are redrawn every this many tokens (0 = never)
    n_draft: int = 0                     # draft routes per row
    draft_overlap: float = 0.3           # P(a draft expert equals the main route's)
    seed: int = 0                        # the run: which tokens are drawn
    model_seed: int = 0                  # the model: which experts are hot in each layer

    def __post_init__(self) -> None:
        if not (1 <= self.k <= self.n_experts and self.n_layers >= 1 and self.n_tokens >= 0
                and self.expert_bytes >= 1 and self.phase_tokens >= 0 and self.n_draft >= 0):
            raise UsageError(f"inconsistent synthetic trace geometry {self}",
                             fix="need 1 <= k <= n_experts, n_layers >= 1, sizes >= 1")
        if self.decode_after < 0:
            raise UsageError(f"decode_after {self.decode_after} < 0", fix="give a token index >= 0")
        if self.decode_stickiness > 1.0:
            raise UsageError(f"decode_stickiness {self.decode_stickiness} is not a probability",
                             fix="give decode_stickiness in [0, 1] (or < 0: the stickiness)")
        for name in ("stickiness", "cross_layer", "reuse", "draft_overlap"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise UsageError(f"{name} {getattr(self, name)} is not a probability",
                                 fix=f"give {name} in [0, 1]")
        if self.zipf < 0:
            raise UsageError(f"zipf {self.zipf} < 0", fix="give a skew exponent >= 0 (0 = uniform)")
        if not 0.0 <= self.zipf_spread <= 1.0:
            raise UsageError(f"zipf_spread {self.zipf_spread} outside [0, 1]",
                             fix="give a spread in [0, 1]")


#: Named shapes of routing, from none to strong locality. "hot" and "sticky" resemble published
#: MoE routing (a few experts per layer take a large share; consecutive tokens reuse experts).
PRESETS: dict[str, dict[str, float | int]] = {
    "uniform": dict(zipf=0.0, stickiness=0.0),                      # random-weight model
    "diffuse": dict(zipf=0.5, stickiness=0.15, cross_layer=0.1),    # fine-grained, spread routing
    "sticky": dict(zipf=0.3, stickiness=0.6, cross_layer=0.2),      # little skew, strong reuse
    "hot": dict(zipf=1.1, stickiness=0.4, cross_layer=0.3),         # skewed and sticky
    "drift": dict(zipf=1.0, stickiness=0.4, cross_layer=0.3, phase_tokens=256),   # topic changes
    "mixed": dict(zipf=0.9, zipf_spread=0.9, stickiness=0.45, cross_layer=0.3),  # layers differ
}


def parse_spec(text: str, **base: int | float) -> SyntheticSpec:
    """``"hot,n_tokens=4096,k=8"``: an optional preset name then ``field=value`` overrides."""
    fields = {f.name: f.type for f in dataclasses.fields(SyntheticSpec)}
    kw: dict[str, int | float] = dict(base)
    for i, item in enumerate(p.strip() for p in text.split(",") if p.strip()):
        if "=" not in item:
            if i or item not in PRESETS:
                raise UsageError(f"unknown synthetic preset {item!r}",
                                 fix=f"start with one of {', '.join(PRESETS)} or give field=value")
            kw.update(PRESETS[item])
            continue
        name, _, value = item.partition("=")
        name = name.strip().replace("-", "_")
        if name not in fields:
            raise UsageError(f"unknown synthetic trace field {name!r}",
                             fix=f"fields are {', '.join(fields)}")
        try:
            kw[name] = float(value) if fields[name] == "float" else int(float(value))
        except ValueError:
            raise UsageError(f"{name}={value!r} is not a number", fix="give a number") from None
    return SyntheticSpec(**kw)  # type: ignore[arg-type]


def synthetic_header(spec: SyntheticSpec) -> TraceHeader:
    return TraceHeader(spec.n_layers, spec.n_experts, spec.k, (spec.expert_bytes,) * spec.n_layers,
                       n_draft=spec.n_draft,
                       meta={"generator": "expertfs.synthetic", "spec": dataclasses.asdict(spec)})


def synthetic_chunks(spec: SyntheticSpec, tokens_per_chunk: int = 256,
                     popularity: np.ndarray | None = None) -> Iterator[TraceChunk]:
    """The trace as chunks of whole tokens, rows token-major (decode order). Bounded memory.
    ``popularity``: each layer's expert weights ([n_layers, n_experts], positive; a store's
    learned usage) to draw fresh picks from instead of the spec's Zipf ranks (no phases then).
    From token ``decode_after`` on (the decode after a prompt), a previous expert is kept with
    probability ``decode_stickiness`` (where given), and each pick not kept is, with probability
    ``reuse``, one of the experts the run routed to at that layer before (in proportion to how
    often), else a fresh one."""
    s = spec
    L, E, k = s.n_layers, s.n_experts, s.k
    model = np.random.default_rng([s.model_seed, 0x5EED])
    rng = np.random.default_rng(s.seed)
    spread = np.linspace(1 - s.zipf_spread, 1 + s.zipf_spread, L) if L > 1 else np.ones(1)
    base = -s.zipf * spread[:, None] * np.log(np.arange(1, E + 1))   # [L, E] log-popularity by rank
    logp = np.empty((L, E))
    for layer in range(L):
        logp[layer, model.permutation(E)] = base[layer]
    if popularity is not None:
        if popularity.shape != (L, E) or not np.all(popularity > 0):
            raise UsageError(f"popularity of shape {popularity.shape} for {L} layers x {E} experts",
                             fix="give one positive weight per layer and expert")
        logp = np.log(popularity)
        s = dataclasses.replace(s, phase_tokens=0)
    link = np.stack([model.permutation(E) for _ in range(L)])    # [L, E] layer l-1 expert -> l
    prev = None                                                  # [L, k] previous token's route
    routed = np.zeros((L, E)) if s.reuse else None               # the run's routes so far
    for t0 in range(0, s.n_tokens, tokens_per_chunk):
        n = min(tokens_per_chunk, s.n_tokens - t0)
        experts = np.empty((n, L, k), np.uint16)
        for i in range(n):
            t = t0 + i
            if s.phase_tokens and t and t % s.phase_tokens == 0:    # a new topic: new hot sets
                for layer in range(L):
                    logp[layer, rng.permutation(E)] = base[layer]
            score = logp + rng.gumbel(size=(L, E))               # fresh ranking, Gumbel-top-k
            decoding = t >= s.decode_after
            keep = rng.random((L, k)) < (s.decode_stickiness if decoding and s.decode_stickiness >= 0
                                         else s.stickiness)
            follow = rng.random((L, k)) < s.cross_layer
            route = np.empty((L, k), np.int64)
            for layer in range(L):
                sc = score[layer]
                if layer and s.cross_layer:
                    sc[link[layer, route[layer - 1][follow[layer]]]] += _LINK
                if prev is not None:
                    sc[prev[layer][keep[layer]]] = _KEEP
                if routed is not None and decoding:
                    _reuse(sc, routed[layer], k, s.reuse, rng)
                route[layer] = np.argpartition(-sc, k - 1)[:k]
            experts[i] = route
            if routed is not None:
                np.add.at(routed, (np.arange(L)[:, None], route), 1)
            prev = route
        yield _chunk(s, t0, experts, rng, logp)


def _reuse(sc: np.ndarray, routed: np.ndarray, k: int, p: float, rng: np.random.Generator) -> None:
    """Mark (``_KEEP``) in one layer's scores ``sc`` the earlier experts a token reuses: of its
    picks not kept already, each with probability ``p``, drawn without replacement from those
    the run routed to before (``routed``: counts), in proportion to the counts."""
    free = k - int(np.count_nonzero(sc >= _KEEP))
    cand = (routed > 0) & (sc < _KEEP)
    m = min(int(rng.binomial(free, p)) if free > 0 else 0, int(np.count_nonzero(cand)))
    if m:
        score = np.full(routed.shape, -np.inf)
        score[cand] = np.log(routed[cand]) + rng.gumbel(size=int(np.count_nonzero(cand)))
        sc[np.argpartition(-score, m - 1)[:m]] = _KEEP


def _chunk(s: SyntheticSpec, t0: int, experts: np.ndarray, rng: np.random.Generator,
           logp: np.ndarray) -> TraceChunk:
    n, L, k = experts.shape
    rows = n * L
    ex = experts.reshape(rows, k)
    w = rng.dirichlet(np.ones(k), size=rows)                    # plausible router weights
    weights = -np.sort(-w, axis=1).astype(np.float16)
    tokens = np.repeat(np.arange(t0, t0 + n, dtype=np.uint32), L)
    layers = np.tile(np.arange(L, dtype=np.uint16), n)
    if not s.n_draft:
        return TraceChunk(tokens, layers, np.zeros(rows, np.uint8), ex, weights, None, None)
    D = s.n_draft
    lp = np.tile(logp, (n, 1))                                  # [rows, E] layer of each row
    dex = np.empty((rows, D, k), np.uint16)
    for d in range(D):
        sc = lp + rng.gumbel(size=lp.shape)
        keep = rng.random((rows, k)) < s.draft_overlap
        r_idx = np.repeat(np.arange(rows), k).reshape(rows, k)
        sc[r_idx[keep], ex[keep]] = _KEEP
        dex[:, d] = np.argpartition(-sc, k - 1, axis=1)[:, :k]
    dw = -np.sort(-rng.dirichlet(np.ones(k), size=(rows, D)), axis=2)
    return TraceChunk(tokens, layers, np.full(rows, D, np.uint8), ex, weights, dex,
                      dw.astype(np.float16))


def write_synthetic(path: str | os.PathLike[str], spec: SyntheticSpec, *,
                    chunk_rows: int = 4096) -> TraceHeader:
    """Generate ``spec`` and write it as a trace file; returns its header."""
    h = synthetic_header(spec)
    with TraceWriter(path, h, chunk_rows=chunk_rows) as w:
        for c in synthetic_chunks(spec):
            w.add_chunk(c)
    return h
