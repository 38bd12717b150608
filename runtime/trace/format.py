"""The routing-trace file format: its records, their encoding and the rules a chunk must obey
(``runtime.trace`` writes and reads whole files).

Format version 1 (``TRACE_VERSION``). All integers little-endian; the file is::

    File   := Header Chunk* End            (and nothing after End)
    Header := magic "EFSTRACE" (8s) | version u16 = 1 | flags u16 = 0
              | n_layers u32 (1..65535) | n_experts u32 (experts per layer, 1..65536)
              | k u16 (top-k, 1..n_experts, <= 64) | n_draft u16 (draft routes per row, 0..16)
              | meta_len u32 (<= 1 MiB) | reserved u32 = 0
              | expert_bytes u64 × n_layers (bytes of one expert of that layer; 0 = no routed experts)
              | meta: meta_len bytes of UTF-8 JSON, an object (model name, generator, ...)
              | xxh3_64 u64 of every header byte before it
    Chunk  := tag "EFTC" (4s) | n_rows u32 (1..65536) | comp_len u32 | xxh3_64 u64 of the raw payload
              | comp_len bytes: one zstd frame holding the raw payload
    Raw payload (n = n_rows, columns back to back, no padding):
              token u32[n] | layer u16[n] | n_valid u8[n] (draft routes present, <= n_draft)
              | experts u16[n, k] | weights f16[n, k]
              | draft_experts u16[n, n_draft, k] | draft_weights f16[n, n_draft, k]   (when n_draft > 0;
                routes past n_valid: writers store zeros, readers ignore them)
    End    := tag "EFTE" (4s) | n_rows u64 (all chunks) | n_chunks u32 | reserved u32 = 0

A row is one routing decision: token ``token`` at layer ``layer`` chose ``experts`` (distinct ids,
any order) with ``weights``; its optional draft routes are those of the tokens an MTP head drafted
there. Rows are in execution order (decode: token-major; a prefill batch may be layer-major).
Rules: ``layer < n_layers`` and ``expert_bytes[layer] > 0``; every id ``< n_experts``. Versioning:
a reader accepts exactly the versions it knows; any change to these bytes bumps ``version``.
Memory is bounded: a writer buffers one chunk, a reader decodes one chunk at a time.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import numpy as np
import xxhash
import zstandard

from ...errors import FormatError

__all__ = ["TRACE_VERSION", "MAGIC", "CHUNK_TAG", "END_TAG", "END", "ZSTD_LEVEL", "TraceError",
           "TraceHeader", "TraceChunk", "ChunkBuffer", "encode_chunk"]

TRACE_VERSION = 1
MAGIC = b"EFSTRACE"
CHUNK_TAG = b"EFTC"
END_TAG = b"EFTE"
MAX_META = 1 << 20
MAX_CHUNK_ROWS = 65536
MAX_K = 64
MAX_DRAFT = 16
ZSTD_LEVEL = 3

_HEAD = struct.Struct("<8sHHIIHHII")     # magic, version, flags, n_layers, n_experts, k, n_draft,
                                         # meta_len, reserved                          (32 B)
_CHUNK = struct.Struct("<4sIIQ")         # tag, n_rows, comp_len, xxh3 of raw          (20 B)
END = struct.Struct("<4sQII")            # tag, n_rows, n_chunks, reserved            (20 B)
_U64 = struct.Struct("<Q")

_FIX_BAD = "the trace is damaged; record or generate it again"
_FIX_PARTIAL = ("its writer did not finish (crashed or still running); record it again, or read the "
                "complete chunks with allow_partial=True (bench cache --allow-partial)")


class TraceError(FormatError):
    """A routing-trace file breaks a rule of the trace format (see ``expertfs.runtime.trace.file``)."""


@dataclass(frozen=True)
class TraceHeader:
    """Model geometry a trace was recorded against, so byte counts can be computed from it."""

    n_layers: int
    n_experts: int                       # experts per layer
    k: int                               # experts chosen per token per layer
    expert_bytes: tuple[int, ...]        # per layer; 0 for a layer without routed experts
    n_draft: int = 0                     # draft routes stored per row (0 = none)
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 1 <= self.n_layers <= 65535:
            raise TraceError(f"n_layers {self.n_layers} outside 1..65535", fix="check the model geometry")
        if not 1 <= self.n_experts <= 65536:
            raise TraceError(f"n_experts {self.n_experts} outside 1..65536", fix="expert ids are u16")
        if not 1 <= self.k <= min(self.n_experts, MAX_K):
            raise TraceError(f"k {self.k} outside 1..min(n_experts, {MAX_K})", fix="check top-k")
        if not 0 <= self.n_draft <= MAX_DRAFT:
            raise TraceError(f"n_draft {self.n_draft} outside 0..{MAX_DRAFT}", fix="store fewer drafts")
        if len(self.expert_bytes) != self.n_layers or any(b < 0 for b in self.expert_bytes):
            raise TraceError(f"expert_bytes needs {self.n_layers} non-negative sizes, got "
                             f"{len(self.expert_bytes)}", fix="give one size per layer (0 = dense)")
        object.__setattr__(self, "expert_bytes", tuple(int(b) for b in self.expert_bytes))

    @property
    def row_bytes(self) -> int:
        """Size of one row in the raw (decompressed) payload."""
        return 4 + 2 + 1 + 4 * self.k + 4 * self.k * self.n_draft

    def pack(self) -> bytes:
        meta = json.dumps(dict(self.meta), sort_keys=True, separators=(",", ":")).encode("utf-8")
        if len(meta) > MAX_META:
            raise TraceError(f"metadata of {len(meta)} bytes exceeds {MAX_META}", fix="store less metadata")
        body = (_HEAD.pack(MAGIC, TRACE_VERSION, 0, self.n_layers, self.n_experts, self.k,
                           self.n_draft, len(meta), 0)
                + b"".join(_U64.pack(b) for b in self.expert_bytes) + meta)
        return body + _U64.pack(xxhash.xxh3_64_intdigest(body))

    @classmethod
    def read(cls, f: BinaryIO, path: str) -> TraceHeader:
        """Read and validate the header at the start of ``f``."""
        head = _read_exact(f, _HEAD.size, "the header", path)
        magic, version, flags, n_layers, n_experts, k, n_draft, meta_len, _ = _HEAD.unpack(head)
        if magic != MAGIC:
            raise TraceError(f"not a routing trace (magic {magic!r}, expected {MAGIC!r})", path=path,
                             fix="pass a file written by expertfs's trace writer")
        if version != TRACE_VERSION:
            raise TraceError(f"trace format version {version}; this expertfs reads version "
                             f"{TRACE_VERSION}", path=path,
                             fix="use the expertfs release that wrote it, or record the trace again")
        if flags != 0 or meta_len > MAX_META or not 1 <= n_layers <= 65535:
            raise TraceError(f"header fields out of range (flags {flags}, meta_len {meta_len}, "
                             f"n_layers {n_layers})", path=path, fix=_FIX_BAD)
        rest = _read_exact(f, 8 * n_layers + meta_len, "the header", path)
        digest = _U64.unpack(_read_exact(f, 8, "the header checksum", path))[0]
        if xxhash.xxh3_64_intdigest(head + rest) != digest:
            raise TraceError("header checksum mismatch", path=path, fix=_FIX_BAD)
        sizes = struct.unpack_from(f"<{n_layers}Q", rest)
        try:
            meta = json.loads(rest[8 * n_layers:].decode("utf-8")) if meta_len else {}
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise TraceError("header metadata is not UTF-8 JSON", path=path, fix=_FIX_BAD) from None
        if not isinstance(meta, dict):
            raise TraceError("header metadata is not a JSON object", path=path, fix=_FIX_BAD)
        try:
            return cls(n_layers, n_experts, k, sizes, n_draft, meta)
        except TraceError as e:
            raise TraceError(e.problem, path=path, fix=_FIX_BAD) from None


@dataclass(frozen=True)
class TraceChunk:
    """Rows as columns. ``draft_experts``/``draft_weights`` are None when the trace has no drafts."""

    tokens: np.ndarray                   # u32 [n]
    layers: np.ndarray                   # u16 [n]
    n_valid: np.ndarray                  # u8  [n]
    experts: np.ndarray                  # u16 [n, k]
    weights: np.ndarray                  # f16 [n, k]
    draft_experts: np.ndarray | None     # u16 [n, n_draft, k]
    draft_weights: np.ndarray | None     # f16 [n, n_draft, k]

    def __len__(self) -> int:
        return len(self.tokens)


def _columns(h: TraceHeader, n: int) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
    cols = [("tokens", np.dtype("<u4"), (n,)), ("layers", np.dtype("<u2"), (n,)),
            ("n_valid", np.dtype("u1"), (n,)), ("experts", np.dtype("<u2"), (n, h.k)),
            ("weights", np.dtype("<f2"), (n, h.k))]
    if h.n_draft:
        cols += [("draft_experts", np.dtype("<u2"), (n, h.n_draft, h.k)),
                 ("draft_weights", np.dtype("<f2"), (n, h.n_draft, h.k))]
    return cols


def encode_chunk(h: TraceHeader, chunk: TraceChunk, level: int = ZSTD_LEVEL) -> bytes:
    """One chunk's bytes (tag, counts, checksum, zstd frame). Pure and thread-safe."""
    n = len(chunk)
    raw = b"".join(np.ascontiguousarray(getattr(chunk, name), dtype=dt).tobytes()
                   for name, dt, _ in _columns(h, n))
    comp = zstandard.ZstdCompressor(level=level, write_content_size=True).compress(raw)
    return _CHUNK.pack(CHUNK_TAG, n, len(comp), xxhash.xxh3_64_intdigest(raw)) + comp


class ChunkBuffer:
    """Rows accumulated into preallocated columns until a chunk is full (shared by both writers)."""

    def __init__(self, header: TraceHeader, rows: int) -> None:
        if not 1 <= rows <= MAX_CHUNK_ROWS:
            raise TraceError(f"chunk_rows {rows} outside 1..{MAX_CHUNK_ROWS}", fix="use the default")
        self.h, self.rows, self.n = header, rows, 0
        self._cols = {name: np.zeros(shape, dt) for name, dt, shape in _columns(header, rows)}

    @property
    def full(self) -> bool:
        return self.n == self.rows

    def add(self, token: int, layer: int, experts: Sequence[int] | np.ndarray,
            weights: Sequence[float] | np.ndarray,
            draft_experts: Sequence[Sequence[int]] | np.ndarray | None = None,
            draft_weights: Sequence[Sequence[float]] | np.ndarray | None = None) -> None:
        """Append one row (the buffer must not be full)."""
        h, c, i = self.h, self._cols, self.n
        self._check_row(token, layer, experts)
        c["tokens"][i], c["layers"][i] = token, layer
        c["experts"][i], c["weights"][i] = experts, weights
        if h.n_draft:
            d = 0 if draft_experts is None else len(draft_experts)
            if d > h.n_draft:
                raise TraceError(f"{d} draft routes but the trace stores {h.n_draft}",
                                 fix="raise n_draft in the header or store fewer drafts")
            c["n_valid"][i] = d
            c["draft_experts"][i], c["draft_weights"][i] = 0, 0
            if d:
                c["draft_experts"][i, :d] = draft_experts
                c["draft_weights"][i, :d] = 1.0 if draft_weights is None else draft_weights
        elif draft_experts is not None and len(draft_experts):
            raise TraceError("draft routes given but the trace header has n_draft = 0",
                             fix="set n_draft in the TraceHeader")
        self.n = i + 1

    def _check_row(self, token: int, layer: int, experts: Sequence[int] | np.ndarray) -> None:
        h = self.h
        if not 0 <= token < 1 << 32:
            raise TraceError(f"token index {token} outside 0..2**32-1", fix="count tokens from 0")
        if not 0 <= layer < h.n_layers or h.expert_bytes[layer] == 0:
            raise TraceError(f"layer {layer} has no routed experts in this trace's geometry",
                             fix="record only MoE layers; expert_bytes[layer] must be > 0")
        ids = np.asarray(experts)
        if (ids.shape != (h.k,) or ids.min() < 0 or ids.max() >= h.n_experts
                or len(set(ids.tolist())) != h.k):
            raise TraceError(f"route {ids.tolist()} is not {h.k} distinct ids below {h.n_experts}",
                             fix="pass the router's top-k expert ids")

    def take(self) -> TraceChunk:
        """The buffered rows as a chunk (copies), and an empty buffer."""
        n, c = self.n, self._cols
        get = lambda name: c[name][:n].copy() if name in c else None  # noqa: E731
        self.n = 0
        return TraceChunk(get("tokens"), get("layers"), get("n_valid"), get("experts"),
                          get("weights"), get("draft_experts"), get("draft_weights"))


def _read_exact(f: BinaryIO, n: int, what: str, path: str) -> bytes:
    b = f.read(n)
    if len(b) != n:
        raise TraceError(f"truncated: {what} needs {n} bytes, {len(b)} left", path=path,
                         fix=_FIX_PARTIAL)
    return b


def _fields(c: TraceChunk) -> tuple[np.ndarray | None, ...]:
    return (c.tokens, c.layers, c.n_valid, c.experts, c.weights, c.draft_experts, c.draft_weights)


def _validate(h: TraceHeader, c: TraceChunk, path: str) -> None:
    """Check a decoded (or given) chunk against the format's rules; vectorised."""
    n = len(c)
    if n == 0:
        return
    for name, dt, shape in _columns(h, n):
        a = getattr(c, name)
        if a is None or a.shape != shape:
            raise TraceError(f"column {name} has shape {None if a is None else a.shape}, "
                             f"expected {shape}", path=path, fix="pass columns matching the header")
    sizes = np.asarray(h.expert_bytes + (0,), dtype=np.int64)
    layers = np.minimum(c.layers.astype(np.int64), h.n_layers)
    if (sizes[layers] == 0).any():
        bad = int(c.layers[sizes[layers] == 0][0])
        raise TraceError(f"a row names layer {bad}, which has no routed experts (n_layers "
                         f"{h.n_layers})", path=path, fix=_FIX_BAD)
    if int(c.experts.max()) >= h.n_experts:
        raise TraceError(f"expert id {int(c.experts.max())} >= n_experts {h.n_experts}",
                         path=path, fix=_FIX_BAD)
    if h.k > 1 and (np.diff(np.sort(c.experts, axis=1), axis=1) == 0).any():
        raise TraceError("a route names the same expert twice", path=path, fix=_FIX_BAD)
    if h.n_draft:
        assert c.draft_experts is not None
        if int(c.n_valid.max()) > h.n_draft or int(c.draft_experts.max()) >= h.n_experts:
            raise TraceError(f"draft routes out of range (n_valid <= {h.n_draft}, ids < "
                             f"{h.n_experts})", path=path, fix=_FIX_BAD)
    elif int(c.n_valid.max()) != 0:
        raise TraceError("rows claim draft routes but n_draft is 0", path=path, fix=_FIX_BAD)
