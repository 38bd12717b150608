"""``runtime.model.trunk_stream``: under a limit that cannot hold the trunk, a share of every
unit's matrices read a unit ahead and dropped a unit behind; the logits never change."""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
import time

import pytest
import torch

from expertfs.runtime.engine import Engine, EngineOptions
from expertfs.runtime.memory import STREAM_MARGIN_MIN, trunk_stream_share
from expertfs.runtime.model import trunk_stream
from expertfs.runtime.model.trunk_stream import (STREAM_ENV, STREAM_VOTES, TrunkStream, jobs,
                                                    unit_spans)
from expertfs.store.reader import Store
from support.cache_store import tiny_store

from test_trunk_residency import cold_reader, pages_in

MiB = 1 << 20


def test_no_deficit_streams_nothing_and_a_share_keeps_the_rest_and_two_units_in_memory():
    units = [100 * MiB] * 8 + [300 * MiB]                 # eight layers and a larger head
    assert trunk_stream_share(units, 0) == 0.0
    share = trunk_stream_share(units, 200 * MiB)
    want = 200 * MiB + STREAM_MARGIN_MIN
    peak = 300 * MiB + 100 * MiB                           # the head beside a layer
    assert share == pytest.approx(want / (sum(units) - peak))
    resident = (1 - share) * sum(units) + share * peak
    assert resident <= sum(units) - want + 1
    assert trunk_stream_share(units, 900 * MiB) == 1.0     # nothing left to keep: all of it


def test_each_unit_reads_the_next_and_drops_the_one_before():
    head = 3                                              # layers 0-2, then the head
    assert jobs(0, head) == ([3], [1])                    # the last token's head goes
    assert jobs(1, head) == ([0], [2])
    assert jobs(2, head) == ([1], [3])                    # the head comes after the last layer
    assert jobs(3, head) == ([2], [0])                    # and the next token's first layer
    assert jobs(0, 1) == ([], [1]) and jobs(1, 1) == ([], [0])   # one layer: nothing to drop


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return tiny_store(tmp_path_factory.mktemp("stream"))


@pytest.fixture
def cold(tmp_path_factory):
    """A store no engine maps (an engine's map lives until collected, and pages it maps stay in
    the page cache), its trunk.bin dropped from the page cache: a ``TrunkReader`` of it."""
    gc.collect()
    with Store.open(tiny_store(tmp_path_factory.mktemp("cold"))) as st:
        r = cold_reader(st)
        yield r
        r.close()


def _run(store: str, deficit: int) -> tuple[torch.Tensor, int]:
    with Engine.open(store, options=EngineOptions(trunk_stream=deficit > 0),
                     ram_bytes=64 * MiB) as e:
        if deficit:
            e.model.trunk_stream.set_deficit(deficit)      # as if measured
        out = [e.prefill([5, 100, 200, 37, 12, 7])]
        for _ in range(4):
            out.append(e.decode(int(out[-1].argmax())))
        return torch.stack(out), (e.stats()["trunk_stream"] or {}).get("bytes", 0)


def test_a_streamed_run_has_the_same_logits_bit_for_bit(store):
    plain, none = _run(store, 0)
    streamed, nbytes = _run(store, 1 << 30)               # all of it streamed, every token
    assert none == 0 and nbytes > 0
    assert torch.equal(plain, streamed)


def test_the_environment_switch_leaves_the_trunk_to_the_page_cache(store, monkeypatch):
    monkeypatch.setenv(STREAM_ENV, "0")
    with Engine.open(store, options=EngineOptions(trunk_stream=True), ram_bytes=64 * MiB) as e:
        assert e.model.trunk_stream is None and e.stats()["trunk_stream"] is None


def test_the_units_are_each_layers_mapped_matrices_then_the_head(store):
    with Engine.open(store, ram_bytes=64 * MiB) as e:
        units = unit_spans(e.reader, e.trunk)
        recs = e.store.trunk_tensors()
    assert len(units) == e.config.n_layers + 1
    for li, spans in enumerate(units[:-1]):
        names = {n for n, r in recs.items() if (r.offset, r.offset + r.nbytes) in spans}
        assert names and all(n.startswith(f"blk.{li}.") for n in names)
    assert units[-1] == [(recs["output.weight"].offset,
                          recs["output.weight"].offset + recs["output.weight"].nbytes)]


def test_the_thread_reads_the_next_unit_in_and_drops_the_last_one(cold):
    r = cold
    page = mmap.PAGESIZE
    spans = [[(a, b)] for a, b in ((0, 4 * page), (8 * page, 12 * page), (16 * page, 20 * page))]
    s = TrunkStream(r, spans, deficit=1 << 30)           # every page of them streamed
    s.at(0)                                           # unit 1 comes in
    s.close()
    got = pages_in(r)
    assert all(got[8:12]) and not any(got[16:20])
    s = TrunkStream(r, spans, deficit=1 << 30)
    s.at(2)                                           # unit 1 goes, unit 0 comes in
    s.close()
    got = pages_in(r)
    if any(got[8:12]):
        pytest.skip("the page cache kept dropped pages (DONTNEED not honoured here)")
    assert all(got[0:4])


def _evict(r) -> None:
    """Unmap trunk.bin's pages from ``r`` and drop them from the page cache."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.madvise(r.base_address, r.mapped_bytes, mmap.MADV_DONTNEED) == 0
    fd = os.open(r.path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _settle(done) -> None:
    for _ in range(500):
        if done():
            return
        time.sleep(0.01)


@pytest.mark.parametrize("thrashed", [(True, True), (False, True), (False, False)])
def test_kept_bytes_found_missing_are_streamed_once_the_lru_reread_more(cold, thrashed,
                                                                        monkeypatch):
    """Measured from the third forward: the kept pages out of memory are streamed from then on
    once ``STREAM_VOTES`` forwards in a row re-read more of the trunk than ``STREAM_GAIN``
    times what streaming them would; not where one did, or none; and after
    ``STREAM_RECHECK`` forwards streaming, the LRU is tried again."""
    assert STREAM_VOTES == 2
    monkeypatch.setattr(trunk_stream, "STREAM_RECHECK", 1)
    r = cold
    page = mmap.PAGESIZE
    spans = [[(a, b)] for a, b in ((0, 4 * page), (8 * page, 12 * page), (16 * page, 20 * page))]
    s = TrunkStream(r, spans, tolerance=page)
    assert s.bytes == 0 and s.missing() == 12 * page      # cold: every kept page is out
    s.at(2, measure=True)                                 # the prompt's forward: not
    s.at(2, measure=True)                                 # the first token's: the start
    _settle(lambda: s._io is not None)
    for i, thrash in enumerate(thrashed):
        if thrash:                                        # a token re-reads all of it
            r._buf.view(-1)[::page].sum()
        _evict(r)                                         # the kept pages out again
        s.at(2, measure=True)                             # measured
        _settle(lambda: s.measures == i + 1)
    if thrashed != (True, True):                          # the LRU re-read less: kept
        assert s.bytes == 0 and s.deficit == 0
    else:
        assert s.deficit == 12 * page and s.share == 1.0 and s.bytes == 12 * page
        assert s.missing() == 0                           # nothing kept now
        s.at(2, measure=True)                             # a recheck's worth later
        _settle(lambda: s.measures == len(thrashed) + 1)
        assert s.share == 0 and s.bytes == 0              # the LRU again
    s.close()


def test_without_the_process_read_counter_the_lru_is_kept(cold, monkeypatch):
    monkeypatch.setattr(trunk_stream, "_read_bytes", lambda: None)
    page = mmap.PAGESIZE
    s = TrunkStream(cold, [[(0, 4 * page)], [(8 * page, 12 * page)]], tolerance=page)
    for i in range(4):
        cold._buf.view(-1)[::page].sum()
        _evict(cold)
        s.at(1, measure=True)
        _settle(lambda: s.measures == max(0, i - 1))
    s.close()
    assert s.measures == 2 and s.missing() > 0 and s.share == 0
