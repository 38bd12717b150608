"""The VRAM budget of a CUDA run, and out-of-device-memory as a typed error.

Without ``--vram`` a CUDA run sizes its VRAM expert tier from what the device has free
(``torch.cuda.mem_get_info``) less what the rest of the run will take there (figured by the
caller, ``expertfs run``, from the store's geometry): the trunk (every matrix in the compute
dtype: the upper bound of ``--trunk auto``), the KV cache at ``--ctx``, the workspace of a
decode step with the dequantised temporaries of ``k`` experts, and a reserve for the allocator's fragmentation and the libraries' own buffers. The tier never
exceeds every expert's slot, and it is 0 when less than one layer's ``k`` slots would fit.

``device_memory(what, fix)`` wraps a device allocation site (the VRAM slab, the trunk upload,
the forward pass where the KV cache grows): torch's out-of-memory error becomes a
:class:`DeviceMemoryError` naming what did not fit and the flag that fixes it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from expertfs.errors import UsageError
from expertfs.units import fmt_bytes

__all__ = ["DeviceMemoryError", "VramPlan", "plan_vram", "device_memory", "RESERVE_MIN",
           "RESERVE_FRACTION", "KV_FIX", "TRUNK_FIX"]

log = logging.getLogger(__name__)

RESERVE_MIN = 512 << 20          # kept free on the device whatever its size
RESERVE_FRACTION = 1 / 20        # ... or this share of it, whichever is larger
KV_FIX = "give a smaller --ctx, or a smaller --vram (the expert tier takes device memory first)"
TRUNK_FIX = "give a smaller --vram (the expert tier is allocated first), or --trunk quant"


class DeviceMemoryError(UsageError):
    """Device memory ran out (or would): what did not fit, and the flag that fixes it."""


def _is_oom(e: BaseException) -> bool:
    oom = getattr(torch, "OutOfMemoryError", None)
    if oom is not None and isinstance(e, oom):
        return True
    return isinstance(e, RuntimeError) and "out of memory" in str(e).lower()


@contextmanager
def device_memory(what: str, *, fix: str, nbytes: int | None = None) -> Iterator[None]:
    """Run an allocation of ``what`` on the device; an out-of-memory error becomes a
    :class:`DeviceMemoryError` naming it and ``fix``."""
    try:
        yield
    except (RuntimeError, MemoryError) as e:
        if not _is_oom(e):
            raise
        size = f" ({fmt_bytes(nbytes)})" if nbytes else ""
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DeviceMemoryError(f"out of device memory for {what}{size}: {first}",
                                fix=fix) from e


@dataclass(frozen=True)
class VramPlan:
    """What the device has and what a run will take there, in bytes."""

    free: int
    total: int
    trunk: int
    kv: int
    workspace: int
    reserve: int
    experts: int            # every decode expert in its slot: more VRAM is never of use
    min_tier: int           # less than this (one layer's k slots) is no tier

    @property
    def tier(self) -> int:
        room = self.free - self.trunk - self.kv - self.workspace - self.reserve
        room = min(room, self.experts)
        return room if room >= self.min_tier else 0

    def describe(self) -> str:
        f = fmt_bytes
        return (f"VRAM tier {f(self.tier)}: {f(self.free)} free of {f(self.total)}, less trunk "
                f"{f(self.trunk)}, KV cache {f(self.kv)}, workspace {f(self.workspace)}, "
                f"reserve {f(self.reserve)} (all experts {f(self.experts)}; --vram sets it)")


def plan_vram(*, trunk: int, kv: int, workspace: int, experts: int, min_tier: int,
              device: str | torch.device = "cuda",
              mem_get_info: Callable[[Any], tuple[int, int]] | None = None) -> VramPlan:
    """The default VRAM tier on ``device`` beside a run that needs ``trunk``, ``kv`` and
    ``workspace`` bytes there (``expertfs run`` figures them from the store's geometry);
    ``mem_get_info`` (free, total) defaults to ``torch.cuda.mem_get_info``. Logged at INFO."""
    get = mem_get_info if mem_get_info is not None else torch.cuda.mem_get_info
    free, total = (int(x) for x in get(torch.device(device)))
    reserve = max(RESERVE_MIN, int(total * RESERVE_FRACTION))
    plan = VramPlan(free=free, total=total, trunk=trunk, kv=kv, workspace=workspace,
                    reserve=reserve, experts=experts, min_tier=min_tier)
    log.info("%s", plan.describe())
    return plan
