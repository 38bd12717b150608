"""Every backend returns the bytes a plain pread returns: awkward sizes, unaligned offsets,
unaligned buffers, several reads in flight. Plus the typed errors of bad reads and buffers."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from expertfs.errors import ExpertfsError
from expertfs.runtime import io as eio
from expertfs.runtime.io import (BackendUnavailable, DirectBackend, IOUsageError, aligned_empty,
                                 get_backend)

SIZES = [1, 511, 4095, 4096, 4097, 3 * 4096 + 7]
OFFSETS = [0, 1, 4095, 4096, 8192 + 3]
HOST_BACKENDS = [n for n in ("buffered", "direct", "mmap")]


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> tuple[str, bytes]:
    path = tmp_path_factory.mktemp("io") / "data.bin"
    data = np.random.default_rng(1).integers(0, 256, 6 * 4096 + 123, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    return str(path), data


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_identical_bytes_all_sizes_and_offsets(backend, data_file):
    path, data = data_file
    with get_backend(backend).open(path, queue_depth=4) as fh:
        assert fh.size == len(data)
        for size in SIZES:
            for off in OFFSETS:
                want = data[off:off + size]
                aligned = aligned_empty(size)
                assert fh.read(aligned, off, size) == size
                assert aligned.numpy().tobytes() == want
                raw = bytearray(size + 1)                 # bytearray: arbitrary address
                fh.read(memoryview(raw)[1:], off, size)
                assert bytes(raw[1:]) == want


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_unaligned_tail_of_file_and_many_in_flight(backend, data_file):
    path, data = data_file
    with get_backend(backend).open(path, queue_depth=8) as fh:
        tail = len(data) - 4096 - 123          # aligned start, the file's unaligned end
        buf = aligned_empty(len(data) - tail)
        fh.read(buf, tail)
        assert buf.numpy().tobytes() == data[tail:]
        bufs = [aligned_empty(4097) for _ in range(16)]
        futs = [fh.pread(b, i * 1000, 4097) for i, b in enumerate(bufs)]
        for i, (f, b) in enumerate(zip(futs, bufs)):
            assert f.result() == 4097
            assert b.numpy().tobytes() == data[i * 1000:i * 1000 + 4097]


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_destination_types(backend, data_file):
    path, data = data_file
    with get_backend(backend).open(path) as fh:
        a = np.zeros(4096, np.uint8)
        fh.read(a, 5)
        assert a.tobytes() == data[5:4101]
        t = torch.zeros(1024, dtype=torch.int32)       # a non-byte tensor is read as bytes
        fh.read(t, 0)
        assert t.numpy().tobytes() == data[:4096]
        z = bytearray(0)
        assert fh.read(z, 0) == 0


def test_direct_strict_refuses_unaligned(data_file):
    path, _ = data_file
    with DirectBackend(strict=True).open(path) as fh:
        fh.read(aligned_empty(4096), 4096)
        with pytest.raises(eio.AlignmentError, match="multiples of 4096"):
            fh.read(aligned_empty(4096), 1, 4096)
        with pytest.raises(eio.AlignmentError, match="not a multiple"):
            fh.read(aligned_empty(4096), 0, 100)


def test_direct_bounces_unaligned_and_counts(data_file):
    path, data = data_file
    with DirectBackend().open(path) as fh:
        buf = bytearray(20000)
        fh.read(memoryview(buf)[3:], 7, 19997)
        assert bytes(buf[3:]) == data[7:7 + 19997]
        assert fh.raw.bounced >= 1


def test_bad_reads_are_typed_errors_naming_the_file(data_file):
    path, data = data_file
    with get_backend("buffered").open(path) as fh:
        with pytest.raises(IOUsageError, match="past the end of the file") as e:
            fh.read(bytearray(10), len(data) - 5)
        assert e.value.path == path and e.value.fix
        with pytest.raises(IOUsageError, match="into a buffer of 4 bytes"):
            fh.read(bytearray(4), 0, 8)
        with pytest.raises(IOUsageError, match=">= 0"):
            fh.read(bytearray(4), -1, 4)
        with pytest.raises(IOUsageError, match="read-only"):
            fh.read(b"abcd", 0)
        with pytest.raises(IOUsageError, match="not contiguous"):
            fh.read(torch.zeros(8, 8, dtype=torch.uint8).t(), 0)
    with pytest.raises(IOUsageError, match="closed"):
        fh.read(bytearray(4), 0)


def test_device_destination_refused_by_host_backends(data_file):
    class FakeDevice:
        __cuda_array_interface__ = {"shape": (16,), "typestr": "|u1", "data": (0, False),
                                    "version": 3}
    path, _ = data_file
    with get_backend("direct").open(path) as fh:
        with pytest.raises(IOUsageError, match="device memory.*host memory only"):
            fh.read(FakeDevice(), 0)


def test_open_errors(tmp_path):
    with pytest.raises(IOUsageError, match="no such file"):
        get_backend("buffered").open(tmp_path / "missing.bin")
    with pytest.raises(IOUsageError, match="is a directory"):
        get_backend("direct").open(tmp_path)
    with pytest.raises(IOUsageError, match="expected one of: auto, kvikio, direct, buffered, mmap"):
        get_backend("posix")


def test_direct_unavailable_where_the_file_system_refuses_it(data_file, monkeypatch):
    """Kernels before 6.6 refuse O_DIRECT on tmpfs with EINVAL; newer ones accept it, so the
    refusal is simulated here."""
    import errno
    from expertfs.runtime.io import protocol
    path, _ = data_file
    real_open = os.open

    def refuse(p, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", p)
        return real_open(p, flags, *a)

    monkeypatch.setattr(protocol.os, "open", refuse)
    with pytest.raises(BackendUnavailable, match="refuses O_DIRECT") as e:
        get_backend("direct").open(path)
    assert isinstance(e.value, ExpertfsError) and e.value.fix and e.value.path == path


def test_aligned_empty_and_host_slab():
    for n in (0, 1, 4096, 5000):
        t = aligned_empty(n)
        assert t.numel() == n and (n == 0 or t.data_ptr() % 4096 == 0)
    t = aligned_empty(100, alignment=1 << 16)
    assert t.data_ptr() % (1 << 16) == 0
    with pytest.raises(IOUsageError):
        aligned_empty(10, alignment=3000)
    with eio.HostSlab(3, 5000, pin="auto") as slab:
        assert slab.stride == 8192
        for i in range(3):
            assert slab.slot(i).data_ptr() % 4096 == 0 and slab.slot(i).numel() == 5000
        assert not slab.pinned and "CUDA is not available" in slab.pin_note
        with pytest.raises(IOUsageError, match="outside the slab"):
            slab.slot(3)



def _vma_flags(addr: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding ``addr`` ({} where unreadable)."""
    try:
        with open("/proc/self/smaps") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    out: dict[str, str] = {}
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            if inside:
                break
            inside = lo <= addr < hi
            out = {"perms": line.split()[1]} if inside else {}
        elif inside and ":" in head:
            out[head[:-1]] = line.split(None, 1)[1].strip() if len(line.split()) > 1 else ""
    return out


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read()
    except OSError:
        return ""


@pytest.mark.parametrize("huge", ["1", "0"])
def test_large_host_slabs_ask_for_huge_pages_where_they_pay(huge, monkeypatch):
    """A slab of 2 MiB or more is a private mapping, on a 2 MiB boundary and advised for
    transparent huge pages where they pay (``THPeligible`` 1 where the kernel offers them in
    ``madvise`` mode), advised against them where not (``EXPERTFS_HUGE_PAGES`` decides here
    for the box). Small buffers stay page-aligned shared mappings."""
    monkeypatch.setenv("EXPERTFS_HUGE_PAGES", huge)
    small = aligned_empty(1 << 20, slab=True)
    assert small.data_ptr() % 4096 == 0
    assert _vma_flags(small.data_ptr()).get("perms", "rw-s")[3] == "s"
    with eio.HostSlab(3, 3 << 20, pin=False) as slab:
        t = slab.tensor
        assert t.data_ptr() % (2 << 20 if huge == "1" else 4096) == 0
        assert t.numel() == 3 * (3 << 20)
        t.fill_(7)
        assert int(t[-1]) == 7
        vma = _vma_flags(t.data_ptr())
        if not vma:
            return
        assert vma["perms"][3] == "p"
        if "THPeligible" in vma and "[madvise]" in _thp_mode():
            assert vma["THPeligible"] == huge


def _sysfs(root, balloon_features: str | None = None, reported_kib: str | None = None,
           other: str = "0x0002") -> str:
    """A fake ``/sys`` with a virtio block device, a balloon of these features, and the
    page-reporting module's counter."""
    devs = root / "bus" / "virtio" / "devices"
    for name, dev, feats in (("virtio0", other, "1" * 40),
                             ("virtio1", "0x0005", balloon_features)):
        if feats is None:
            continue
        (devs / name).mkdir(parents=True)
        (devs / name / "device").write_text(dev + "\n")
        (devs / name / "features").write_text(feats + "\n")
    if reported_kib is not None:
        par = root / "module" / "page_reporting" / "parameters"
        par.mkdir(parents=True)
        (par / "reported_kib").write_text(reported_kib + "\n")
    return str(root)


def test_free_page_reporting_is_read_from_the_balloon_and_the_kernel(tmp_path, monkeypatch):
    """A balloon that negotiated free page reporting (feature bit 5), or a kernel that has
    reported memory, turns huge pages off for a one-shot process's slabs; a balloon without the
    feature, another virtio device with bit 5, bare metal (no virtio at all) leave them on; a
    long-lived process keeps them; the environment variable overrides both."""
    from expertfs.runtime.io import pages
    on = "0110010100000000000000000000000100000000"
    off = "0110000100000000000000000000000100000000"
    assert pages.page_reporting(_sysfs(tmp_path / "a", on))
    assert not pages.page_reporting(_sysfs(tmp_path / "b", off))
    assert not pages.page_reporting(_sysfs(tmp_path / "c"))                  # a block device only
    assert not pages.page_reporting(str(tmp_path / "bare"))
    assert pages.page_reporting(_sysfs(tmp_path / "d", off, reported_kib="4096"))
    assert not pages.page_reporting(_sysfs(tmp_path / "e", off, reported_kib="0"))
    monkeypatch.setattr(pages, "_reporting_here", lambda: True)
    monkeypatch.setattr(pages, "_long_life", False)
    for env, want in (("auto", False), ("1", True), ("0", False), ("on", True)):
        monkeypatch.setenv("EXPERTFS_HUGE_PAGES", env)
        assert pages.huge_pages_pay() is want
    monkeypatch.setenv("EXPERTFS_HUGE_PAGES", "auto")     # a server keeps huge pages
    pages.expect_long_life()
    assert pages.huge_pages_pay() is True
    monkeypatch.setenv("EXPERTFS_HUGE_PAGES", "0")        # unless told otherwise
    assert pages.huge_pages_pay() is False


def test_first_touch_is_measured_for_both_page_sizes():
    """``first_touch_s_per_gb`` faults fresh memory in and returns seconds a GB (positive,
    finite) for both sizes, or None where the kernel lacks the advice."""
    from expertfs.runtime.io import pages
    for huge in (True, False):
        s = pages.first_touch_s_per_gb(huge, 4 << 20)
        assert s is None or 0 < s < 1e3


def test_a_host_slab_is_faulted_in_behind_its_owner():
    """A new slab's pages are faulted in by a background thread (``Prefault``): resident in
    ``/proc/self/smaps`` without anyone writing them, and what was written stays; ``close``
    stops it. A kernel without ``MADV_POPULATE_WRITE`` (before 5.14) leaves them to the reads."""
    from expertfs.runtime.io.buffers import Prefault
    n = 3 * Prefault.CHUNK // (8 << 20)
    with eio.HostSlab(n, 8 << 20, pin=False) as slab:
        t = slab.tensor
        t[:4096].fill_(9)                                # written before the thread gets there
        pf = slab._prefault
        pf._thread.join(timeout=60)
        if pf.done == 0:
            pytest.skip("this kernel has no MADV_POPULATE_WRITE")
        assert pf.done == t.numel()
        rss = _vma_flags(t.data_ptr()).get("Rss", "0 kB").split()[0]
        assert int(rss) * 1024 >= t.numel() * 0.9
        assert int(t[:4096].min()) == 9 and int(t[4096:].max()) == 0
    assert not pf._thread.is_alive()


def test_pinning_respects_the_budget(monkeypatch, caplog):
    from expertfs.runtime.io import buffers
    calls = []
    monkeypatch.setattr(buffers.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(buffers, "_cuda_host_register", lambda p, n: calls.append((p, n)) or 0)
    monkeypatch.setattr(buffers, "_cuda_host_unregister", lambda p: 0)
    budget = eio.PinBudget(3 * 4096)
    a = eio.HostSlab(2, 4096, budget=budget)
    assert a.pinned and budget.used == 8192 and calls[0][0] % 4096 == 0
    b = eio.HostSlab(2, 4096, budget=budget)         # would exceed: pinned as far as it goes
    assert not b.pinned and b.pinned_slots == 1 and "1 of 2 slots pinned" in b.pin_note
    assert "pin budget" in b.pin_note and budget.used == 12288 and calls[1][1] == 4096
    a.close()
    b.close()
    assert budget.used == 0
    monkeypatch.setattr(buffers, "_cuda_host_register", lambda p, n: 2)  # cudaErrorMemoryAllocation
    monkeypatch.setattr(buffers, "_cuda_get_last_error", lambda: 2)
    with pytest.warns(buffers.PinWarning, match="returned 2"):
        c = eio.HostSlab(1, 4096, budget=budget)
    assert not c.pinned and "returned 2" in c.pin_note and budget.used == 0


def test_pin_true_without_cuda_warns(caplog):
    with caplog.at_level("WARNING"):
        s = eio.HostSlab(1, 4096, pin=True)
    assert not s.pinned and "CUDA is not available" in caplog.text


def test_backend_status_reasons():
    st = eio.backend_status()
    assert set(st) == {"kvikio", "direct", "buffered", "mmap"}
    assert st["buffered"].available and st["direct"].available
    assert st["kvikio"].reason
