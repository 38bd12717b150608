"""Streaming GGUF writer that satisfies llama.cpp's strict reader.

Tensor data is pulled from a callback one chunk at a time, so a model of any size is written
with bounded memory. Offsets are llama.cpp's rule: in tensor-info order, each the packed running
sum of ``pad(nbytes, alignment)``; the data section starts at ``pad(header, alignment)``; every
pad byte is zero. The output appears under its final name only once complete.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import numpy as np
from gguf.constants import GGUFValueType

from .ggml import GGMLType, tensor_nbytes
from .gguf_read import DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_NAME, NP_DTYPES as _NP, SCALAR_FORMATS as _FMT

__all__ = ["TensorSpec", "encode_kv", "encode_string", "header_bytes", "write_gguf", "pad_to",
           "shard_name"]


def pad_to(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def shard_name(prefix: str, no: int, count: int) -> str:
    """``shard_name("m", 0, 3)`` → ``"m-00001-of-00003.gguf"`` (gguf-py's SHARD_NAME_FORMAT)."""
    return f"{prefix}-{no + 1:05d}-of-{count:05d}.gguf"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    ne: tuple[int, ...]          # ggml order
    ggml_type: GGMLType

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.ggml_type, self.ne)


def encode_string(s: str | bytes) -> bytes:
    b = s.encode("utf-8", errors="surrogateescape") if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def _infer(value: Any) -> GGUFValueType:
    if isinstance(value, (bool, np.bool_)):
        return GGUFValueType.BOOL
    if isinstance(value, str):
        return GGUFValueType.STRING
    if isinstance(value, (int, np.integer)):
        return GGUFValueType.UINT32 if 0 <= value < 1 << 32 else GGUFValueType.INT64
    if isinstance(value, (float, np.floating)):
        return GGUFValueType.FLOAT32
    if isinstance(value, (list, tuple, np.ndarray)):
        return GGUFValueType.ARRAY
    raise TypeError(f"cannot infer a GGUF type for {type(value).__name__}")


def _encode_value(value: Any, vtype: GGUFValueType, subtype: GGUFValueType | None) -> bytes:
    if vtype == GGUFValueType.STRING:
        return encode_string(value)
    if vtype != GGUFValueType.ARRAY:
        return struct.pack(_FMT[vtype], value)
    items = list(value) if not isinstance(value, np.ndarray) else value
    if len(items) == 0:
        raise ValueError("GGUF arrays must not be empty")
    if subtype is None:
        subtype = _infer(items[0])
    if subtype == GGUFValueType.ARRAY:
        raise ValueError("nested GGUF arrays are rejected by llama.cpp")
    head = struct.pack("<IQ", subtype, len(items))
    if subtype == GGUFValueType.STRING:
        return head + b"".join(encode_string(s) for s in items)
    return head + np.asarray(items).astype(_NP[subtype]).tobytes()


def encode_kv(key: str, value: Any, vtype: GGUFValueType | None = None,
              subtype: GGUFValueType | None = None) -> bytes:
    """One metadata entry as it appears in a file: key string, uint32 type, value."""
    vtype = _infer(value) if vtype is None else vtype
    return encode_string(key) + struct.pack("<I", vtype) + _encode_value(value, vtype, subtype)


def header_bytes(kv: Sequence[bytes], tensors: Sequence[TensorSpec],
                 alignment: int = DEFAULT_ALIGNMENT, version: int = 3) -> tuple[bytes, list[int]]:
    """The padded header (up to the data section) and each tensor's data-relative offset."""
    out = bytearray(GGUF_MAGIC + struct.pack("<IQQ", version, len(tensors), len(kv)))
    for e in kv:
        out += e
    offsets, off = [], 0
    for t in tensors:
        if len(t.name.encode()) >= MAX_NAME:
            raise ValueError(f"tensor name {t.name!r} is longer than llama.cpp allows")
        out += encode_string(t.name) + struct.pack("<I", len(t.ne))
        out += struct.pack(f"<{len(t.ne)}Q", *t.ne)
        out += struct.pack("<IQ", t.ggml_type, off)
        offsets.append(off)
        off += pad_to(t.nbytes, alignment)
    out += bytes(pad_to(len(out), alignment) - len(out))
    return bytes(out), offsets


ChunkSource = Callable[[int, TensorSpec], Iterable[bytes | bytearray | memoryview | np.ndarray]]


def write_gguf(path: str | os.PathLike[str], kv: Sequence[bytes], tensors: Sequence[TensorSpec],
               chunks: ChunkSource, alignment: int = DEFAULT_ALIGNMENT,
               progress: Callable[[int], None] | None = None, drop_cache: bool = False,
               version: int = 3) -> int:
    """Write a GGUF to ``path`` (via ``path + '.partial'``); returns the file size.

    ``chunks(i, spec)`` yields tensor ``i``'s bytes in order; their total must equal its size.
    ``drop_cache`` syncs and drops written pages every 256 MiB, so writing a model larger than
    RAM does not push everything else out of the page cache.
    """
    path = os.fspath(path)
    tmp = path + ".partial"
    head, _ = header_bytes(kv, tensors, alignment, version)
    flushed = 0
    try:
        with open(tmp, "wb", buffering=0) as f:
            fd = f.fileno()
            f.write(head)
            pos = len(head)
            for i, spec in enumerate(tensors):
                want, got = spec.nbytes, 0
                for c in chunks(i, spec):
                    mv = memoryview(c).cast("B") if not isinstance(c, np.ndarray) else \
                        memoryview(np.ascontiguousarray(c)).cast("B")
                    f.write(mv)
                    got += len(mv)
                    if progress:
                        progress(len(mv))
                if got != want:
                    raise ValueError(f"tensor {spec.name!r}: wrote {got} bytes, expected {want}")
                padn = pad_to(want, alignment) - want
                f.write(bytes(padn))
                pos += want + padn
                if drop_cache and pos - flushed >= 256 << 20:
                    os.fdatasync(fd)
                    os.posix_fadvise(fd, 0, pos, os.POSIX_FADV_DONTNEED)
                    flushed = pos
            os.fsync(fd)
            if drop_cache:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.replace(tmp, path)
        return pos
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
