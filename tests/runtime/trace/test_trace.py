"""Routing-trace format: golden bytes, round trips (sync and async writers), damaged files."""

from __future__ import annotations

import asyncio
import os
import struct

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from expertfs.errors import ExpertfsError, FormatError
from expertfs.runtime.trace.file import (TRACE_VERSION, TraceChunk, TraceError, TraceHeader, TraceReader,
                                    TraceWriter, read_trace)
from expertfs.runtime.trace.async_writer import AsyncTraceWriter

TINY = TraceHeader(2, 8, 2, (4096, 8192), n_draft=1, meta={"model": "tiny"})

GOLDEN_HEADER = bytes.fromhex(
    "4546535452414345"      # magic "EFSTRACE"
    "0100" "0000"           # version 1, flags 0
    "02000000" "08000000"   # n_layers 2, n_experts 8
    "0200" "0100"           # k 2, n_draft 1
    "10000000" "00000000"   # meta_len 16, reserved
    "0010000000000000"      # expert_bytes[0] = 4096
    "0020000000000000"      # expert_bytes[1] = 8192
    "7b226d6f64656c223a2274696e79227d"   # {"model":"tiny"}
    "68cb87e12419a4e1")     # xxh3_64 of the above

GOLDEN_RAW = bytes.fromhex(
    "00000000" "00000000"   # token u32[2]: 0, 0
    "0000" "0100"           # layer u16[2]: 0, 1
    "00" "01"               # n_valid u8[2]: 0, 1
    "01000500" "07000000"   # experts u16[2,2]: [1, 5], [7, 0]
    "003a0034" "00380038"   # weights f16[2,2]: [0.75, 0.25], [0.5, 0.5]
    "00000000" "02000300"   # draft_experts u16[2,1,2]: [[0, 0]], [[2, 3]]
    "00000000" "003c0000")  # draft_weights f16[2,1,2]: [[0, 0]], [[1, 0]]

#: A whole version-1 file as written by expertfs 0.1: every future reader must still read it.
GOLDEN_FILE = bytes.fromhex(
    "4546535452414345010000000200000008000000020001001000000000000000001000000000000000200000"
    "000000007b226d6f64656c223a2274696e79227d68cb87e12419a4e145465443020000002f00000006095cd4"
    "886fb00c28b52ffd202e350100d000000100000101000500073a00340038003802000300003c000004002a31"
    "5cc2cc0c8700584546544502000000000000000100000000000000")


def _write_tiny(path: str) -> None:
    with TraceWriter(path, TINY) as w:
        w.add(0, 0, [1, 5], [0.75, 0.25])
        w.add(0, 1, [7, 0], [0.5, 0.5], [[2, 3]], [[1.0, 0.0]])


def test_golden_header_bytes() -> None:
    assert TRACE_VERSION == 1
    assert TINY.pack() == GOLDEN_HEADER


def test_golden_chunk_and_end(tmp_path) -> None:
    p = tmp_path / "t.eftrace"
    _write_tiny(p)
    b = p.read_bytes()
    assert b.startswith(GOLDEN_HEADER)
    tag, n, comp_len, digest = struct.unpack_from("<4sIIQ", b, len(GOLDEN_HEADER))
    assert (tag, n) == (b"EFTC", 2)
    start = len(GOLDEN_HEADER) + 20
    assert zstandard.ZstdDecompressor().decompress(b[start:start + comp_len]) == GOLDEN_RAW
    assert b[start + comp_len:] == bytes.fromhex("45465445" "0200000000000000" "01000000" "00000000")


def test_golden_file_reads(tmp_path) -> None:
    p = tmp_path / "golden.eftrace"
    p.write_bytes(GOLDEN_FILE)
    h, c = read_trace(p)
    assert h == TINY
    assert c.tokens.tolist() == [0, 0] and c.layers.tolist() == [0, 1]
    assert c.experts.tolist() == [[1, 5], [7, 0]]
    assert c.weights.tolist() == [[0.75, 0.25], [0.5, 0.5]]
    assert c.n_valid.tolist() == [0, 1] and c.draft_experts[1, 0].tolist() == [2, 3]


def _random_chunk(h: TraceHeader, n: int, seed: int) -> TraceChunk:
    rng = np.random.default_rng(seed)
    experts = np.argsort(rng.random((n, h.n_experts)), axis=1)[:, :h.k].astype(np.uint16)
    weights = rng.random((n, h.k)).astype(np.float16)
    layers = rng.choice([i for i, b in enumerate(h.expert_bytes) if b], n).astype(np.uint16)
    d = h.n_draft
    return TraceChunk(np.arange(n, dtype=np.uint32) // 3, layers,
                      rng.integers(0, d + 1, n).astype(np.uint8), experts, weights,
                      rng.integers(0, h.n_experts, (n, d, h.k)).astype(np.uint16) if d else None,
                      rng.random((n, d, h.k)).astype(np.float16) if d else None)


def _assert_same(a: TraceChunk, b: TraceChunk) -> None:
    for x, y in zip(a.__dict__.values(), b.__dict__.values()):
        assert (x is None and y is None) or np.array_equal(x, y)


@pytest.mark.parametrize("n_draft", [0, 2])
@pytest.mark.parametrize("n", [1, 99, 100, 101, 350])
def test_round_trip_many_chunks(tmp_path, n_draft: int, n: int) -> None:
    h = TraceHeader(4, 32, 4, (0, 10, 20, 30), n_draft=n_draft)
    c = _random_chunk(h, n, seed=n)
    p = tmp_path / "t.eftrace"
    with TraceWriter(p, h, chunk_rows=100) as w:
        w.add_chunk(c)
    with TraceReader(p) as r:
        sizes = [len(x) for x in r.chunks()]
        assert r.complete
    assert sizes == [100] * (n // 100) + ([n % 100] if n % 100 else [])
    h2, c2 = read_trace(p)
    assert h2 == h
    _assert_same(c, c2)


def test_row_writes_equal_column_writes(tmp_path) -> None:
    h = TraceHeader(4, 32, 4, (0, 10, 20, 30), n_draft=2)
    c = _random_chunk(h, 77, seed=1)
    with TraceWriter(tmp_path / "a", h, chunk_rows=10) as w:
        w.add_chunk(c)
    with TraceWriter(tmp_path / "b", h, chunk_rows=10) as w:
        for i in range(len(c)):
            d = int(c.n_valid[i])
            w.add(int(c.tokens[i]), int(c.layers[i]), c.experts[i], c.weights[i],
                  c.draft_experts[i, :d], c.draft_weights[i, :d])
    _, a = read_trace(tmp_path / "a")
    _, b = read_trace(tmp_path / "b")
    np.testing.assert_array_equal(a.experts, b.experts)
    for i in range(len(a)):    # rows past n_valid are stored as zeros by the row writer
        d = int(a.n_valid[i])
        np.testing.assert_array_equal(a.draft_experts[i, :d], b.draft_experts[i, :d])


@settings(max_examples=25, deadline=None)
@given(n_layers=st.integers(1, 5), n_experts=st.integers(1, 70), k=st.integers(1, 8),
       n_draft=st.integers(0, 3), n=st.integers(0, 40), seed=st.integers(0, 2**16))
def test_round_trip_property(tmp_path_factory, n_layers, n_experts, k, n_draft, n, seed) -> None:
    k = min(k, n_experts)
    h = TraceHeader(n_layers, n_experts, k, tuple(range(1, n_layers + 1)), n_draft=n_draft)
    c = _random_chunk(h, n, seed)
    p = tmp_path_factory.mktemp("prop") / "t"
    with TraceWriter(p, h, chunk_rows=16) as w:
        w.add_chunk(c)
    _, c2 = read_trace(p)
    assert len(c2) == n
    if n:
        _assert_same(c, c2)


def test_async_writer_bytes_equal_sync(tmp_path) -> None:
    h = TraceHeader(4, 32, 4, (0, 10, 20, 30), n_draft=2, meta={"w": "async"})
    c = _random_chunk(h, 203, seed=7)
    rows = [(int(c.tokens[i]), int(c.layers[i]), c.experts[i], c.weights[i],
             c.draft_experts[i, :int(c.n_valid[i])], c.draft_weights[i, :int(c.n_valid[i])])
            for i in range(len(c))]
    with TraceWriter(tmp_path / "sync", h, chunk_rows=16) as w:
        for r in rows:
            w.add(*r)

    async def record() -> int:
        ticks = 0

        async def ticker() -> None:      # the loop keeps running while chunks are written
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        t = asyncio.create_task(ticker())
        async with AsyncTraceWriter(tmp_path / "async", h, chunk_rows=16, max_pending=1) as w:
            for r in rows:
                await w.add(*r)
        t.cancel()
        return ticks

    assert asyncio.run(record()) > 0
    assert (tmp_path / "sync").read_bytes() == (tmp_path / "async").read_bytes()


def test_async_writer_reports_background_failure(tmp_path, monkeypatch) -> None:
    import expertfs.runtime.trace.async_writer as ta

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ta, "encode_chunk", boom)

    async def record() -> None:
        async with AsyncTraceWriter(tmp_path / "t", TINY, chunk_rows=1, max_pending=1) as w:
            for t in range(50):
                await w.add(t, 0, [1, 2], [0.5, 0.5])

    with pytest.raises(OSError, match="No space"):
        asyncio.run(record())
    with pytest.raises(TraceError, match="truncated"):     # the file says it was not finished
        read_trace(tmp_path / "t")


def test_writer_error_leaves_an_unfinished_file(tmp_path) -> None:
    with pytest.raises(RuntimeError):
        with TraceWriter(tmp_path / "s", TINY, chunk_rows=1) as w:
            w.add(0, 0, [1, 2], [0.5, 0.5])
            raise RuntimeError("producer failed")

    async def record() -> None:
        async with AsyncTraceWriter(tmp_path / "a", TINY, chunk_rows=1) as w:
            await w.add(0, 0, [1, 2], [0.5, 0.5])
            raise RuntimeError("producer failed")

    with pytest.raises(RuntimeError):
        asyncio.run(record())
    for name in ("s", "a"):
        with pytest.raises(TraceError, match="truncated"):
            read_trace(tmp_path / name)
        _, c = read_trace(tmp_path / name, allow_partial=True)
        assert len(c) <= 1


def test_every_truncation_is_a_clear_error(tmp_path) -> None:
    h = TraceHeader(2, 16, 2, (10, 10))
    p = tmp_path / "full"
    with TraceWriter(p, h, chunk_rows=5) as w:
        w.add_chunk(_random_chunk(h, 23, seed=3))
    data = p.read_bytes()
    cut = tmp_path / "cut"
    for n in range(len(data)):
        cut.write_bytes(data[:n])
        with pytest.raises(TraceError) as e:
            read_trace(cut)
        msg = str(e.value)
        assert str(cut) in msg and "(" in msg, msg           # names the file and the fix
        if n > len(h.pack()):
            assert "truncated" in msg or "End record" in msg
            _, part = read_trace(cut, allow_partial=True)     # complete chunks are usable
            assert len(part) in (0, 5, 10, 15, 20, 23)


@pytest.mark.parametrize("offset,problem", [
    (0, "not a routing trace"), (8, "version"), (30, "checksum"), (-30, "checksum|decompress"),
])
def test_damaged_bytes(tmp_path, offset: int, problem: str) -> None:
    p = tmp_path / "t"
    _write_tiny(p)
    b = bytearray(p.read_bytes())
    b[offset] ^= 0x5A
    p.write_bytes(bytes(b))
    with pytest.raises(TraceError, match=problem):
        read_trace(p)


def test_bytes_after_end(tmp_path) -> None:
    p = tmp_path / "t"
    _write_tiny(p)
    with open(p, "ab") as f:
        f.write(b"x")
    with pytest.raises(TraceError, match="after the End"):
        read_trace(p)


def test_errors_are_typed_and_actionable(tmp_path) -> None:
    assert issubclass(TraceError, FormatError) and issubclass(TraceError, ExpertfsError)
    with pytest.raises(TraceError, match="cannot open"):
        TraceReader(tmp_path / "missing")
    p = tmp_path / "t"
    with TraceWriter(p, TINY) as w:
        with pytest.raises(TraceError, match="distinct ids"):
            w.add(0, 0, [3, 3], [0.5, 0.5])
        with pytest.raises(TraceError, match="distinct ids"):
            w.add(0, 0, [3, 8], [0.5, 0.5])
        with pytest.raises(TraceError, match="no routed experts"):
            w.add(0, 2, [1, 2], [0.5, 0.5])
        with pytest.raises(TraceError, match="draft routes but"):
            w.add(0, 0, [1, 2], [0.5, 0.5], [[1, 2], [3, 4]])
    with pytest.raises(TraceError, match="n_draft = 0"):
        with TraceWriter(tmp_path / "u", TraceHeader(1, 4, 1, (1,))) as w:
            w.add(0, 0, [1], [1.0], [[2]])
    with pytest.raises(TraceError, match="expert_bytes"):
        TraceHeader(2, 4, 1, (1,))
    with pytest.raises(TraceError, match="k 5"):
        TraceHeader(1, 4, 5, (1,))


def test_add_chunk_validates(tmp_path) -> None:
    h = TraceHeader(2, 16, 2, (10, 0))
    c = _random_chunk(TraceHeader(2, 16, 2, (10, 10)), 10, seed=0)
    with TraceWriter(tmp_path / "t", h) as w:
        with pytest.raises(TraceError, match="no routed experts"):
            w.add_chunk(TraceChunk(c.tokens, np.ones(10, np.uint16), c.n_valid, c.experts,
                                   c.weights, None, None))
    assert os.path.getsize(tmp_path / "t") > 0
