"""``ForwardObserver``: what ``Engine.add_observer`` takes (``runtime.mtp``'s draft state is one)."""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["ForwardObserver"]


class ForwardObserver(Protocol):
    """What ``Engine.add_observer`` takes: told of every forward and every reset."""

    def observe(self, tokens: list[int], hidden: torch.Tensor) -> None:
        """``tokens`` ran, ending at the engine's position; ``hidden [T, n_embd]``: the trunk's
        last hidden state of each (after the output norm)."""

    def reset(self, pos: int) -> None:
        """The engine's KV cache now ends at ``pos``."""
