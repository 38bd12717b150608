"""``unpack``: a store back to one GGUF whose metadata and tensor bytes equal the source's.

Tensors are written in the source's order with llama.cpp's packed offsets at the source's
alignment, so for a source that followed that rule (every llama.cpp or gguf-py writer does)
the output is the source file byte for byte. Every part's checksum is checked on the way.
"""

from __future__ import annotations

import os
from typing import Callable, Iterator

import xxhash

from ..errors import IntegrityError, UsageError
from .fileio import chunked, pread_full
from ..formats.gguf_split import SPLIT_KEYS
from ..formats.gguf_write import TensorSpec, write_gguf
from .layout import KIND_TRUNK, TensorRecord
from .reader import Store

__all__ = ["unpack"]


def unpack(store_path: str, out: str, *, force: bool = False,
           progress: Callable[[int, int], None] | None = None) -> dict[str, object]:
    """Write ``out`` (a .gguf) from the store; returns a small summary."""
    if os.path.lexists(out) and not force:
        raise UsageError("already exists", path=out, fix="pass --force to replace it, or "
                         "choose another -o")
    if os.path.isdir(out):
        raise UsageError("is a folder", path=out, fix="give the output .gguf file name")
    with Store.open(store_path) as store:
        kv = [e.raw for k, e in store.gguf_kv().items() if k not in SPLIT_KEYS]
        records = sorted(store.tensors(), key=lambda t: t.index)
        specs = [TensorSpec(t.name, t.ne, t.ggml_type) for t in records]
        total = sum(s.nbytes for s in specs)
        done = [0]
        fds = {p: os.open(p, os.O_RDONLY) for p in (store.trunk_path, store.experts_path)}
        try:
            def chunks(i: int, spec: TensorSpec) -> Iterator[bytes]:
                for b in _tensor_bytes(store, records[i], fds):
                    done[0] += len(b)
                    if progress:
                        progress(done[0], total)
                    yield b

            size = write_gguf(out, kv, specs, chunks, int(store.summary["source_alignment"]),
                              drop_cache=True, version=store.gguf_version)
        finally:
            for fd in fds.values():
                os.close(fd)
    return {"gguf": out, "bytes": size, "tensors": len(specs)}


def _tensor_bytes(store: Store, rec: TensorRecord, fds: dict[str, int]) -> Iterator[bytes]:
    if rec.kind == KIND_TRUNK:
        h = xxhash.xxh3_64()
        fd = fds[store.trunk_path]
        for off, n in chunked(rec.offset, rec.nbytes):
            b = pread_full(fd, n, off, store.trunk_path)
            h.update(b)
            yield b
            os.posix_fadvise(fd, off, n, os.POSIX_FADV_DONTNEED)
        if h.intdigest() != rec.checksum:
            raise IntegrityError(f"trunk tensor {rec.name!r} fails its checksum",
                                 path=store.trunk_path, fix="run expertfs verify; repack again")
        return
    fd = fds[store.experts_path]
    for e in range(store.n_experts(rec.layer)):
        ext = store.extent(rec.layer, e)
        part = next(p for p in ext.parts if p.tensor_index == rec.index)
        off = ext.offset + part.rel_offset
        b = pread_full(fd, part.nbytes, off, store.experts_path)
        if xxhash.xxh3_64_intdigest(b) != part.checksum:
            raise IntegrityError(f"layer {rec.layer} expert {e} ({rec.name}) fails its checksum",
                                 path=store.experts_path, fix="run expertfs verify; repack again")
        yield b
        os.posix_fadvise(fd, off, part.nbytes, os.POSIX_FADV_DONTNEED)
