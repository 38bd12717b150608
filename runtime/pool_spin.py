"""How long the native kernels' idle pool workers spin between a decode step's calls.

Between two native calls of a decode step the Python of the step runs (the router's choice, the
cache's bookkeeping, the attention's glue); a pool worker that is asleep by the next call costs
that call a wake-up. A worker spinning for the next call costs a core, which matters while the
process reads: the I/O threads complete reads and checksum experts on those cores while the
forward pass waits for them. So the pool keeps the kernels' short default spin while anything
can still be read, and spins ``RESIDENT_SPIN_US`` once the RAM tier holds every expert a decode
step routes to and nothing is being read (``TieredProvider.settled``: an uncapped tier after
its warm start). bench/README.md "Engine internals" has the measurement behind both settings.
"""

from __future__ import annotations

import logging
from typing import Any

from . import kernels

__all__ = ["RESIDENT_SPIN_US", "CHECK_EVERY", "PoolSpin"]

log = logging.getLogger(__name__)

#: the pool workers' spin (microseconds) once the tier is settled
RESIDENT_SPIN_US = 500

#: decode steps between two looks at the provider once past the first ones (each look walks its
#: residency once; the first look is at step 1, then 2, 4 and 8, so a short run on a tier
#: preloaded whole spins from its start)
CHECK_EVERY = 16


class PoolSpin:
    """Raises the pool's spin once ``provider.settled()`` (checked at decode steps 1, 2, 4, 8,
    then every ``CHECK_EVERY``, where the provider has the method and the kernels are loaded);
    ``close`` puts the spin back as it was."""

    def __init__(self) -> None:
        self._steps = 0
        self._before: int | None = None           # the spin replaced, while raised

    def step(self, provider: Any) -> None:
        """A decode step ran on ``provider``'s experts."""
        self._steps += 1
        n = self._steps
        if self._before is not None or (n % CHECK_EVERY and n & (n - 1)):
            return
        settled = getattr(provider, "settled", None)
        if settled is None or not settled():
            return
        st = kernels.status()                     # (never builds them, as available() would)
        if not st.get("available"):
            return
        self._before = int(st.get("spin_us", RESIDENT_SPIN_US))
        if self._before < RESIDENT_SPIN_US:
            kernels.set_spin_us(RESIDENT_SPIN_US)
            log.debug("every expert resident, nothing read: pool spin %d us", RESIDENT_SPIN_US)

    def close(self) -> None:
        if self._before is not None and self._before < RESIDENT_SPIN_US:
            kernels.set_spin_us(self._before)
        self._before = None
