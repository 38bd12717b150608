"""Routing traces: which experts each token used at each layer, in a compact zstd-compressed
file. ``TraceWriter`` streams one out (memory: one chunk), ``TraceReader``/``read_trace`` read one
back chunk by chunk, checking each; the bytes are specified in ``runtime.trace.format``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any, BinaryIO

import numpy as np
import xxhash
import zstandard

from .format import (CHUNK_TAG, END, END_TAG, MAGIC, MAX_CHUNK_ROWS, TRACE_VERSION,
                           ZSTD_LEVEL, ChunkBuffer, TraceChunk, TraceError, TraceHeader,
                           _CHUNK, _FIX_BAD, _FIX_PARTIAL, _columns, _fields, _validate,
                           encode_chunk)

__all__ = ["TRACE_VERSION", "MAGIC", "TraceError", "TraceHeader", "TraceChunk", "ChunkBuffer",
           "TraceWriter", "TraceReader", "encode_chunk", "read_trace", "END", "END_TAG",
           "ZSTD_LEVEL"]

log = logging.getLogger(__name__)


class TraceWriter:
    """Streaming writer: ``with TraceWriter(path, header) as w: w.add(...)``; memory is one chunk.

    ``close()`` (or leaving the ``with`` normally) writes the End record; after an exception the
    file is left without it, so readers report it as unfinished rather than trust it. The header
    and each chunk are handed to the OS as they are written, so a writer killed at any point
    leaves a file complete up to its last chunk (and perhaps part of the next, which readers
    detect).
    """

    def __init__(self, path: str | os.PathLike[str], header: TraceHeader, *, chunk_rows: int = 4096,
                 level: int = ZSTD_LEVEL) -> None:
        self.path, self.header, self.level = os.fspath(path), header, level
        self._buf = ChunkBuffer(header, chunk_rows)
        self.n_rows = self.n_chunks = 0
        try:
            self._f: BinaryIO | None = open(self.path, "wb")
        except OSError as e:
            raise TraceError(f"cannot create: {e.strerror}", path=self.path,
                             fix="check the directory exists and is writable") from None
        self._f.write(header.pack())
        self._f.flush()

    def add(self, token: int, layer: int, experts: Sequence[int] | np.ndarray,
            weights: Sequence[float] | np.ndarray, draft_experts: Any = None,
            draft_weights: Any = None) -> None:
        """Append one row; see ``ChunkBuffer.add``."""
        self._buf.add(token, layer, experts, weights, draft_experts, draft_weights)
        if self._buf.full:
            self._flush()

    def add_chunk(self, chunk: TraceChunk) -> None:
        """Append many rows given as columns (validated, split into chunks as needed)."""
        _validate(self.header, chunk, self.path)
        self._flush()
        step = self._buf.rows
        for a in range(0, len(chunk), step):
            part = TraceChunk(*(None if x is None else x[a:a + step] for x in _fields(chunk)))
            self._write(encode_chunk(self.header, part, self.level), len(part))

    def _flush(self) -> None:
        if self._buf.n:
            n = self._buf.n
            self._write(encode_chunk(self.header, self._buf.take(), self.level), n)

    def _write(self, data: bytes, n: int) -> None:
        if self._f is None:
            raise TraceError("write after close", path=self.path, fix="open a new TraceWriter")
        self._f.write(data)
        self._f.flush()
        self.n_rows += n
        self.n_chunks += 1

    def close(self) -> None:
        if self._f is None:
            return
        self._flush()
        self._f.write(END.pack(END_TAG, self.n_rows, self.n_chunks, 0))
        self._f.close()
        self._f = None
        log.debug("wrote trace %s: %d rows in %d chunks", self.path, self.n_rows, self.n_chunks)

    def __enter__(self) -> TraceWriter:
        return self

    def abort(self) -> None:
        """Close without the End record: readers will report the file as unfinished."""
        if self._f is not None:
            self._f.close()
            self._f = None

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class TraceReader:
    """Streaming reader: the header on open, then ``chunks()`` decodes one chunk at a time.

    Every chunk is checked (length, checksum, ids in range) before it is yielded. A file whose End
    record is missing (its writer was killed mid-write, or is still running) raises ``TraceError``
    after its last complete chunk unless ``allow_partial=True``: then the file is read as complete
    up to there, a warning says so, and ``complete`` is False with ``note`` saying where it stops.
    ``rows`` and ``n_chunks`` count what was read.
    """

    def __init__(self, path: str | os.PathLike[str], *, allow_partial: bool = False) -> None:
        self.path, self.allow_partial = os.fspath(path), allow_partial
        try:
            self._f: BinaryIO = open(self.path, "rb")
        except OSError as e:
            raise TraceError(f"cannot open: {e.strerror}", path=self.path,
                             fix="check the path and its permissions") from None
        try:
            self.header = TraceHeader.read(self._f, self.path)
        except BaseException:
            self._f.close()
            raise
        self._data_start = self._f.tell()
        self.complete: bool | None = None      # known after a full pass
        self.note = ""                         # where an unfinished file stops
        self.rows = self.n_chunks = 0

    def chunks(self) -> Iterator[TraceChunk]:
        f, path = self._f, self.path
        f.seek(self._data_start)
        rows = n_chunks = 0
        dctx = zstandard.ZstdDecompressor()
        while True:
            tag = f.read(4)
            if tag == END_TAG:
                self._check_end(f, rows, n_chunks)
                return
            head = tag + f.read(_CHUNK.size - 4) if tag == CHUNK_TAG else tag
            if len(head) < (_CHUNK.size if tag == CHUNK_TAG else 4):
                if self._partial(f"truncated after {n_chunks} complete chunks ({rows} rows): no "
                                 "End record"):
                    return
            if tag != CHUNK_TAG:
                raise TraceError(f"expected a chunk or End tag at byte {f.tell() - len(tag)}, "
                                 f"found {tag!r}", path=path, fix=_FIX_BAD)
            _, n, comp_len, digest = _CHUNK.unpack(head)
            raw_len = n * self.header.row_bytes
            if not 1 <= n <= MAX_CHUNK_ROWS or comp_len > raw_len + (raw_len >> 7) + 1024:
                raise TraceError(f"chunk {n_chunks} claims {n} rows in {comp_len} bytes",
                                 path=path, fix=_FIX_BAD)
            comp = f.read(comp_len)
            if len(comp) < comp_len:
                if self._partial(f"truncated inside chunk {n_chunks} ({len(comp)} of {comp_len} "
                                 f"bytes) after {rows} complete rows"):
                    return
            chunk = self._decode(dctx, comp, n, digest, n_chunks)
            rows += n
            n_chunks += 1
            self.rows, self.n_chunks = rows, n_chunks
            yield chunk

    def _check_end(self, f: BinaryIO, rows: int, n_chunks: int) -> None:
        rest = f.read(END.size - 4)
        if len(rest) < END.size - 4:
            self._partial(f"truncated inside the End record after {n_chunks} complete chunks")
            return
        _, total, count, _ = END.unpack(END_TAG + rest)
        if (total, count) != (rows, n_chunks):
            raise TraceError(f"End record says {total} rows in {count} chunks, the file holds "
                             f"{rows} in {n_chunks}", path=self.path, fix=_FIX_BAD)
        if f.read(1):
            raise TraceError("bytes after the End record", path=self.path, fix=_FIX_BAD)
        self.complete = True

    def _partial(self, problem: str) -> bool:
        """A cut-short file: True (stop quietly) when allowed, else a TraceError."""
        self.complete = False
        self.note = problem
        if not self.allow_partial:
            raise TraceError(problem, path=self.path, fix=_FIX_PARTIAL)
        log.warning("%s: an unfinished trace, read as complete up to here: %s", self.path, problem)
        return True

    def _decode(self, dctx: zstandard.ZstdDecompressor, comp: bytes, n: int, digest: int,
                index: int) -> TraceChunk:
        h, path = self.header, self.path
        expect = n * h.row_bytes
        try:
            raw = dctx.decompress(comp, max_output_size=expect)
        except zstandard.ZstdError as e:
            raise TraceError(f"chunk {index} does not decompress ({e})", path=path,
                             fix=_FIX_BAD) from None
        if len(raw) != expect or xxhash.xxh3_64_intdigest(raw) != digest:
            raise TraceError(f"chunk {index}: payload of {len(raw)} bytes (expected {expect}) or "
                             "checksum mismatch", path=path, fix=_FIX_BAD)
        cols, off = {}, 0
        for name, dt, shape in _columns(h, n):
            size = int(np.prod(shape)) * dt.itemsize
            cols[name] = np.frombuffer(raw, dt, int(np.prod(shape)), off).reshape(shape)
            off += size
        chunk = TraceChunk(cols["tokens"], cols["layers"], cols["n_valid"], cols["experts"],
                           cols["weights"], cols.get("draft_experts"), cols.get("draft_weights"))
        _validate(h, chunk, path)
        return chunk

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> TraceReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_trace(path: str | os.PathLike[str], *, allow_partial: bool = False
               ) -> tuple[TraceHeader, TraceChunk]:
    """The whole trace as one in-memory chunk (for offline analysis such as the Belady bound);
    with ``allow_partial`` an unfinished file gives its complete chunks (see ``TraceReader``)."""
    with TraceReader(path, allow_partial=allow_partial) as r:
        parts = list(r.chunks())
        h = r.header
    if not parts:
        return h, ChunkBuffer(h, 1).take()
    cols = zip(*(_fields(p) for p in parts))
    return h, TraceChunk(*(None if c[0] is None else np.concatenate(c) for c in cols))
