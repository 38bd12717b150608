"""``repack --consume-source`` checks each checkpoint read back from the store before punching:
every block of a window written (SEEK_HOLE) and spots of it read back with O_DIRECT, or the
whole window against its checksums. A mismatch releases nothing of that checkpoint, and running
the command again rewrites it from the source, so unpack still gives the GGUF back bit for bit.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash
from gguf import GGMLQuantizationType as T

import expertfs.store.repack as rp
from expertfs.cli import main
from expertfs.errors import IntegrityError
from expertfs.formats.gguf_split import read_model
from expertfs.store import consume
from expertfs.store.layout import EXPERTS_FILE
from expertfs.store.plan import plan_repack
from expertfs.store.unpack import unpack
from expertfs.store.windows import Window
from expertfs.store.writer import WindowWriter
from support.gguf_builders import moe_gguf

WINDOW = 64 << 10


@pytest.fixture(autouse=True)
def small_ckpt(monkeypatch):
    monkeypatch.setattr(rp, "CHECKPOINT_BYTES", 256 << 10)


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _model(path: Path) -> Path:
    return moe_gguf(path, layers=2, experts=16, hidden=256, ff=256,
                    types=(T.F16, T.F16, T.F16))[0]


def _repack(src: Path, out: Path, **kw) -> rp.RepackResult:
    return rp.repack([str(src)], str(out), window_bytes=WINDOW, consume_source=True, **kw)


def _back(out: Path, tmp_path: Path) -> str:
    unpack(str(out), str(tmp_path / "back.gguf"), force=True)
    return _sha(tmp_path / "back.gguf")


def test_spots_are_both_ends_and_one_in_every_stride():
    stride = consume.SPOT_STRIDE // consume.SPOT_BLOCK
    n = 2 * stride + 5                                   # two whole strides and a short one
    buf = random.Random(1).randbytes(n * consume.SPOT_BLOCK)
    spots = consume.spot_digests(len(buf), buf, random.Random(2))
    blocks = [off // consume.SPOT_BLOCK for off, _ in spots]
    assert blocks[0] == 0 and blocks[-1] == n - 1 and blocks == sorted(set(blocks))
    chunks = range(0, n, stride)
    assert all(any(c <= b < c + stride for b in blocks) for c in chunks)
    assert len(blocks) <= len(chunks) + 2
    for off, d in spots:
        assert d == xxhash.xxh3_64_intdigest(buf[off:off + consume.SPOT_BLOCK])
    one = consume.spot_digests(consume.SPOT_BLOCK, buf, random.Random(3))
    assert [o for o, _ in one] == [0]


def _tamper_on_second_batch(monkeypatch, how: str) -> list[int]:
    """Before the second checkpoint's check, damage its first window in the store (as a disk
    that lost or garbled a write would); returns the offsets damaged."""
    real = consume.Consumer._spot_check
    calls, hit = [0], []

    def check(self, batch):
        calls[0] += 1
        if calls[0] == 2:
            w = batch[0][0]
            fd = os.open(self.files[w.file], os.O_WRONLY)
            try:
                if how == "garble":
                    os.pwrite(fd, b"\xa5" * consume.SPOT_BLOCK, w.dst_off)
                else:
                    consume.punch_hole(fd, w.dst_off, consume.SPOT_BLOCK)
                os.fsync(fd)
            finally:
                os.close(fd)
            hit.append(w.dst_off)
        return real(self, batch)
    monkeypatch.setattr(consume.Consumer, "_spot_check", check)
    return hit


@pytest.mark.parametrize("how, says", [("garble", "4 KiB at byte"),      # a spot differs
                                       ("hole", "differs from what")])  # read back whole
def test_a_damaged_window_releases_nothing_and_the_rerun_rewrites_it(tmp_path, monkeypatch,
                                                                     how, says):
    src = _model(tmp_path / "m.gguf")
    want = _sha(src)
    out = tmp_path / "m.efs"
    hit = _tamper_on_second_batch(monkeypatch, how)
    with pytest.raises(IntegrityError, match=says) as ei:
        _repack(src, out)
    assert hit and "not released" in str(ei.value) and "run the same command again" in str(ei.value)
    assert (tmp_path / "m.efs.partial" / consume.CONSUMING).exists()   # the first one was
    monkeypatch.undo()
    monkeypatch.setattr(rp, "CHECKPOINT_BYTES", 256 << 10)
    res = _repack(src, out)
    assert res.resumed_from_bytes > 0 and not src.exists()
    assert _back(out, tmp_path) == want


def test_a_window_with_holes_is_read_back_whole(tmp_path, monkeypatch):
    """What a file system that keeps zero blocks as holes looks like: no spot check passes, so
    every checkpoint is read back whole and checked against the index; nothing is lost."""
    src = _model(tmp_path / "m.gguf")
    want = _sha(src)
    whole = []
    real = consume.Consumer._verify
    monkeypatch.setattr(consume.Consumer, "_spot_check", lambda self, batch: False)
    monkeypatch.setattr(consume.Consumer, "_verify",
                        lambda self, sums, wins: (whole.append(len(wins)), real(self, sums, wins)))
    _repack(src, tmp_path / "m.efs")
    assert len(whole) > 5
    assert _back(tmp_path / "m.efs", tmp_path) == want


def test_full_readback_reads_every_window_back_whole(tmp_path, monkeypatch):
    src = _model(tmp_path / "m.gguf")
    want = _sha(src)

    def no_spots(self, batch):
        raise AssertionError("spot check used with full_readback")
    monkeypatch.setattr(consume.Consumer, "_spot_check", no_spots)
    _repack(src, tmp_path / "m.efs", full_readback=True)
    assert _back(tmp_path / "m.efs", tmp_path) == want


def test_full_readback_without_consume_source_is_refused(tmp_path, capsys):
    src = _model(tmp_path / "m.gguf")
    assert main(["repack", str(src), "-o", str(tmp_path / "m.efs"), "--full-readback"]) == 2
    err = capsys.readouterr().err
    assert "--consume-source" in err and "Traceback" not in err
    assert src.exists() and not (tmp_path / "m.efs").exists()


def test_the_writer_refuses_a_window_over_an_earlier_one(tmp_path):
    src = _model(tmp_path / "m.gguf")
    plan = plan_repack(read_model([str(src)]))
    fd = os.open(tmp_path / "experts.bin", os.O_RDWR | os.O_CREAT)
    w = WindowWriter(plan, {EXPERTS_FILE: (fd, False)}, 1 << 16)
    buf = mmap.mmap(-1, 1 << 16)
    try:
        w._write(Window(EXPERTS_FILE, 1 << 16, 1 << 16), buf)
        w._write(Window(EXPERTS_FILE, 2 << 16, 1 << 16), buf)       # next one: fine
        with pytest.raises(IntegrityError, match="overlaps one written before it"):
            w._write(Window(EXPERTS_FILE, (2 << 16) + 4096, 1 << 16), buf)
        assert os.fstat(fd).st_size == 3 << 16                   # nothing written there
    finally:
        w.close()
        buf.close()
        os.close(fd)


SPLIT_RUNNER = """
import os, signal, sys
import expertfs.store.repack as r
from expertfs.formats.gguf_split import read_model
from expertfs.store import consume
r.CHECKPOINT_BYTES = 256 << 10
out, kill_at, shards = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
# a shard is emptied when only its header's blocks (and a few at its edges) are left
limit = {f.path: (f.data_offset // 4096 + 4) * 4096 for f in read_model(shards).shards}
real = consume.Consumer.release

def release(self, batch, sums):
    real(self, batch, sums)
    if kill_at and sum(os.stat(p).st_blocks * 512 <= n for p, n in limit.items()) >= kill_at:
        os.kill(os.getpid(), signal.SIGKILL)   # kill -9 right after the shard was emptied
consume.Consumer.release = release
r.repack([shards[0]], out, window_bytes=64 << 10, consume_source=True)
"""


def test_kill_9_between_shards_of_a_split_gguf_resumes_bit_for_bit(tmp_path):
    """Killed as each shard of a split GGUF is emptied (and once all are, before the store is
    published), the same command finishes the store and unpack gives the merged GGUF back."""
    (tmp_path / "p").mkdir()
    pristine = moe_gguf(tmp_path / "p" / "s.gguf", layers=4, experts=16, hidden=256, ff=256,
                        types=(T.F16, T.F16, T.F16), split_max_tensors=12)
    assert len(pristine) > 2
    rp.repack([str(p) for p in pristine], str(tmp_path / "joined.efs"))
    want = _back(tmp_path / "joined.efs", tmp_path)
    states: set[int] = set()                 # how many shards were emptied at each kill
    for kill_at in range(1, len(pristine) + 1):
        work = tmp_path / f"k{kill_at}"
        shutil.copytree(tmp_path / "p", work)
        shards = [str(work / p.name) for p in pristine]
        out = str(work / "s.efs")

        def run(k: int) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-c", SPLIT_RUNNER, out, str(k), *shards],
                                  capture_output=True, text=True, timeout=120)
        r = run(kill_at)
        assert r.returncode == -9, r.stderr
        emptied = [os.stat(f.path).st_blocks * 512 <= (f.data_offset // 4096 + 4) * 4096
                   for f in read_model(shards).shards]
        assert sum(emptied) >= kill_at, (kill_at, emptied)   # killed as that shard was emptied
        states.add(sum(emptied))
        assert os.path.exists(os.path.join(out + ".partial", consume.CONSUMING))
        r = run(0)
        assert r.returncode == 0, r.stderr
        assert not any(os.path.exists(p) for p in shards) and not os.path.exists(out + ".partial")
        assert _back(Path(out), tmp_path) == want, f"killed after {kill_at} shards emptied"
        shutil.rmtree(work)
    assert len(pristine) in states and states - {len(pristine)}    # between shards, and after all
