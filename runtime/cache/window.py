"""The prompt window: a prompt's reads through a few spare slots of a RAM tier that holds every
expert, so the first token does not wait for the tier's fresh memory.

Where the RAM tier has a slot for every expert (no cap, or a cap above the model), the warm
start seeds each expert into a slot of its own and queues its read; it is held until the first
logits, and the prompt's demand for a queued expert promotes that read into the expert's own
slot. Each such read lands in memory nobody has touched yet, and the kernel clears every fresh
page inside the read's system call, on the cores the prompt computes on: on a virtual machine
whose host backs guest memory lazily that costs more than the read (bench/README.md "The prompt
window"), and a prompt that touches a third of the experts of a 7 GB model waits for gigabytes
of it.

While the warm start is held, such an expert is read instead into one of the tier's spare slots
(the slots beyond one per expert: ``sizing.plan_slots`` keeps up to ``sizing.window_slots`` of
them, and ``runtime.plan.host.run_host_budget`` sizes ``run``'s tier with them where the limit
leaves the room), used for its get and given back at the layer's release, its own read left
queued for the warm start. The spare slots are faulted in once and then reused, as a capped
tier's are, and the prompt's batches ask for at most as many experts at a time as there are
spare slots (``TieredProvider.max_experts_per_get``). The weights are the same bytes; the warm
start reads the tier full in the background after the first logits, and the decode promotes
what it needs first, as before.
The fresh memory is still touched, later: the decode reads again, into their own slots, the
experts the prompt used, so the first token comes sooner and the decode's start is slower: on
large experts and a slow first touch a net gain in the first token, on small ones mostly a
slower start (bench/README.md). So it is opt-in: ``EXPERTFS_PROMPT_WINDOW=1``
(``sizing.WINDOW_ENV``; without it there are no spare slots and no window).
"""

from __future__ import annotations

from typing import Any

from ..io.scheduler import Priority
from .entry import Entry, State
from .slots import SlotPool

__all__ = ["PromptWindow", "prompt_window"]


class PromptWindow:
    """The spare slots of a SlotPool holding every expert, lent to the prompt's reads while the
    loader holds the warm start (``open``). ``take`` and ``give_back`` are TierCache's."""

    def __init__(self, host: Any, residency: Any, loader: Any, n_spare: int) -> None:
        self.host, self.res, self.loader = host, residency, loader
        self.n_spare = n_spare
        self.taken: set[Entry] = set()           # window entries not yet given back

    @property
    def open(self) -> bool:
        return self.loader.held and self.n_spare > 0

    def room(self) -> int:
        """Window slots free now (0 when closed)."""
        return max(0, self.n_spare - len(self.taken)) if self.open else 0

    def take(self, e: Entry) -> Entry | None:
        """For the tier's entry ``e`` (LOADING): a window entry for the same expert, its demand
        read issued into a spare slot; None (promote ``e`` as before) when the window is closed,
        ``e``'s read was issued already, or no spare slot is free."""
        if not self.room() or self.loader.started(e):
            return None
        slot = self.host.alloc(host_write=True)
        if slot is None:
            return None
        w = Entry(e.key, e.layer, e.expert, e.extent, host_slot=slot, staging=True, lent=True)
        self.taken.add(w)
        self.loader.issue(w, Priority.DEMAND)
        return w

    def give_back(self, e: Entry) -> None:
        """The window entry's get is over: its read's outcome taken, its slot free again."""
        if e.state is State.LOADING:
            self.res.settle(e)
        self.taken.discard(e)
        if e.host_slot >= 0:
            self.host.free(e.host_slot)
        e.host_slot, e.state, e.weights, e.future = -1, State.ABSENT, None, None

    def abandon(self, held: dict[int, list[Entry]]) -> None:
        """A failed acquire: give back the window entries it took (those no layer holds)."""
        kept = {e for es in held.values() for e in es}
        for w in [w for w in self.taken if w not in kept]:
            self.give_back(w)


def prompt_window(cache: Any) -> PromptWindow:
    """The prompt window of a ``TierCache``: its spare slots where its RAM tier is a slab (not
    the mapped file) with slots beyond one per expert, on the CPU, with no device tier and no
    staged prefetch slots; elsewhere a window of none, never open."""
    slots = cache.slots
    spare = slots.host - sum(cache.geo.experts)         # ``plan_slots``: at most window_slots
    if (spare <= 0 or not isinstance(cache.host, SlotPool) or cache.dev is not None
            or cache.copier.cuda or slots.prefetch):
        spare = 0
    return PromptWindow(cache.host, cache.residency, cache.loader, spare)
