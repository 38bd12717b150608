"""Opening a store for reading: the index once, read-only, and the two data files' paths.

``Store.open`` refuses anything that is not a complete store of this format version with a
``StoreError`` that says what is wrong and what to do. Extents are looked up from memory after
the first touch of their layer (one LMDB range scan per layer).
"""

from __future__ import annotations

import functools
import json
import os
import struct
from typing import Any, Iterator

import zstandard

from ..errors import StoreError
from ..formats.gguf_read import KVEntry, parse_kv_entries
from .index import Index
from .layout import (EXPERTS_FILE, FORMAT_VERSION, INDEX_DIR, KIND_TRUNK, TRUNK_FILE, Extent,
                     TensorRecord)

__all__ = ["Store", "is_store"]


def is_store(path: str) -> bool:
    return os.path.isdir(os.path.join(path, INDEX_DIR))


@functools.lru_cache(maxsize=4)
def _parsed_kv(raw: bytes, path: str) -> dict[str, KVEntry]:
    """``raw`` (the index's compressed metadata blob) parsed (``Store.gguf_kv``)."""
    return parse_kv_entries(zstandard.ZstdDecompressor().decompress(raw), path)


class Store:
    def __init__(self, path: str, index: Index) -> None:
        self.path = path
        self.index = index
        self.experts_path = os.path.join(path, EXPERTS_FILE)
        self.trunk_path = os.path.join(path, TRUNK_FILE)
        self.summary: dict[str, Any] = json.loads(index.meta("summary") or b"{}")
        self.alignment: int = int(self.summary["alignment"])
        self._layers = {int(lay["layer"]): lay for lay in self.summary["layers"]}
        self._extents: dict[int, dict[int, Extent]] = {}
        self._tensors: list[TensorRecord] | None = None

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> "Store":
        path = os.path.abspath(os.fspath(path))
        if not os.path.exists(path):
            partial = path + ".partial"
            hint = (" (an unfinished repack is in " + partial + "; run the same repack again to "
                    "resume it)") if os.path.isdir(partial) else ""
            raise StoreError("no such store" + hint, path=path,
                             fix="check the path, or create the store with expertfs repack")
        if not os.path.isdir(path) or not is_store(path):
            raise StoreError("not an expertfs store (no index.lmdb inside)", path=path,
                             fix="pass a folder made by expertfs repack")
        index = Index.open(os.path.join(path, INDEX_DIR))
        try:
            _check(path, index)
            return cls(path, index)
        except BaseException:
            index.close()
            raise

    def close(self) -> None:
        self.index.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- geometry -----------------------------------------------------------------------------

    @property
    def layers(self) -> list[int]:
        """Layers with routed experts (the NextN block's included), ascending."""
        return sorted(self._layers)

    def n_experts(self, layer: int) -> int:
        return int(self._layers[layer]["experts"])

    def layer_info(self, layer: int) -> dict[str, Any]:
        return self._layers[layer]

    @property
    def architecture(self) -> str:
        return str(self.summary.get("architecture", ""))

    # --- records ------------------------------------------------------------------------------

    def extent(self, layer: int, expert: int) -> Extent:
        table = self._extents.get(layer)
        if table is None:
            table = self._extents[layer] = {e.expert: e for e in self.index.extents(layer)}
        try:
            return table[expert]
        except KeyError:
            raise StoreError(f"no extent for layer {layer}, expert {expert}", path=self.path,
                             fix="run expertfs verify; the index is incomplete") from None

    def extents(self) -> Iterator[Extent]:
        return self.index.extents()

    def tensors(self) -> list[TensorRecord]:
        if self._tensors is None:
            self._tensors = self.index.tensors()
        return self._tensors

    def trunk_tensors(self) -> dict[str, TensorRecord]:
        return {t.name: t for t in self.tensors() if t.kind == KIND_TRUNK}

    def gguf_kv(self) -> dict[str, KVEntry]:
        """The source's metadata, parsed once a process per blob (a ``run`` asks for it from
        the model config, the tokenizer and the memory model; a vocabulary's strings take a
        quarter of a second to parse); a fresh dict each call, the entries shared (frozen)."""
        return dict(_parsed_kv(self._kv_raw(), self.path))

    def kv_blob(self) -> bytes:
        """The source's metadata as GGUF encodes it: ``uint64 count`` then the entries."""
        return zstandard.ZstdDecompressor().decompress(self._kv_raw())

    def _kv_raw(self) -> bytes:
        raw = self.index.meta("gguf_kv")
        if raw is None:
            raise StoreError("the index has no GGUF metadata", path=self.path,
                             fix="the store is damaged; run expertfs repack again")
        return bytes(raw)

    @property
    def gguf_version(self) -> int:
        v = self.index.meta("gguf_version")
        return struct.unpack("<I", v)[0] if v else 3


def _check(path: str, index: Index) -> None:
    v = index.meta("format_version")
    if v is None or index.meta("complete") != b"1":
        raise StoreError("the store is incomplete", path=path,
                         fix="run expertfs repack again to rebuild it")
    version = struct.unpack("<I", v)[0]
    if version != FORMAT_VERSION:
        raise StoreError(f"store format version {version}; this expertfs reads version "
                         f"{FORMAT_VERSION}", path=path,
                         fix="repack the model with this version of expertfs")
    summary = json.loads(index.meta("summary") or b"{}")
    for name, key in ((EXPERTS_FILE, "experts_file_bytes"), (TRUNK_FILE, "trunk_file_bytes")):
        p = os.path.join(path, name)
        if not os.path.isfile(p):
            raise StoreError(f"{name} is missing", path=path, fix="repack the model again")
        size = os.path.getsize(p)
        if size != summary.get(key):
            raise StoreError(f"{name} is {size} bytes, the index says {summary.get(key)}",
                             path=p, fix="the file was truncated or replaced; repack again")
