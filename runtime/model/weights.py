"""Trunk weights from a store: ``trunk.bin`` mapped once, tensors made ready for compute.

Every non-expert tensor (attention, norms, routers, shared experts, dense FFNs, embeddings,
the NextN block) lives in ``STORE/trunk.bin``. ``TrunkReader`` maps the file privately
(copy-on-write, so tensors can view it without a copy) and hands out ``RawTensor`` views.
Its pages come in from the page cache as the forward first touches them, a few at a time and
with the compute waiting on each; ``prefetch`` has the kernel read the whole file in the
background as soon as the engine opens it, ``populate`` faults it all in before a benchmark's
first token (what llama.cpp's mmap does with ``MAP_POPULATE``).

A matrix becomes a ``Linear``: either dequantized once into the compute dtype, ``[out, in]``
contiguous for ``F.linear`` (fast), or kept as its ggml bytes and multiplied through
``dequant.linear`` on every call (a fraction of the RAM, far slower on CPU; measured in
bench/bench_decode.py). ``trunk_mode`` chooses: ``"float"``, ``"quant"`` or ``"auto"`` (float
unless the float trunk would exceed ``float_budget`` bytes, then the largest matrices stay
quantized). The token embedding is always kept as bytes: a lookup dequantizes only its rows.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from dataclasses import dataclass
from typing import Iterable

import torch

from ...errors import StoreError
from ...formats.dequant import dequantize, linear as qlinear
from ...formats.ggml import GGMLType, row_bytes
from .. import kernels as native
from ..io.buffers import MADV_POPULATE_READ
from ..kernels import gemm
from .qmatvec import decode_matvec
from .wide import wide_linear

__all__ = ["RawTensor", "TrunkReader", "Linear", "Embedding", "plan_float"]

log = logging.getLogger(__name__)

_ADVICE_STEP = 64 << 20          # bytes per madvise call: file order, and a close stops it soon


@dataclass(frozen=True)
class RawTensor:
    name: str
    raw: torch.Tensor            # uint8 view of the ggml bytes (CPU, mapped)
    ggml_type: GGMLType
    shape: tuple[int, ...]       # torch order (reversed ne)

    @property
    def nbytes(self) -> int:
        return int(self.raw.numel())

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def to_float(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Dequantized ``[out, in]`` (or 1-D) tensor, contiguous, on ``device``. An F32 tensor
        wanted in float32 on the CPU is a view of its bytes, not a copy: in the mapped trunk
        it stays file pages (a cap evicts them and they fault back in, as the quantized
        matrices' do) instead of an anonymous copy beside them, which a cap cannot take back
        (a MoE model's F32 routers: 1 MiB a layer on Qwen3-30B-A3B, 4.5 MiB on GLM-5.3-Flash)."""
        if device.type == "cpu" and dtype == torch.float32 and self.ggml_type == GGMLType.F32 \
                and self.raw.is_contiguous() and self.raw.data_ptr() % 4 == 0:
            return self.raw.view(torch.float32).view(self.shape)
        src = self.raw.to(device) if device.type != "cpu" else self.raw
        return dequantize(src, self.ggml_type, self.shape, dtype=dtype).contiguous()


class TrunkReader:
    """``trunk.bin`` of a store, mapped copy-on-write; ``get(name)`` is a zero-copy view."""

    def __init__(self, store) -> None:
        self.path = store.trunk_path
        self.records = store.trunk_tensors()
        size = os.path.getsize(self.path)
        with open(self.path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
        self._buf = (torch.frombuffer(self._mm, dtype=torch.uint8) if self._mm is not None
                     else torch.empty(0, dtype=torch.uint8))
        self._closed = threading.Event()       # stops a background prefetch between steps
        self.row_tables = self._row_tables()
        self.row_pages = self._pages(self.row_tables)
        self.unused_pages: list[tuple[int, int]] = []    # tensors no forward reads (leave_out)
        self._advise_rows(mmap.MADV_RANDOM)    # a lookup's fault reads its pages, not around

    def _row_tables(self) -> list[str]:
        """The tensors only ever read a row at a time (a token's): the token embedding where
        the model has an output head of its own (untied), and NextN blocks' ``embed_tokens``.
        The memory model does not count them resident (``plan.host.trunk_host_bytes``)."""
        names = [n for n in self.records if n.endswith("nextn.embed_tokens.weight")]
        if "output.weight" in self.records and "token_embd.weight" in self.records:
            names.append("token_embd.weight")
        return names

    def _advise_rows(self, advice: int) -> None:
        for a, b in self.row_pages:
            try:
                self._mm.madvise(advice, a, b - a)
            except OSError:
                return

    def _pages(self, names: list[str]) -> list[tuple[int, int]]:
        """Byte ranges of the pages wholly inside each of the tensors ``names``: what can be
        advised for them alone (a page they share holds a neighbour's bytes too)."""
        page, out = mmap.PAGESIZE, []
        for n in names:
            r = self.records[n]
            a = -(-r.offset // page) * page
            b = min(r.offset + r.nbytes, self._buf.numel()) // page * page
            if b > a:
                out.append((a, b))
        return sorted(out)

    def _advise(self, advice: int, skip: list[tuple[int, int]] = ()) -> bool:
        """``madvise(advice)`` over the whole map but the ranges ``skip``, a step at a time in
        file order, until the reader is closed; False when the kernel refuses it."""
        mm = self._mm
        size = len(mm) if mm is not None else 0
        spans, at = [], 0
        for a, b in (*skip, (size, size)):
            if a > at:
                spans.append((at, min(a, size)))
            at = max(at, b)
        for lo, hi in spans:
            for a in range(lo, hi, _ADVICE_STEP):
                if self._closed.is_set():
                    return True
                try:
                    mm.madvise(advice, a, min(_ADVICE_STEP, hi - a))
                except OSError:
                    return False
        return True

    def leave_out(self, blocks: range) -> None:
        """The tensors of ``blocks`` (the NextN blocks, where nothing drafts with them): never
        read ahead or faulted in here, as the memory model does not count them
        (``Geometry.nextn_loaded``)."""
        pre = tuple(f"blk.{b}." for b in blocks)
        self.unused_pages = self._pages([n for n in self.records if n.startswith(pre)])

    def prefetch(self) -> None:
        """Have the kernel read trunk.bin into the page cache in the background
        (``MADV_WILLNEED`` from a thread: the call itself can wait on the drive's queue), so the
        prompt's first pass over the trunk finds its pages in memory rather than faulting them
        in while the compute waits. The trunk is resident in the memory model (``run``'s and
        ``plan``'s); the row tables are not (a token reads one row of them), so they are left
        out (but the pages they share with a neighbour): under a cap their pages would push
        out what the model counts."""
        if self._mm is not None:
            skip = sorted(self.row_pages + self.unused_pages)
            threading.Thread(target=self._advise, args=(mmap.MADV_WILLNEED, skip),
                             name="expertfs-trunk-prefetch", daemon=True).start()

    def populate(self) -> None:
        """Fault every page of trunk.bin in now (``MADV_POPULATE_READ``; where the kernel lacks
        it, a read of one byte a page) but those of tensors left out: the trunk resident before
        the first token, the row tables too, so they are read as the rest, in the drive's
        read-ahead, not a page at a time."""
        if self._mm is None:
            return
        self._advise_rows(mmap.MADV_NORMAL)
        if self._advise(MADV_POPULATE_READ, self.unused_pages):
            return
        log.debug("MADV_POPULATE_READ refused; touching trunk.bin a page at a time")
        page = mmap.PAGESIZE
        n = self._buf.numel() // page * page
        if n:
            self._buf[:n].view(-1, page)[:, 0].sum()

    @property
    def base_address(self) -> int | None:
        """Where trunk.bin's first byte is mapped (None: empty or closed)."""
        return self._buf.data_ptr() if self._buf.numel() else None

    @property
    def mapped_bytes(self) -> int:
        return self._buf.numel()

    def span_of(self, t: torch.Tensor) -> tuple[int, int] | None:
        """The bytes ``[start, end)`` of trunk.bin a tensor views in this mapping (None: it is
        not a view of it, e.g. a copy on another device)."""
        base, n = self.base_address, self._buf.numel()
        a = t.data_ptr() - base if base is not None and t.is_cpu else -1
        size = t.numel() * t.element_size()
        return (a, a + size) if 0 <= a and a + size <= n else None

    def __contains__(self, name: str) -> bool:
        return name in self.records

    def names(self) -> set[str]:
        return set(self.records)

    def get(self, name: str) -> RawTensor:
        r = self.records.get(name)
        if r is None:
            raise StoreError(f"trunk tensor {name!r} is missing", path=self.path,
                             fix="the store is not a complete model; repack it from the GGUF")
        if r.offset + r.nbytes > self._buf.numel():
            raise StoreError(f"trunk tensor {name!r} [{r.offset}, {r.offset + r.nbytes}) lies "
                             f"past the end of trunk.bin", path=self.path, fix="repack the model")
        return RawTensor(name, self._buf[r.offset:r.offset + r.nbytes], r.ggml_type,
                         tuple(reversed(r.ne)))

    def opt(self, name: str) -> RawTensor | None:
        return self.get(name) if name in self.records else None

    def close(self) -> None:
        self._closed.set()
        self._buf = torch.empty(0, dtype=torch.uint8)
        # the map is released when the last view is garbage collected


class Linear:
    """``y = x @ W.T (+ b)`` with W either a float ``[out, in]`` tensor or ggml bytes."""

    __slots__ = ("weight", "q", "bias", "out_features", "in_features", "fused", "act_quant")

    def __init__(self, weight: torch.Tensor | None, q: RawTensor | None,
                 bias: torch.Tensor | None, shape: tuple[int, int]) -> None:
        self.weight, self.q, self.bias = weight, q, bias
        self.out_features, self.in_features = shape
        self.fused = False           # one-token products through qmatvec (set by the loader)
        self.act_quant: str | None = None   # "q8": llama.cpp's 8-bit activations (opt-in, lossy)

    @classmethod
    def load(cls, w: RawTensor, b: RawTensor | None, *, dtype: torch.dtype,
             device: torch.device, quantized: bool) -> Linear:
        bias = b.to_float(dtype, device) if b is not None else None
        if len(w.shape) != 2:
            raise StoreError(f"{w.name}: a matrix of shape {w.shape} was expected",
                             fix="the store's tensor shapes do not match the architecture")
        if quantized and w.ggml_type not in (GGMLType.F32,):
            raw = w.raw.to(device) if device.type != "cpu" else w.raw
            return cls(None, RawTensor(w.name, raw, w.ggml_type, w.shape), bias, w.shape)
        return cls(w.to_float(dtype, device), None, bias, w.shape)

    @property
    def nbytes(self) -> int:
        t = self.weight if self.weight is not None else self.q.raw
        return t.numel() * t.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            return gemm.linear(x, self.weight, self.bias)
        q = self.q
        if self.fused and x.dim() == 2:
            y = decode_matvec(x, q.raw, q.ggml_type, q.shape, self.act_quant)   # native, a few tokens
            if y is not None:
                return y if self.bias is None else y + self.bias
            return wide_linear(x, q.raw, q.ggml_type, q.shape, self.bias,   # wider batches
                               self.act_quant)
        return qlinear(x, q.raw, q.ggml_type, q.shape, self.bias, matmul=gemm.linear)


class Embedding:
    """Token embedding kept as ggml bytes; ``lookup(ids)`` dequantizes only those rows."""

    def __init__(self, w: RawTensor, device: torch.device) -> None:
        n_vocab, n_embd = w.shape
        self.shape = (n_vocab, n_embd)
        self.ggml_type = w.ggml_type
        raw = w.raw.to(device) if device.type != "cpu" else w.raw
        self.rows = raw.reshape(n_vocab, row_bytes(w.ggml_type, n_embd))
        self.raw = w

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``[T] int64`` on the device → ``[T, n_embd]`` in ``dtype``: on the CPU through the
        native dequantization (the same floats, tested bit for bit, at a fraction of the torch
        path's per-call cost: a decode step's one row), else the torch one."""
        rows = self.rows.index_select(0, ids)
        shape = (ids.numel(), self.shape[1])
        y = native.dequant(rows, self.ggml_type, shape) if rows.is_cpu else None
        if y is not None:
            return y if dtype == torch.float32 else y.to(dtype)
        return dequantize(rows, self.ggml_type, shape, dtype=dtype)


def plan_float(mats: Iterable[RawTensor], mode: str, dtype: torch.dtype,
               float_budget: int | None, fused_types: frozenset = frozenset()) -> set[str]:
    """Names of the matrices to dequantize at load (the rest stay quantized).

    ``float``: all; ``quant``: none (F32 matrices are always used as they are); ``auto``: the
    types with a fused one-token product (``fused_types``) stay quantized, the others are
    dequantized unless their float size passes ``float_budget``, then the largest stay
    quantized until the rest fits.
    """
    mats = list(mats)
    if mode == "float":
        return {m.name for m in mats}
    if mode == "quant":
        return set()
    mats = [m for m in mats if m.ggml_type not in fused_types]
    if float_budget is None:
        return {m.name for m in mats}
    el = torch.empty(0, dtype=dtype).element_size()
    chosen = {m.name for m in mats}
    total = sum(m.numel * el for m in mats)
    for m in sorted(mats, key=lambda m: -m.numel):
        if total <= float_budget:
            break
        chosen.discard(m.name)
        total -= m.numel * el
    return chosen
