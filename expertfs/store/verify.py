"""``verify``: is a store sound? Structure, every checksum, and optionally the source's bytes.

Structure: every extent aligned and inside experts.bin, no two overlapping, every part on a
4 KiB boundary inside its extent, every expert of every MoE layer present, trunk tensors
aligned and inside trunk.bin, padding zero. Checksums: every part and trunk tensor re-read and
hashed. With ``source``: every byte equal to the GGUF it came from, metadata included.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import xxhash

from .fileio import chunked, pread_full, read_ranges
from ..formats.gguf_read import GGUFModel
from ..formats.gguf_split import read_model
from .layout import KIND_EXPERT, KIND_TRUNK, PART_ALIGN, Extent
from .repack import encode_kv_blob
from .reader import Store

__all__ = ["verify", "VerifyReport"]

_WINDOW = 32 << 20


@dataclass
class VerifyReport:
    store: str
    problems: list[str] = field(default_factory=list)
    extents: int = 0
    bytes_checked: int = 0
    source_checked: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, object]:
        return {"store": self.store, "ok": self.ok, "problems": self.problems,
                "extents": self.extents, "bytes_checked": self.bytes_checked,
                "source_checked": self.source_checked}


def verify(store_path: str, source: list[str] | None = None,
           progress: Callable[[int, int], None] | None = None) -> VerifyReport:
    with Store.open(store_path) as store:
        rep = VerifyReport(store.path)
        model = read_model(source) if source else None
        extents = sorted(store.extents(), key=lambda e: e.offset)
        rep.extents = len(extents)
        _structure(store, extents, rep)
        if model is not None:
            _compare_meta(store, model, rep)
        total = sum(e.length for e in extents) + sum(t.nbytes for t in store.tensors()
                                                       if t.kind == KIND_TRUNK)
        done = [0]

        def tick(n: int) -> None:
            done[0] += n
            rep.bytes_checked = done[0]
            if progress:
                progress(done[0], total)

        _check_experts(store, extents, model, rep, tick)
        _check_trunk(store, model, rep, tick)
        rep.source_checked = model is not None
        return rep


def _structure(store: Store, extents: list[Extent], rep: VerifyReport) -> None:
    size = os.path.getsize(store.experts_path)
    a = store.alignment
    tensors = {t.index: t for t in store.tensors()}
    seen: dict[int, set[int]] = {}
    prev_end, prev = 0, None
    for e in extents:
        name = f"layer {e.layer} expert {e.expert}"
        seen.setdefault(e.layer, set()).add(e.expert)
        if e.offset % a or e.length % a:
            rep.problems.append(f"{name}: extent {e.offset}+{e.length} not aligned to {a}")
        if e.offset + e.length > size:
            rep.problems.append(f"{name}: extent ends at {e.offset + e.length}, past experts.bin ({size})")
        if e.offset < prev_end:
            rep.problems.append(f"{name}: extent overlaps {prev}")
        prev_end, prev = e.offset + e.length, name
        end = 0
        for p in sorted(e.parts, key=lambda p: p.rel_offset):
            t = tensors.get(p.tensor_index)
            if p.rel_offset % PART_ALIGN or p.rel_offset < end or p.rel_offset + p.nbytes > e.length:
                rep.problems.append(f"{name}: {p.role.name.lower()} part at +{p.rel_offset} "
                                    f"({p.nbytes} B) misplaced in its {e.length} B extent")
            end = p.rel_offset + p.nbytes
            if t is None or t.kind != KIND_EXPERT or t.layer != e.layer or \
                    t.nbytes != p.nbytes * store.n_experts(e.layer) or t.ggml_type != p.ggml_type:
                rep.problems.append(f"{name}: {p.role.name.lower()} part disagrees with its tensor record")
    for layer in store.layers:
        missing = set(range(store.n_experts(layer))) - seen.get(layer, set())
        if missing:
            rep.problems.append(f"layer {layer}: {len(missing)} experts missing "
                                f"(first: {sorted(missing)[:8]})")
    extra = set(seen) - set(store.layers)
    if extra:
        rep.problems.append(f"extents for layers {sorted(extra)} that the summary does not list")
    tsize = os.path.getsize(store.trunk_path)
    prev_end = 0
    for t in sorted((t for t in tensors.values() if t.kind == KIND_TRUNK), key=lambda t: t.offset):
        if t.offset % a or t.offset < prev_end or t.offset + t.nbytes > tsize:
            rep.problems.append(f"trunk tensor {t.name!r} misplaced at {t.offset} ({t.nbytes} B)")
        prev_end = t.offset + t.nbytes
    if sorted(tensors) != list(range(len(tensors))):
        rep.problems.append("the tensor table has gaps in its order")


def _compare_meta(store: Store, model: GGUFModel, rep: VerifyReport) -> None:
    import zstandard
    if zstandard.ZstdDecompressor().decompress(encode_kv_blob(model)) != store.kv_blob():
        rep.problems.append("metadata differs from the source's")
    names = [t.name for t in sorted(store.tensors(), key=lambda t: t.index)]
    if names != [t.name for t in model.tensors]:
        rep.problems.append("tensor list differs from the source's")


def _check_experts(store: Store, extents: list[Extent], model: GGUFModel | None,
                   rep: VerifyReport, tick: Callable[[int], None]) -> None:
    groups: list[list[Extent]] = []
    for e in extents:                    # contiguous runs of extents, about one window each
        if groups and groups[-1][-1].offset + groups[-1][-1].length == e.offset and \
                groups[-1][-1].offset + groups[-1][-1].length - groups[-1][0].offset < _WINDOW:
            groups[-1].append(e)
        else:
            groups.append([e])
    ranges = [(g[0].offset, g[-1].offset + g[-1].length - g[0].offset) for g in groups]
    src_fds = [os.open(p, os.O_RDONLY) for p in model.paths] if model else []
    try:
        for g, (base, data) in zip(groups, read_ranges(store.experts_path, ranges)):
            mv = memoryview(data)
            for e in g:
                _check_extent(e, mv[e.offset - base:e.offset - base + e.length], model, src_fds, rep)
            tick(len(data))
    finally:
        for fd in src_fds:
            os.close(fd)


def _check_extent(e: Extent, mv: memoryview, model: GGUFModel | None, src_fds: list[int],
                  rep: VerifyReport) -> None:
    name = f"layer {e.layer} expert {e.expert}"
    pos = 0
    for p in sorted(e.parts, key=lambda p: p.rel_offset):
        body = mv[p.rel_offset:p.rel_offset + p.nbytes]
        if p.rel_offset > pos and any(mv[pos:p.rel_offset]):
            rep.problems.append(f"{name}: non-zero padding before its {p.role.name.lower()} part")
        pos = p.rel_offset + p.nbytes
        if xxhash.xxh3_64_intdigest(body) != p.checksum:
            rep.problems.append(f"{name}: {p.role.name.lower()} part fails its checksum")
        if model is not None:
            t = model.tensors[p.tensor_index]
            off = t.data_start + e.expert * p.nbytes
            if pread_full(src_fds[t.shard], p.nbytes, off, model.paths[t.shard]) != body:
                rep.problems.append(f"{name}: {p.role.name.lower()} part differs from {t.name} "
                                    "in the source")
    if any(mv[pos:]):
        rep.problems.append(f"{name}: non-zero padding at the end of its extent")


def _check_trunk(store: Store, model: GGUFModel | None, rep: VerifyReport,
                 tick: Callable[[int], None]) -> None:
    fd = os.open(store.trunk_path, os.O_RDONLY)
    src_fds = [os.open(p, os.O_RDONLY) for p in model.paths] if model else []
    try:
        for t in store.tensors():
            if t.kind != KIND_TRUNK:
                continue
            h = xxhash.xxh3_64()
            same = True
            for off, n in chunked(t.offset, t.nbytes):
                b = pread_full(fd, n, off, store.trunk_path)
                h.update(b)
                if model is not None and same:
                    st = model.tensors[t.index]
                    src = pread_full(src_fds[st.shard], n, st.data_start + off - t.offset,
                                     model.paths[st.shard])
                    same = src == b
                tick(n)
            if h.intdigest() != t.checksum:
                rep.problems.append(f"trunk tensor {t.name!r} fails its checksum")
            if not same:
                rep.problems.append(f"trunk tensor {t.name!r} differs from the source")
    finally:
        os.close(fd)
        for sfd in src_fds:
            os.close(sfd)
