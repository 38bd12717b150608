"""llama.cpp (llama-cpp-python) opened the way expertfs's comparisons need it.

``Llama(..., use_extra_bufts=False)`` is silently ignored by llama-cpp-python 0.3.36's
high-level constructor (it takes ``**kwargs``): the CPU backend then repacks Q4_0/Q4_K expert
weights into anonymous memory, which reads the whole model into RAM and is OOM-killed under a
memory cap. ``open_llama(path, repack=False)`` sets the real ``llama_model_params`` field, so
the peer is a true mmap baseline (llama.cpp's ``--no-repack``); ``repack=True`` is llama.cpp's
default, its fastest resident configuration.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

__all__ = ["open_llama"]


@contextlib.contextmanager
def _model_params(repack: bool) -> Iterator[None]:
    import llama_cpp.llama as L
    orig = L.llama_cpp.llama_model_default_params

    def patched() -> Any:
        p = orig()
        p.use_extra_bufts = repack
        return p

    L.llama_cpp.llama_model_default_params = patched
    try:
        yield
    finally:
        L.llama_cpp.llama_model_default_params = orig


def open_llama(path: str, *, repack: bool = False, **kw: Any) -> Any:
    """A ``llama_cpp.Llama`` with weight repacking on or (default) really off."""
    from llama_cpp import Llama
    kw.pop("use_extra_bufts", None)
    kw.setdefault("verbose", False)
    with _model_params(repack):
        return Llama(model_path=path, **kw)


def llama_logits(path: str, tokens: list[int], *, n_threads: int = 2) -> Any:
    """llama.cpp's logits of every position of ``tokens`` (float32 ``[positions, vocab]``),
    F32 K/V cache so only the weights' arithmetic differs from other implementations."""
    import numpy as np
    m = open_llama(path, n_ctx=max(128, len(tokens)), n_threads=n_threads, type_k=0, type_v=0,
                   logits_all=True)
    try:
        m.eval(tokens)
        return np.array(m.scores[:len(tokens)], dtype=np.float32)
    finally:
        m.close()
