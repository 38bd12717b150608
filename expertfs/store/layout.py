"""The store's records and their exact bytes (FORMAT.md is the spec; tests/store/test_golden.py pins it).

A store is a directory::

    STORE/experts.bin   every routed expert, one extent each, layer-major
    STORE/trunk.bin     every other tensor, each on its own aligned range
    STORE/index.lmdb/   LMDB: meta, tensors, experts, usage (see FORMAT.md)

Keys are big-endian so that LMDB's byte order is numeric order (a layer is a range scan);
values are little-endian fixed ``struct`` records.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ..formats.ggml import GGMLType
from ..formats.moe_names import Role

__all__ = ["FORMAT_VERSION", "PART_ALIGN", "Part", "Extent", "TensorRecord", "ExpertKey",
           "expert_key", "unpack_expert_key", "tensor_key", "pack_extent", "unpack_extent",
           "pack_tensor", "unpack_tensor", "pack_usage", "unpack_usage", "EXPERTS_FILE",
           "TRUNK_FILE", "INDEX_DIR", "KIND_TRUNK", "KIND_EXPERT"]

FORMAT_VERSION = 1
PART_ALIGN = 4096                 # every part of an extent starts on a 4 KiB boundary
EXPERTS_FILE = "experts.bin"
TRUNK_FILE = "trunk.bin"
INDEX_DIR = "index.lmdb"
KIND_TRUNK = 0
KIND_EXPERT = 1

_KEY2 = struct.Struct(">II")
_KEY1 = struct.Struct(">I")
_EXTENT = struct.Struct("<QQHHI")                  # offset, length, n_parts, 0, 0        (24 B)
_PART = struct.Struct("<BBHIII3QQQQ")              # role, n_dims, 0, type, tensor, 0,
                                                   # ne[3], rel_offset, nbytes, xxh3    (64 B)
_TENSOR = struct.Struct("<BBHIiI4QQQQ")            # kind, n_dims, name_len, type, layer, 0,
                                                   # ne[4], offset, nbytes, xxh3        (72 B)
_USAGE = struct.Struct("<Q")


@dataclass(frozen=True)
class ExpertKey:
    layer: int
    expert: int


@dataclass(frozen=True)
class Part:
    """One tensor slice of an expert: its bytes are ``extent.offset + rel_offset``, ``nbytes`` long."""

    role: Role
    ggml_type: GGMLType
    tensor_index: int            # the source tensor (its TensorRecord key)
    ne: tuple[int, ...]          # the per-expert slice's ggml dims (source ne without the last)
    rel_offset: int              # from the extent start; a multiple of PART_ALIGN
    nbytes: int                  # unpadded
    checksum: int                # xxh3_64 of the nbytes bytes


@dataclass(frozen=True)
class Extent:
    layer: int
    expert: int
    offset: int                  # in experts.bin; a multiple of the store alignment
    length: int                  # padded; a multiple of the store alignment
    parts: tuple[Part, ...]

    def part(self, role: Role) -> Part | None:
        return next((p for p in self.parts if p.role == role), None)


@dataclass(frozen=True)
class TensorRecord:
    """A source tensor. Trunk tensors live in trunk.bin at ``offset``; expert tensors are
    rebuilt from their parts (``offset`` and ``checksum`` are 0 for them)."""

    index: int                   # position in the source's tensor order
    name: str
    kind: int                    # KIND_TRUNK or KIND_EXPERT
    ggml_type: GGMLType
    ne: tuple[int, ...]
    layer: int                   # -1 when the tensor belongs to no block
    offset: int
    nbytes: int
    checksum: int


def expert_key(layer: int, expert: int) -> bytes:
    return _KEY2.pack(layer, expert)


def unpack_expert_key(b: bytes) -> ExpertKey:
    return ExpertKey(*_KEY2.unpack(b))


def tensor_key(index: int) -> bytes:
    return _KEY1.pack(index)


def pack_extent(e: Extent) -> bytes:
    out = [_EXTENT.pack(e.offset, e.length, len(e.parts), 0, 0)]
    for p in e.parts:
        ne = tuple(p.ne) + (0,) * (3 - len(p.ne))
        out.append(_PART.pack(p.role, len(p.ne), 0, p.ggml_type, p.tensor_index, 0, *ne,
                              p.rel_offset, p.nbytes, p.checksum))
    return b"".join(out)


def unpack_extent(key: bytes, b: bytes | memoryview) -> Extent:
    k = unpack_expert_key(bytes(key))
    offset, length, n, _, _ = _EXTENT.unpack_from(b, 0)
    if len(b) != _EXTENT.size + n * _PART.size:
        raise ValueError(f"extent record of {len(b)} bytes for {n} parts")
    parts = []
    for i in range(n):
        role, nd, _, t, ti, _, a, bb, c, rel, nbytes, h = _PART.unpack_from(b, _EXTENT.size + i * _PART.size)
        parts.append(Part(Role(role), GGMLType(t), ti, (a, bb, c)[:nd], rel, nbytes, h))
    return Extent(k.layer, k.expert, offset, length, tuple(parts))


def pack_tensor(t: TensorRecord) -> bytes:
    name = t.name.encode("utf-8", errors="surrogateescape")
    ne = tuple(t.ne) + (0,) * (4 - len(t.ne))
    return _TENSOR.pack(t.kind, len(t.ne), len(name), t.ggml_type, t.layer, 0, *ne,
                        t.offset, t.nbytes, t.checksum) + name


def unpack_tensor(key: bytes, b: bytes | memoryview) -> TensorRecord:
    kind, nd, nlen, typ, layer, _, a, bb, c, d, off, nbytes, h = _TENSOR.unpack_from(b, 0)
    if len(b) != _TENSOR.size + nlen:
        raise ValueError(f"tensor record of {len(b)} bytes for a {nlen}-byte name")
    name = bytes(b[_TENSOR.size:]).decode("utf-8", errors="surrogateescape")
    return TensorRecord(_KEY1.unpack(bytes(key))[0], name, kind, GGMLType(typ),
                        (a, bb, c, d)[:nd], layer, off, nbytes, h)


def pack_usage(count: int) -> bytes:
    return _USAGE.pack(count)


def unpack_usage(b: bytes) -> int:
    return _USAGE.unpack(b)[0]
