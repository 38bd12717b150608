"""Per-layer quotas: one sub-policy per layer, each with a fixed share of the slots.

The alternative to one global pool (any policy given every slot): a layer can never take slots
from another, so a layer with diffuse routing cannot starve a layer with a tight hot set (and
vice versa). ``quotas`` default to an even split; ``layer_of(key)`` says which layer a key is in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from ...errors import UsageError
from .base import Key, Policy

__all__ = ["PerLayer", "even_quotas"]


def even_quotas(capacity: int, n_layers: int) -> list[int]:
    """``capacity`` slots split as evenly as possible, the remainder to the first layers."""
    q, r = divmod(capacity, n_layers)
    return [q + (i < r) for i in range(n_layers)]


class PerLayer(Policy):
    def __init__(self, capacity: int, factory: Callable[[int], Policy], layer_of: Callable[[Key], int],
                 n_layers: int, quotas: Sequence[int] | None = None, need: int = 1) -> None:
        """``need``: slots a layer uses at once (a token's k), which every quota must hold."""
        super().__init__(capacity)
        quotas = list(quotas) if quotas is not None else even_quotas(capacity, n_layers)
        if len(quotas) != n_layers or sum(quotas) != capacity or min(quotas) < 1:
            raise UsageError(f"per-layer quotas {quotas} do not split {capacity} slots over "
                             f"{n_layers} layers", fix="give at least one slot per layer")
        if min(quotas) < need:
            raise UsageError(f"a per-layer policy gives a layer {min(quotas)} of the tier's "
                             f"{capacity} slots, and a token uses {need} of a layer at once",
                             fix=f"give the tier at least {need * n_layers} slots, or a global "
                                 "policy (without /layer)")
        self.layer_of = layer_of
        self.subs = [factory(q) for q in quotas]
        self.name = f"{self.subs[0].name}/layer"
        self.pinned = self.pinned              # one set shared with every sub-policy

    @property                                  # type: ignore[override]
    def pinned(self) -> set[Key]:
        return self._pinned

    @pinned.setter
    def pinned(self, keys: set[Key]) -> None:
        self._pinned = keys
        for s in getattr(self, "subs", ()):
            s.pinned = keys

    def access(self, key: Key, now: float) -> bool:
        return self.subs[self.layer_of(key)].access(key, now)

    def observe(self, key: Key, now: float) -> None:
        self.subs[self.layer_of(key)].observe(key, now)

    def victim(self, incoming: Key) -> Key | None:
        return self.subs[self.layer_of(incoming)].victim(incoming)

    def on_insert(self, key: Key, now: float) -> None:
        self.subs[self.layer_of(key)].on_insert(key, now)

    def on_evict(self, key: Key) -> None:
        self.subs[self.layer_of(key)].on_evict(key)

    def seed(self, rates: Mapping[Key, float], now: float) -> list[Key]:
        per: list[dict[Key, float]] = [{} for _ in self.subs]
        for key, r in rates.items():
            per[self.layer_of(key)][key] = r
        return [k for s, r in zip(self.subs, per) for k in s.seed(r, now)]

    def __contains__(self, key: object) -> bool:
        return key in self.subs[self.layer_of(key)]  # type: ignore[arg-type]

    def __len__(self) -> int:
        return sum(len(s) for s in self.subs)
