"""Policies by name, for the CLI and benchmarks: ``make_factory("wlfu@256/layer", ...)``.

Grammar: ``BASE[@HALF_LIFE][/layer]``. BASE is ``lru``, ``lfu`` (no decay), ``lfud`` (LFU with
exponential decay), ``arc`` or ``wlfu`` (window LFU: latest route per layer by recency, the rest
by decayed frequency); ``@HALF_LIFE`` (tokens, ``lfud``/``wlfu``, default ``DEFAULT_HALF_LIFE``);
``/layer`` gives each layer an even share of the slots instead of one global pool.
``DEFAULT_POLICY`` was chosen by measurement against the Belady bound
(``bench/bench_cache_policies.py``; figures in bench/README.md): ``wlfu`` in one global pool beat
LRU at every capacity of the hot, sticky, mixed and diffuse synthetic traces, ties it when the
hot set is replaced every 256 tokens, is about even with the per-layer variant when layers are
alike and ahead of it when they differ, and still hits in a tier smaller than one token's
routes, where LRU and ARC never do.
"""

from __future__ import annotations

from collections.abc import Callable

from ...errors import UsageError
from .base import LRU, DecayLFU, Key, Policy
from .arc import ARC
from .layer import PerLayer
from .window import WindowLFU

__all__ = ["BASES", "DEFAULT_POLICY", "DEFAULT_HALF_LIFE", "ALL_POLICIES", "make_factory",
           "parse_policies"]

DEFAULT_HALF_LIFE = 256.0
DEFAULT_POLICY = "wlfu"
BASES = ("lru", "lfu", "lfud", "arc", "wlfu")
#: What ``--policies all`` runs.
ALL_POLICIES = ("lru", "lru/layer", "lfu", "lfud", "arc", "wlfu", "wlfu/layer")

_FIX = ("policies are lru, lfu, lfud[@HALF_LIFE], arc, wlfu[@HALF_LIFE] (or 'default', "
        f"which is {DEFAULT_POLICY}), each optionally with /layer")

Factory = Callable[[int], Policy]


def _base(name: str, window: int) -> Factory:
    base, at, arg = name.partition("@")
    if base not in BASES or (at and base not in ("lfud", "wlfu")):
        raise UsageError(f"unknown cache policy {name!r}", fix=_FIX)
    if base == "lru":
        return LRU
    if base == "arc":
        return ARC
    if base == "lfu":
        return lambda c: DecayLFU(c, None)
    try:
        h = float(arg) if at else DEFAULT_HALF_LIFE
    except ValueError:
        raise UsageError(f"half-life {arg!r} in {name!r} is not a number", fix=_FIX) from None
    if not h > 0:
        raise UsageError(f"half-life {h} in {name!r}", fix="give a half-life > 0 tokens")
    if base == "lfud":
        return lambda c: DecayLFU(c, h)
    return lambda c: WindowLFU(c, window, h)


def make_factory(spec: str, *, n_layers: int, route_width: int, layer_of: Callable[[Key], int]
                 ) -> Factory:
    """A function ``slots -> Policy`` for one policy name (see the module docstring).

    ``route_width``: experts one layer needs at once (k, or more with draft routes); it sizes
    ``wlfu``'s window to one route per layer (per layer: one route).
    """
    name, slash, scope = spec.strip().lower().partition("/")
    if name == "default":
        name = DEFAULT_POLICY
    if slash and scope != "layer":
        raise UsageError(f"unknown policy scope {scope!r} in {spec!r}", fix=_FIX)
    if not slash:
        return _base(name, n_layers * route_width)
    base = _base(name, route_width)
    return lambda c: PerLayer(c, base, layer_of, n_layers, need=route_width)


def parse_policies(text: str) -> list[str]:
    """``"all"`` or a comma-separated list, validated (names only; factories need the geometry)."""
    names = list(ALL_POLICIES) if text.strip() == "all" else [
        p.strip().lower() for p in text.split(",") if p.strip()]
    if not names:
        raise UsageError("no cache policy given", fix=_FIX)
    for n in names:
        make_factory(n, n_layers=1, route_width=1, layer_of=lambda k: 0)
    return names
