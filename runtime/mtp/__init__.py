"""MTP speculative decoding with the model's own NextN block, draft-route expert prefetch, and
the opt-in route tail skip. One concept per module:

``nextn``       the NextN block's forward (llama.cpp's ``graph_mtp``), its own KV cache
``accept``      the acceptance rules: greedy exact match, speculative sampling
``speculative`` ``Speculator``: catch-up, draft, verify, accept, roll back
``gate``        ``UtilityGate``: draft depth from measured acceptance and step costs
``routing``     ``RouterHook``: routing taps and ``--route-tail-skip``
``draftroute``  every layer's verify experts predicted from the drafts, prefetched for the step
``speculation`` ``attach(engine, MTPOptions)``: the above built on an open ``Engine``

The engine does not import this package: ``attach`` returns a ``Speculation`` whose
``speculator`` ``runtime.generate`` and the server's ``Session`` run, and whose ``report()``
the CLI adds to ``engine.stats()``. Offline evaluations are ``runtime.eval.mtp``.
"""

from __future__ import annotations

from .nextn import NextN
from .routing import RouterHook
from .speculation import MTPOptions, Speculation, attach
from .speculative import DraftState, Speculator, SpecStats

__all__ = ["attach", "MTPOptions", "Speculation", "NextN", "Speculator", "SpecStats",
           "DraftState", "RouterHook"]
