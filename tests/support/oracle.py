"""How the oracle tests run expertfs on a store: the uncached provider, float32, the torch
paths unless asked otherwise, logits of every position."""

from __future__ import annotations

import numpy as np


def engine_logits(store: str, tokens, device: str = "cpu", **opts) -> np.ndarray:
    """float32 logits ``[len(tokens), n_vocab]`` of ``tokens`` from a fresh context."""
    from expertfs.runtime.engine import Engine, EngineOptions
    from expertfs.runtime.experts.direct import DirectProvider
    from expertfs.store.reader import Store
    opts = {"device": device, "dtype": "float32", "fused": "off", **opts}
    with Store.open(store) as st:
        eng = Engine(st, DirectProvider(st, opts["device"]), EngineOptions(**opts))
        try:
            return eng.logits(tokens).numpy()
        finally:
            eng.close()
