"""Counting the places a forward pass copies a tensor's value to the host.

On a GPU each such copy (``.item()``, ``.tolist()``, ``int(t)``, ``.cpu()``, ...) makes the host
wait for everything queued before it: a *host sync*. ``torch.cuda.set_sync_debug_mode`` finds
them on a GPU; :class:`HostSyncCounter` finds the same call sites on any device, the CPU
included, by watching the torch calls that read a tensor's value into Python or host memory
(and the factories that copy host data to a device, and ops whose output size depends on the
data), so the decode path's syncs per token can be checked without a GPU::

    with HostSyncCounter() as c:
        engine.decode(tok)
    c.total, c.by_site()      # how many, and where (file:function of the caller)

On the CPU nothing here synchronises anything: the counter tells what *would* sync were the
tensors on a GPU. Tensors that live on the host by design (a numpy mirror, a CPU generator)
never pass through these calls in the decode path.
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

from torch.overrides import TorchFunctionMode

__all__ = ["HostSyncCounter", "SYNC_CALLS"]

#: torch calls that read a tensor's value on the host, copy it there, or size their output
#: from its data (each a sync when the tensor lives on a GPU)
SYNC_CALLS = frozenset({"item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__",
                        "__index__", "bincount", "nonzero", "unique", "masked_select",
                        "repeat_interleave"})
#: factories that copy host data into a new tensor (a host-to-device copy when given a device)
HOST_DATA = frozenset({"tensor", "as_tensor"})


class HostSyncCounter(TorchFunctionMode):
    """Counts :data:`SYNC_CALLS` and ``torch.tensor``/``as_tensor`` given a device: with
    ``device="any"`` (for a CPU run) every one that names a device, else those naming
    ``device`` or any non-CPU device. (``.to(device)`` is not counted: on a CPU run it cannot
    tell a device-to-host copy from a no-op.) ``sites`` counts them by (call, caller)."""

    def __init__(self, device: str = "any") -> None:
        super().__init__()
        self.device = device
        self.sites: Counter[tuple[str, str]] = Counter()
        self._depth = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self._depth == 0:
            name = getattr(func, "__name__", "")
            if self._counts(name, args, kwargs):
                f = sys._getframe(1)
                while f is not None and f.f_code.co_filename.endswith(("overrides.py",
                                                                       "_tensor.py")):
                    f = f.f_back
                where = (f"{f.f_code.co_filename.rsplit('/', 1)[-1]}:{f.f_code.co_name}"
                         if f is not None else "?")
                self.sites[(name, where)] += 1
        self._depth += 1
        try:
            return func(*args, **kwargs)
        finally:
            self._depth -= 1

    def _counts(self, name: str, args: Any, kwargs: dict[str, Any]) -> bool:
        if name in SYNC_CALLS:
            return True
        if name in HOST_DATA:
            dev = kwargs.get("device")
            return dev is not None and (self.device == "any" or str(dev) == self.device
                                        or str(dev).split(":")[0] not in ("cpu", ""))
        return False

    @property
    def total(self) -> int:
        return sum(self.sites.values())

    def by_site(self) -> dict[str, int]:
        """``{"call @ file:function": count}``, most first."""
        return {f"{n} @ {w}": c for (n, w), c in self.sites.most_common()}

    def reset(self) -> None:
        self.sites.clear()
