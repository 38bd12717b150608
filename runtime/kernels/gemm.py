"""Float32 products on the CPU through the faster of the two GEMM libraries torch ships.

``F.linear`` multiplies float32 through MKL's ``sgemm``. MKL chooses its code path by the
CPU's vendor: on AMD processors it runs its AVX2 kernels even where the CPU has full-width
AVX-512. oneDNN, which torch also ships, chooses by the CPU's features. On an AMD EPYC Zen 5
(two cores) oneDNN ran the prefill's shapes ([8-128 tokens] × [512-4096, 2048]) at 1.9-2.9×
MKL's speed and a one-token product over a 155 MB float matrix at 1.8× (``bench/gemm_ab.py``,
figures in bench/README.md). On Intel CPUs MKL takes its AVX-512 path and stays.

Both compute the exact float32 product; only the summation order differs (within float32
rounding, as between any two BLAS builds), so which one runs is a property of the box, chosen
once per process: on a non-Intel CPU with AVX-512, oneDNN where a short timing (two
[64, 1024] × [1024, 1024]ᵀ products, best of five each, 20-30 ms) finds it at least
``FASTER`` times MKL's speed; MKL otherwise. ``EXPERTFS_GEMM=mkl|onednn`` overrides it (A/B
benchmarks, or a box where the choice is wrong).
"""

from __future__ import annotations

import functools
import logging
import os
import time

import torch
import torch.nn.functional as F

from . import cpu

__all__ = ["linear", "pad_rows", "backend", "BACKENDS"]

log = logging.getLogger(__name__)

BACKENDS = ("mkl", "onednn")

#: How much faster than MKL oneDNN must time on a non-Intel AVX-512 CPU to be chosen: the
#: timing gave 1.9-2.25× on a Zen 5 and 1.34-1.60× on a Zen 4, where oneDNN was the faster on
#: every prefill, decode and output-head shape (1.0-3.8×, bench/README.md), so a margin for the
#: timing's noise, not a bar a Zen 4 may miss from one run to the next.
FASTER = 1.15

#: oneDNN compiles a kernel for each new shape (0.5-9 ms each, the first time it meets it), and a
#: prompt's expert products come in as many row counts as experts' token counts: rows are padded
#: with zeros to a multiple of this, so a prompt meets a few shapes, at up to 7 rows' more work.
ROWS_STEP = 8

#: Weights below which a one-token product stays with ``F.linear``: oneDNN's fixed cost per call
#: made it 0.6-0.9× MKL's on 768×2048 and 2048×768, and 1.5× on 2048×2048 (bench/gemm_ab.py).
SMALL_ONE_TOKEN = 1 << 22


def _cpu_flags() -> tuple[str, frozenset[str]]:
    """``(vendor_id, flags)`` of the first CPU (``cpu.info``)."""
    c = cpu.info()
    return c.vendor, c.flags


@functools.lru_cache(maxsize=None)
def _onednn_op():
    """torch's oneDNN linear (``mkldnn._linear_pointwise``: dense float32 in and out), or
    ``None`` where this torch build has no oneDNN."""
    if not torch.backends.mkldnn.is_available():
        return None
    return getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)


@functools.lru_cache(maxsize=None)
def backend() -> str:
    """The GEMM library float32 CPU products use in this process: ``"mkl"`` or ``"onednn"``."""
    want = os.environ.get("EXPERTFS_GEMM", "").strip().lower()
    if want and want not in BACKENDS:
        log.warning("EXPERTFS_GEMM=%s is not one of %s: choosing by the CPU", want, BACKENDS)
        want = ""
    if want == "onednn" and _onednn_op() is None:
        log.info("torch has no oneDNN linear here: float32 products through MKL")
        want = "mkl"
    if not want:
        vendor, flags = _cpu_flags()
        want = "mkl"
        if vendor and vendor != "GenuineIntel" and "avx512f" in flags and _onednn_op():
            ratio = _onednn_speedup()
            log.debug("oneDNN %.2fx MKL's speed on this CPU", ratio)
            if ratio >= FASTER:
                want = "onednn"
    log.debug("float32 CPU products through %s", want)
    return want


def _onednn_speedup() -> float:
    """MKL's time over oneDNN's for one [64, 1024] × [1024, 1024]ᵀ product, best of five each
    after two of each to warm up (oneDNN's first calls compile its kernel)."""
    x, w = torch.randn(64, 1024), torch.randn(1024, 1024)
    onednn = _onednn_op()
    fns = (lambda: F.linear(x, w), lambda: onednn(x, w, None, "none", [], ""))
    best = [float("inf")] * 2
    for r in range(7):
        for i, f in enumerate(fns):
            t0 = time.perf_counter()
            f()
            if r >= 2:
                best[i] = min(best[i], time.perf_counter() - t0)
    return best[0] / best[1]


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)``, through oneDNN where ``backend()`` chose it and the operands are
    float32 CPU tensors of a shape it takes (``w`` 2-D and contiguous, as the weights and the
    dequantized chunks are; ``x`` of any leading dimensions)."""
    if (x.dtype != torch.float32 or w.dtype != torch.float32 or not x.is_cpu or w.dim() != 2
            or not w.is_contiguous() or x.numel() == 0 or w.numel() == 0
            or backend() != "onednn" or (x.numel() == x.shape[-1] and w.numel() < SMALL_ONE_TOKEN)):
        return F.linear(x, w, bias)
    if bias is not None and bias.dtype != torch.float32:
        bias = bias.float()
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    y = _onednn_op()(pad_rows(x2).contiguous(), w, bias, "none", [], "")
    return y[:m].reshape(*lead, w.shape[0])


def pad_rows(x2: torch.Tensor) -> torch.Tensor:
    """``x2 [m, in]`` with zero rows appended up to a multiple of ``ROWS_STEP`` where oneDNN
    multiplies it (``x2`` itself otherwise, or when ``m`` is one or already a multiple): a caller
    that multiplies one ``x`` by many matrices pads it once (``model.wide``)."""
    m = x2.shape[0]
    pad = -m % ROWS_STEP if m > 1 else 0
    if not pad or backend() != "onednn" or not x2.is_cpu or x2.dtype != torch.float32:
        return x2
    return torch.cat((x2, x2.new_zeros(pad, x2.shape[1])))
