"""Validating GGUF reader: every number in a header is checked before it is trusted.

``read_gguf(path)`` parses one file (a split model's shards are joined by ``gguf_split``).
The parse follows
llama.cpp's ``gguf.cpp`` (the strictest reader in use) and uses gguf-py's enums for every type
id, so a file accepted here is one llama.cpp's loader would also parse. Tensor bytes are never
read here: ``TensorInfo.data_start`` says where they are.

gguf-py's ``GGUFReader`` is the oracle in tests, not the parser here: it builds a numpy view
per field (slow for 150k-token vocabularies) and trusts counts and offsets as written.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gguf.constants import GGUFValueType

from ..errors import FormatError
from .ggml import FILE_TYPES, MAX_DIMS, GGMLType, block_size, tensor_nbytes

__all__ = ["KVEntry", "TensorInfo", "GGUFFile", "GGUFModel", "read_gguf", "GGUF_MAGIC",
           "DEFAULT_ALIGNMENT", "MAX_NAME", "parse_kv_entries", "SCALAR_FORMATS", "NP_DTYPES"]

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32       # GGUF_DEFAULT_ALIGNMENT
MAX_NAME = 64                # GGML_MAX_NAME: a tensor name must be shorter
MAX_TENSORS = 1 << 22
MAX_KV = 1 << 20
MAX_STRING = 1 << 26         # 64 MiB: far above any real chat template or token
_U64 = struct.Struct("<Q")
_INT64_MAX = (1 << 63) - 1

#: struct format and numpy dtype of each scalar value type (little-endian)
SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
NP_DTYPES = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "<u1", GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8",
}


@dataclass(frozen=True)
class KVEntry:
    """One metadata pair. ``raw`` is the entry's exact bytes in the file (key, type, value)."""

    key: str
    vtype: GGUFValueType
    value: Any
    raw: bytes
    subtype: GGUFValueType | None = None


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ne: tuple[int, ...]          # ggml order: ne[0] is the row length
    ggml_type: GGMLType
    offset: int                  # relative to its shard's data section
    nbytes: int
    shard: int                   # index into GGUFModel.shards
    data_start: int              # absolute offset of the first byte in the shard file


@dataclass
class GGUFFile:
    path: str
    version: int
    kv: dict[str, KVEntry]
    tensors: list[TensorInfo]
    alignment: int
    data_offset: int
    size: int
    header_len: int              # bytes of header, KV and tensor infos (before padding)
    canonical: bool              # offsets are llama.cpp's packed running sum in info order

    def value(self, key: str, default: Any = None) -> Any:
        e = self.kv.get(key)
        return default if e is None else e.value


@dataclass
class GGUFModel:
    """A model read from one GGUF or from all shards of a split GGUF."""

    shards: list[GGUFFile]
    kv: dict[str, KVEntry]           # shard 0's metadata without the split.* keys
    tensors: list[TensorInfo]        # every shard's tensors, in shard then info order
    by_name: dict[str, TensorInfo] = field(repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.by_name = {t.name: t for t in self.tensors}

    def value(self, key: str, default: Any = None) -> Any:
        e = self.kv.get(key)
        return default if e is None else e.value

    @property
    def arch(self) -> str:
        return str(self.value("general.architecture", ""))

    def arch_value(self, suffix: str, default: Any = None) -> Any:
        return self.value(f"{self.arch}.{suffix}", default)

    @property
    def alignment(self) -> int:
        return self.shards[0].alignment

    @property
    def paths(self) -> list[str]:
        return [s.path for s in self.shards]

    @property
    def total_bytes(self) -> int:
        return sum(s.size for s in self.shards)


class _Cursor:
    __slots__ = ("buf", "pos", "path")

    def __init__(self, buf: memoryview, path: str) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def remaining(self) -> int:
        return len(self.buf) - self.pos

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or n > self.remaining():
            raise FormatError(
                f"truncated or lying header: {what} at byte {self.pos} needs {n} bytes but the file "
                f"has {self.remaining()} left", path=self.path,
                fix="the file is incomplete or damaged; download or convert it again")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str, what: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.unpack("<Q", f"length of {what}")
        if n > MAX_STRING:
            raise FormatError(f"{what} claims {n} bytes (limit {MAX_STRING})", path=self.path,
                              fix="the header is damaged; re-download or re-convert the model")
        return bytes(self.take(n, what)).decode("utf-8", errors="surrogateescape")


def parse_kv_entries(buf: bytes, path: str) -> dict[str, KVEntry]:
    """Metadata entries stored as ``uint64 count`` followed by GGUF-encoded entries."""
    cur = _Cursor(memoryview(buf), path)
    n = cur.unpack("<Q", "metadata count")
    kv: dict[str, KVEntry] = {}
    for _ in range(n):
        e = _read_kv(cur, kv)
        kv[e.key] = e
    if cur.remaining():
        raise _bad(path, f"{cur.remaining()} stray bytes after {n} metadata entries")
    return kv


def _bad(path: str, problem: str, fix: str = "the file is damaged or was not written by a "
         "GGUF writer; re-download or re-convert it") -> FormatError:
    return FormatError(problem, path=path, fix=fix)


def _value_type(cur: _Cursor, raw: int, key: str) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise _bad(cur.path, f"key {key!r} has unknown value type {raw}") from None


def _read_array(cur: _Cursor, key: str) -> tuple[Any, GGUFValueType]:
    sub = _value_type(cur, cur.unpack("<I", f"element type of {key!r}"), key)
    n = cur.unpack("<Q", f"element count of {key!r}")
    if sub == GGUFValueType.ARRAY:
        raise _bad(cur.path, f"key {key!r} is an array of arrays, which llama.cpp rejects")
    if sub == GGUFValueType.STRING:
        if n > cur.remaining() // 8:
            raise _bad(cur.path, f"key {key!r} claims {n} strings, more than the file can hold")
        return _strings(cur, n, key), sub
    width = struct.calcsize(SCALAR_FORMATS[sub])
    if n > cur.remaining() // width:
        raise _bad(cur.path, f"key {key!r} claims {n} elements, more than the file can hold")
    arr = np.frombuffer(cur.take(n * width, f"elements of {key!r}"), dtype=NP_DTYPES[sub]).copy()
    return (arr.astype(bool) if sub == GGUFValueType.BOOL else arr), sub


def _strings(cur: _Cursor, n: int, key: str) -> list[str]:
    """``n`` GGUF strings from ``cur``: what ``cur.string`` reads, in one tight loop (a
    vocabulary is 150k-300k of them and is parsed at every start). At the first element that
    is short or too long, ``cur.string`` reads it again and raises its error."""
    buf, pos, end = cur.buf, cur.pos, len(cur.buf)
    length = _U64.unpack_from
    out: list[str] = []
    append = out.append
    for i in range(n):
        ln = length(buf, pos)[0] if pos + 8 <= end else -1
        if ln < 0 or ln > MAX_STRING or ln > end - pos - 8:
            cur.pos = pos
            cur.string(f"element {i} of {key!r}")         # raises
        pos += 8
        append(bytes(buf[pos:pos + ln]).decode("utf-8", errors="surrogateescape"))
        pos += ln
    cur.pos = pos
    return out


def _read_kv(cur: _Cursor, seen: dict[str, KVEntry]) -> KVEntry:
    start = cur.pos
    key = cur.string("metadata key")
    vtype = _value_type(cur, cur.unpack("<I", f"type of key {key!r}"), key)
    sub = None
    if vtype == GGUFValueType.STRING:
        value: Any = cur.string(f"value of {key!r}")
    elif vtype == GGUFValueType.ARRAY:
        value, sub = _read_array(cur, key)
    else:
        value = cur.unpack(SCALAR_FORMATS[vtype], f"value of {key!r}")
    if key in seen:
        raise _bad(cur.path, f"metadata key {key!r} appears twice, which llama.cpp rejects")
    return KVEntry(key, vtype, value, bytes(cur.buf[start:cur.pos]), sub)


def _read_tensor_info(cur: _Cursor, i: int) -> tuple[str, tuple[int, ...], GGMLType, int]:
    name = cur.string(f"name of tensor {i}")
    if len(name.encode("utf-8", errors="surrogateescape")) >= MAX_NAME:
        raise _bad(cur.path, f"tensor name {name[:80]!r} is {len(name)} bytes; llama.cpp allows "
                   f"at most {MAX_NAME - 1}")
    n_dims = cur.unpack("<I", f"dimension count of {name!r}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise _bad(cur.path, f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
    ne = tuple(cur.unpack("<Q", f"dimension {d} of {name!r}") for d in range(n_dims))
    total = 1
    for d in ne:
        if d > _INT64_MAX or (d and total > _INT64_MAX // d):
            raise _bad(cur.path, f"tensor {name!r} has dimensions {ne} whose product overflows int64")
        total *= d
    raw_type = cur.unpack("<I", f"type of {name!r}")
    try:
        gtype = GGMLType(raw_type)
    except ValueError:
        gtype = None
    if gtype is None or gtype not in FILE_TYPES:
        raise _bad(cur.path, f"tensor {name!r} has ggml type id {raw_type}, which is unknown or "
                   "removed", fix="update expertfs or re-quantize the model with a current llama.cpp")
    if ne[0] % block_size(gtype):
        raise _bad(cur.path, f"tensor {name!r} has rows of {ne[0]} elements, not a multiple of the "
                   f"{gtype.name} block size {block_size(gtype)}")
    offset = cur.unpack("<Q", f"offset of {name!r}")
    return name, ne, gtype, offset


def _alignment(path: str, kv: dict[str, KVEntry]) -> int:
    e = kv.get("general.alignment")
    if e is None:
        return DEFAULT_ALIGNMENT
    if e.vtype != GGUFValueType.UINT32:
        raise _bad(path, f"general.alignment must be UINT32, found {e.vtype.name}")
    a = int(e.value)
    if a <= 0 or a & (a - 1):
        raise _bad(path, f"general.alignment is {a}; it must be a non-zero power of two")
    return a


def read_gguf(path: str | os.PathLike[str], shard: int = 0) -> GGUFFile:
    """Parse and validate one GGUF file's header, metadata and tensor table."""
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise FormatError(f"cannot open: {e.strerror}", path=path,
                          fix="check the path and its permissions") from None
    try:
        size = os.fstat(fd).st_size
        if os.path.isdir(path):
            raise FormatError("is a directory, not a GGUF file", path=path,
                              fix="pass the .gguf file (for a split model, its first shard)")
        if size < 24:
            raise _bad(path, f"only {size} bytes; a GGUF header alone is 24")
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mm:
            view = memoryview(mm)
            try:
                return _parse(path, view, size, shard)
            finally:
                view.release()
    finally:
        os.close(fd)


def _parse(path: str, buf: memoryview, size: int, shard: int) -> GGUFFile:
    cur = _Cursor(buf, path)
    magic = bytes(cur.take(4, "magic"))
    if magic != GGUF_MAGIC:
        raise _bad(path, f"magic is {magic!r}, not b'GGUF': this is not a GGUF file",
                   fix="pass a .gguf model file")
    version = cur.unpack("<I", "version")
    if version & 0xFFFF == 0 and version:
        raise _bad(path, "big-endian GGUF, which expertfs does not read",
                   fix="convert the model with the default little-endian byte order")
    if version not in (2, 3):
        raise _bad(path, f"GGUF version {version}; llama.cpp reads versions 2 and 3",
                   fix="re-convert the model with a current llama.cpp")
    n_tensors = cur.unpack("<Q", "tensor count")
    n_kv = cur.unpack("<Q", "metadata count")
    if n_tensors > MAX_TENSORS or n_tensors > cur.remaining() // 25:
        raise _bad(path, f"header claims {n_tensors} tensors, more than the file can describe")
    if n_kv > MAX_KV or n_kv > cur.remaining() // 13:
        raise _bad(path, f"header claims {n_kv} metadata entries, more than the file can hold")
    kv: dict[str, KVEntry] = {}
    for _ in range(n_kv):
        e = _read_kv(cur, kv)
        kv[e.key] = e
    alignment = _alignment(path, kv)
    infos = []
    seen: set[str] = set()
    for i in range(n_tensors):
        name, ne, gtype, offset = _read_tensor_info(cur, i)
        if name in seen:
            raise _bad(path, f"tensor name {name!r} appears twice, which llama.cpp rejects")
        seen.add(name)
        infos.append((name, ne, gtype, offset))
    header_len = cur.pos
    data_offset = -(-header_len // alignment) * alignment
    tensors = []
    expected = 0
    canonical = True
    for name, ne, gtype, offset in infos:
        nbytes = tensor_nbytes(gtype, ne)
        if offset % alignment:
            raise _bad(path, f"tensor {name!r} has offset {offset}, not a multiple of the "
                       f"alignment {alignment}")
        if data_offset + offset + nbytes > size:
            raise _bad(path, f"tensor {name!r} ({nbytes} bytes at data offset {offset}) ends past "
                       f"the end of the file ({size} bytes)",
                       fix="the file is truncated; download or convert it again")
        canonical &= offset == expected
        expected += -(-nbytes // alignment) * alignment
        tensors.append(TensorInfo(name, ne, gtype, offset, nbytes, shard, data_offset + offset))
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors if t.nbytes)
    for (_, a_end, a), (b_start, _, b) in zip(spans, spans[1:]):
        if b_start < a_end:
            raise _bad(path, f"tensors {a!r} and {b!r} overlap in the data section")
    return GGUFFile(path, version, kv, tensors, alignment, data_offset, size, header_len, canonical)
