"""Faults are reported, never hidden: EIO and short reads are retried with backoff and then
raised as a typed error naming the file and offset; delays only delay."""

from __future__ import annotations

import errno

import numpy as np
import pytest

from expertfs.runtime.io import IOFaultError, IOUsageError, RetryPolicy, aligned_empty, get_backend
from expertfs.runtime.io.retry import read_fully
from support.faults import Fault, FaultInjectingBackend

FAST = RetryPolicy(attempts=3, backoff_s=0.0001, max_backoff_s=0.001)


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "d.bin"
    b = np.random.default_rng(7).integers(0, 256, 64 * 1024, dtype=np.uint8).tobytes()
    path.write_bytes(b)
    return str(path), b


@pytest.mark.parametrize("inner", ["buffered", "direct", "mmap"])
def test_transient_eio_and_short_reads_are_recovered(data, inner):
    path, b = data
    be = FaultInjectingBackend(get_backend(inner), [Fault("eio", times=2), Fault("short", times=3)])
    with be.open(path, retry=FAST) as fh:
        buf = aligned_empty(32768)
        assert fh.read(buf, 4096) == 32768
        assert buf.numpy().tobytes() == b[4096:4096 + 32768]
    assert be.hits["eio"] == 2 and be.hits["short"] >= 1


def test_persistent_eio_names_file_and_offset(data):
    path, _ = data
    be = FaultInjectingBackend(get_backend("direct"), [Fault("eio", times=-1, offset=20000)])
    with be.open(path, retry=FAST) as fh:
        fh.read(aligned_empty(4096), 0)               # not covering the bad offset: fine
        with pytest.raises(IOFaultError) as e:
            fh.read(aligned_empty(8192), 16384)
    err = e.value
    assert err.path == path and err.offset == 16384 and err.size == 8192
    assert err.attempts == 3 and err.errno == errno.EIO and err.exit_code == 1
    assert "offset 16384" in str(err) and "Input/output error" in str(err) and err.fix


def test_non_retryable_errors_fail_at_once(data):
    path, _ = data
    be = FaultInjectingBackend(get_backend("buffered"), [Fault("eio", times=-1, errno=errno.EBADF)])
    with be.open(path, retry=FAST) as fh:
        with pytest.raises(IOFaultError, match="not retryable") as e:
            fh.read(bytearray(10), 0)
    assert e.value.attempts == 1 and be.hits["eio"] == 1


def test_zero_byte_reads_give_up(data):
    path, _ = data
    be = FaultInjectingBackend(get_backend("buffered"), [Fault("short", times=-1, keep=0)])
    with be.open(path, retry=FAST) as fh:
        with pytest.raises(IOFaultError, match="no data"):
            fh.read(bytearray(100), 50)


def test_backoff_grows_and_is_capped():
    p = RetryPolicy(attempts=5, backoff_s=0.001, factor=4, max_backoff_s=0.01)
    assert [p.delay(i) for i in (1, 2, 3)] == [0.001, 0.004, 0.01]
    slept = []
    calls = iter([OSError(errno.EIO, "x"), OSError(errno.EAGAIN, "y"), 5, 5])

    def raw(s, e, o):
        v = next(calls)
        if isinstance(v, Exception):
            raise v
        return v

    assert read_fully(raw, path="p", offset=0, size=10, policy=p, sleep=slept.append) == 10
    assert slept == [0.001, 0.004]


def test_delays_and_corruption_pass_through_the_plain_handle(data):
    path, b = data
    be = FaultInjectingBackend(get_backend("buffered"),
                               [Fault("delay", delay_s=0.01), Fault("corrupt", offset=100)])
    with be.open(path) as fh:
        buf = bytearray(200)
        f = fh.pread(buf, 0)
        assert f.result(10) == 200 and f.latency_ns >= 10_000_000
    assert buf[100] == b[100] ^ 0xFF and buf[:100] == b[:100]
    with pytest.raises(IOUsageError, match="fault kind"):
        Fault("melt")
