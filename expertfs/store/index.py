"""The store's LMDB index: metadata, tensor table, expert extents and the usage table.

One environment, four named databases (FORMAT.md): ``meta`` (string keys), ``tensors``
(``>I`` source order → TensorRecord), ``experts`` (``>II`` layer, expert → Extent) and ``usage``
(``>II`` → count, empty after repack, filled by the runtime). Big-endian keys make a layer one
contiguous range. The runtime opens it read-only once; only the repack writer and the usage
recorder write.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Iterable, Iterator

import lmdb

from ..errors import StoreError
from .layout import (Extent, TensorRecord, expert_key, pack_extent, pack_tensor, pack_usage,
                     tensor_key, unpack_expert_key, unpack_extent, unpack_tensor, unpack_usage)

__all__ = ["Index", "META", "TENSORS", "EXPERTS", "USAGE", "USAGE_DYNAMICS"]

META, TENSORS, EXPERTS, USAGE = b"meta", b"tensors", b"experts", b"usage"
#: the meta key of the runs' routing counters, a JSON object of counts merged by addition
USAGE_DYNAMICS = "usage_dynamics"
_WRITE_MAP_SIZE = 1 << 32        # a ceiling, not an allocation: data.mdb grows as written
# py-lmdb allows one Environment per file per process: read-only opens share it, refcounted.
_SHARED: dict[str, list] = {}
_SHARED_LOCK = threading.Lock()


class Index:
    def __init__(self, env: lmdb.Environment, path: str, shared_key: str | None = None) -> None:
        self.env, self.path, self._shared_key = env, path, shared_key
        ro = env.flags()["readonly"]
        self._meta = env.open_db(META, create=not ro)
        self._tensors = env.open_db(TENSORS, create=not ro)
        self._experts = env.open_db(EXPERTS, create=not ro)
        self._usage = env.open_db(USAGE, create=not ro)

    @classmethod
    def create(cls, path: str) -> "Index":
        os.makedirs(path, exist_ok=True)
        env = lmdb.open(path, map_size=_WRITE_MAP_SIZE, max_dbs=4, subdir=True, sync=True,
                        metasync=True, readahead=False, meminit=False)
        return cls(env, path)

    @classmethod
    def open(cls, path: str, write: bool = False) -> "Index":
        if not os.path.isdir(path) or not os.path.exists(os.path.join(path, "data.mdb")):
            raise StoreError("no index (index.lmdb/data.mdb is missing)", path=path,
                             fix="this is not a complete expertfs store; run expertfs repack")
        if not write:
            key = os.path.realpath(path)
            with _SHARED_LOCK:
                if key in _SHARED:
                    _SHARED[key][1] += 1
                    return cls(_SHARED[key][0], path, key)
                idx = cls._open_env(path, write)
                _SHARED[key] = [idx.env, 1]
                idx._shared_key = key
                return idx
        return cls._open_env(path, write)

    @classmethod
    def _open_env(cls, path: str, write: bool) -> "Index":
        try:
            env = lmdb.open(path, readonly=not write, max_dbs=4, subdir=True, create=False,
                            lock=True, readahead=False, map_size=_WRITE_MAP_SIZE if write else 0)
        except lmdb.ReadonlyError:
            env = lmdb.open(path, readonly=True, max_dbs=4, subdir=True, create=False, lock=False,
                            readahead=False)
        except lmdb.Error as e:
            raise StoreError(f"cannot open the LMDB index: {e}", path=path,
                             fix="the store is damaged; run expertfs repack again") from None
        try:
            return cls(env, path)
        except lmdb.Error as e:
            env.close()
            raise StoreError(f"the LMDB index lacks its tables: {e}", path=path,
                             fix="the store is damaged; run expertfs repack again") from None

    def close(self) -> None:
        if self._shared_key is not None:
            with _SHARED_LOCK:
                entry = _SHARED.get(self._shared_key)
                if entry is not None and entry[0] is self.env:
                    entry[1] -= 1
                    if entry[1] > 0:
                        return
                    del _SHARED[self._shared_key]
        self.env.close()

    def __enter__(self) -> "Index":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- writing -----------------------------------------------------------------------------

    def commit(self, *, meta: dict[str, bytes] | None = None, tensors: Iterable[TensorRecord] = (),
               extents: Iterable[Extent] = (), delete_meta: Iterable[str] = ()) -> None:
        """Write records in one durable transaction: all of them or none."""
        with self.env.begin(write=True) as txn:
            for t in tensors:
                txn.put(tensor_key(t.index), pack_tensor(t), db=self._tensors)
            for e in extents:
                txn.put(expert_key(e.layer, e.expert), pack_extent(e), db=self._experts)
            for k, v in (meta or {}).items():
                txn.put(k.encode(), v, db=self._meta)
            for k in delete_meta:
                txn.delete(k.encode(), db=self._meta)

    def add_usage(self, counts: dict[tuple[int, int], int],
                  dynamics: dict[str, int] | None = None) -> None:
        """Add a run's route counts, and its ``dynamics`` counters (``usage_dynamics``), to
        what earlier runs left, in one transaction."""
        with self.env.begin(write=True) as txn:
            for (layer, expert), n in counts.items():
                k = expert_key(layer, expert)
                old = txn.get(k, db=self._usage)
                txn.put(k, pack_usage(n + (unpack_usage(old) if old else 0)), db=self._usage)
            if dynamics:
                old = txn.get(USAGE_DYNAMICS.encode(), db=self._meta)
                merged = json.loads(bytes(old)) if old else {}
                for name, n in dynamics.items():
                    merged[name] = int(merged.get(name, 0)) + int(n)
                txn.put(USAGE_DYNAMICS.encode(), json.dumps(merged).encode(), db=self._meta)

    # --- reading -----------------------------------------------------------------------------

    def meta(self, key: str) -> bytes | None:
        with self.env.begin() as txn:
            v = txn.get(key.encode(), db=self._meta)
            return None if v is None else bytes(v)

    def tensors(self) -> list[TensorRecord]:
        with self.env.begin() as txn:
            return [unpack_tensor(k, v) for k, v in txn.cursor(db=self._tensors)]

    def tensor(self, index: int) -> TensorRecord | None:
        k = tensor_key(index)
        with self.env.begin() as txn:
            v = txn.get(k, db=self._tensors)
            return None if v is None else unpack_tensor(k, v)

    def extent(self, layer: int, expert: int) -> Extent | None:
        k = expert_key(layer, expert)
        with self.env.begin() as txn:
            v = txn.get(k, db=self._experts)
            return None if v is None else unpack_extent(k, v)

    def extents(self, layer: int | None = None) -> Iterator[Extent]:
        """Every extent in (layer, expert) order, or one layer's by a range scan."""
        with self.env.begin() as txn:
            cur = txn.cursor(db=self._experts)
            start = expert_key(layer, 0) if layer is not None else b""
            if not cur.set_range(start):
                return
            for k, v in cur:
                e = unpack_extent(k, v)
                if layer is not None and e.layer != layer:
                    break
                yield e

    def usage(self) -> dict[tuple[int, int], int]:
        with self.env.begin() as txn:
            out = {}
            for k, v in txn.cursor(db=self._usage):
                key = unpack_expert_key(bytes(k))
                out[(key.layer, key.expert)] = unpack_usage(v)
            return out

    def usage_dynamics(self) -> dict[str, int]:
        """Counters of how earlier runs routed token after token (``runtime.cache.usage``)."""
        v = self.meta(USAGE_DYNAMICS)
        try:
            d = json.loads(v) if v else {}
            return {str(k): int(n) for k, n in d.items()} if isinstance(d, dict) else {}
        except (ValueError, TypeError):
            return {}

    def counts(self) -> dict[str, int]:
        with self.env.begin() as txn:
            return {"tensors": txn.stat(self._tensors)["entries"],
                    "experts": txn.stat(self._experts)["entries"],
                    "usage": txn.stat(self._usage)["entries"]}

