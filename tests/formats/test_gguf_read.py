"""The validating GGUF reader: agreement with gguf-py, and every lie in a header caught."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from expertfs.errors import FormatError
from expertfs.formats.gguf_read import read_gguf
from expertfs.formats.gguf_split import read_model
from support.gguf_builders import moe_gguf


def test_agrees_with_gguf_py(tmp_path):
    f = moe_gguf(tmp_path / "m.gguf", nextn=1, biases=True)[0]
    ours, theirs = read_gguf(f), GGUFReader(f)
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.data_start == b.data_offset
        assert list(a.ne) == [int(x) for x in b.shape]
        assert int(a.ggml_type) == int(b.tensor_type)
        assert a.nbytes == b.n_bytes
    assert set(ours.kv) == {k for k in theirs.fields if not k.startswith("GGUF.")}
    assert ours.value("qwen3moe.expert_count") == 4
    assert ours.value("tokenizer.ggml.tokens")[:2] == ["t0", "t1"]
    assert ours.canonical


def _header(version=3, n_tensors=0, n_kv=0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    k = key.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<I", vtype) + payload


def _ti(name: str, ne: tuple[int, ...], gtype: int, offset: int) -> bytes:
    n = name.encode()
    return (struct.pack("<Q", len(n)) + n + struct.pack("<I", len(ne)) +
            struct.pack(f"<{len(ne)}Q", *ne) + struct.pack("<IQ", gtype, offset))


def _file(tmp_path: Path, data: bytes) -> Path:
    p = tmp_path / "bad.gguf"
    p.write_bytes(data)
    return p


BAD = {
    "empty": (b"", "bytes"),
    "wrong magic": (b"GGML" + bytes(40), "not a GGUF"),
    "version 1": (_header(version=1) + bytes(16), "version 1"),
    "big endian": (b"GGUF" + struct.pack(">I", 3) + bytes(16), "big-endian"),
    "truncated counts": (b"GGUF" + struct.pack("<I", 3) + bytes(10), "header alone"),
    "lying tensor count": (_header(n_tensors=1 << 40) + bytes(64), "more than the file"),
    "lying kv count": (_header(n_kv=1 << 40) + bytes(64), "more than the file"),
    "lying string length": (_header(n_kv=1) + struct.pack("<Q", 1 << 50) + bytes(32), "claims"),
    "unknown value type": (_header(n_kv=1) + _kv("a", 99, b"") + bytes(8), "unknown value type"),
    "nested array": (_header(n_kv=1) + _kv("a", 9, struct.pack("<IQ", 9, 1)) + bytes(8),
                     "array of arrays"),
    "lying array count": (_header(n_kv=1) + _kv("a", 9, struct.pack("<IQ", 4, 1 << 40)),
                          "more than the file"),
    "duplicate key": (_header(n_kv=2) + _kv("a", 4, b"\1\0\0\0") * 2, "twice"),
    "lying string in an array": (_header(n_kv=1) + _kv("a", 9, struct.pack("<IQ", 8, 2) + struct.pack(
        "<Q", 3) + b"abc" + struct.pack("<Q", 1 << 50)) + bytes(8), "element 1 of 'a' claims"),
    "string array cut short": (_header(n_kv=1) + _kv("a", 9, struct.pack("<IQ", 8, 3) + struct.pack(
        "<Q", 3) + b"abc" + struct.pack("<Q", 40)) + bytes(24), "element 1 of 'a' at byte"),
    "alignment not power of two": (_header(n_kv=1) + _kv("general.alignment", 4, struct.pack("<I", 48)),
                                   "power of two"),
    "alignment wrong type": (_header(n_kv=1) + _kv("general.alignment", 10, struct.pack("<Q", 32)),
                             "must be UINT32"),
    "unknown ggml type": (_header(n_tensors=1) + _ti("w", (32,), 31, 0) + bytes(64), "unknown or removed"),
    "too many dims": (_header(n_tensors=1) + _ti("w", (1, 1, 1, 1, 1), 0, 0) + bytes(64), "dimensions"),
    "dims overflow": (_header(n_tensors=1) + _ti("w", (1 << 40, 1 << 40), 0, 0) + bytes(64), "overflows"),
    "partial block": (_header(n_tensors=1) + _ti("w", (33, 2), 8, 0) + bytes(64), "block size"),
    "long name": (_header(n_tensors=1) + _ti("w" * 64, (1,), 0, 0) + bytes(64), "at most 63"),
    "offset past end": (_header(n_tensors=1) + _ti("w", (8,), 0, 1 << 20) + bytes(64), "past the end"),
    "unaligned offset": (_header(n_tensors=1) + _ti("w", (8,), 0, 3) + bytes(128), "multiple of the alignment"),
    "overlap": (_header(n_tensors=2) + _ti("a", (16,), 0, 0) + _ti("b", (16,), 0, 32) + bytes(256),
                "overlap"),
    "duplicate tensor": (_header(n_tensors=2) + _ti("a", (8,), 0, 0) + _ti("a", (8,), 0, 32) + bytes(256),
                         "twice"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_headers_are_named_errors(tmp_path, case):
    data, match = BAD[case]
    p = _file(tmp_path, data)
    with pytest.raises(FormatError, match=match) as ei:
        read_gguf(p)
    msg = str(ei.value)
    assert str(p) in msg and "\n" not in msg


def test_truncated_real_file(tmp_path):
    f = moe_gguf(tmp_path / "m.gguf")[0]
    data = f.read_bytes()
    for cut in (30, 200, len(data) // 2, len(data) - 1):
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(data[:cut])
        with pytest.raises(FormatError):
            read_gguf(p)


def test_missing_and_unreadable(tmp_path):
    with pytest.raises(FormatError, match="cannot open"):
        read_gguf(tmp_path / "nope.gguf")
    with pytest.raises(FormatError, match="directory"):
        read_gguf(tmp_path)


def test_split_missing_shard_and_wrong_first(tmp_path):
    files = moe_gguf(tmp_path / "m.gguf", layers=3, split_max_tensors=6)
    assert len(files) >= 3
    with pytest.raises(FormatError, match="missing shard"):
        read_model([str(files[0]), str(files[2])])
    files[1].unlink()
    with pytest.raises(FormatError, match="shard 2 of"):
        read_model(str(files[0]))


def test_split_shards_in_any_order(tmp_path):
    files = moe_gguf(tmp_path / "m.gguf", layers=3, split_max_tensors=6)
    a = read_model([str(files[0])] + [str(f) for f in reversed(files[1:])])
    b = read_model(str(files[0]))
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    assert "split.count" not in a.kv


_SEED_FILE: dict[str, bytes] = {}


def _seed() -> bytes:
    if "b" not in _SEED_FILE:
        import tempfile
        with tempfile.TemporaryDirectory() as d:
            f = moe_gguf(Path(d) / "s.gguf", layers=1, experts=2, hidden=32, ff=32)[0]
            _SEED_FILE["b"] = f.read_bytes()
    return _SEED_FILE["b"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 2047), st.integers(0, 255)), min_size=1, max_size=8),
       st.integers(0, 4096))
def test_fuzz_mutated_headers(tmp_path, mutations, cut):
    """Any mutation of a header gives a parse or a FormatError: never another exception."""
    data = bytearray(_seed())
    for pos, val in mutations:
        if pos < len(data):
            data[pos] = val
    data = bytes(data[: len(data) - cut]) if cut < len(data) else bytes(data[:24])
    p = tmp_path / "fuzz.gguf"
    p.write_bytes(data)
    try:
        g = read_gguf(p)
    except FormatError as e:
        assert "\n" not in str(e)
        return
    for t in g.tensors:
        assert t.data_start + t.nbytes <= len(data)
        assert np.isfinite(t.nbytes)
