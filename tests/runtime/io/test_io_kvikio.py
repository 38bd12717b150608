"""kvikio's host path, exercised here without a GPU under a stub CUDA driver; and every way
kvikio can fail turned into a typed "unavailable" with its reason (a fake ``kvikio`` module,
so those run without kvikio installed).

TEST-ONLY: the ``libcuda.so.1`` built below is not a driver. Each of its ``cu*`` calls answers
CUDA_ERROR_NOT_INITIALIZED (3), ``cuDriverGetVersion`` a version and ``cuDeviceGetCount`` 0, so
kvikio treats every buffer as host memory and reads through its POSIX compat path. It proves
our kvikio backend's plumbing (buffers, offsets, futures, retries, checksums); kvikio into
device memory is checked for real by bench/gpu_check_io.sh on a GPU machine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

import numpy as np

from expertfs.runtime.io import BackendUnavailable, KvikioBackend, get_backend
from expertfs.runtime.io import auto, kvikio_backend

_STUB_FAIL = """cuInit cuMemHostAlloc cuMemFreeHost cuMemHostRegister cuMemHostRegister_v2
cuMemHostUnregister cuMemcpyHtoDAsync cuMemcpyHtoDAsync_v2 cuMemcpyDtoHAsync cuMemcpyDtoHAsync_v2
cuMemcpyAsync cuMemcpy cuPointerGetAttribute cuPointerGetAttributes cuCtxPushCurrent
cuCtxPushCurrent_v2 cuCtxPopCurrent cuCtxPopCurrent_v2 cuCtxGetCurrent cuCtxSetCurrent
cuCtxGetDevice cuMemGetAddressRange cuMemGetAddressRange_v2 cuDeviceGet cuDevicePrimaryCtxRetain
cuDevicePrimaryCtxRelease cuDevicePrimaryCtxRelease_v2 cuStreamSynchronize cuStreamCreate
cuStreamDestroy cuStreamDestroy_v2 cuStreamQuery cuDeviceGetAttribute cuLaunchHostFunc
cuEventCreate cuEventRecord cuEventSynchronize cuEventDestroy cuEventDestroy_v2 cuEventQuery
cuCtxCreate cuCtxCreate_v2 cuCtxCreate_v3 cuCtxCreate_v4 cuCtxDestroy cuCtxDestroy_v2
cuCtxSynchronize cuMemAlloc cuMemAlloc_v2 cuMemFree cuMemFree_v2 cuGetProcAddress
cuGetProcAddress_v2 cuDeviceGetName cuDeviceTotalMem cuDeviceTotalMem_v2
cuMemHostGetDevicePointer cuMemHostGetDevicePointer_v2 cuStreamGetCtx cuCtxGetId
cuDeviceGetUuid cuDeviceGetPCIBusId cuMemcpyBatchAsync""".split()


def _build_stub(where: Path) -> Path:
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip("no C compiler to build the test-only stub libcuda.so.1")
    src = ["/* TEST-ONLY stub of libcuda.so.1: not a driver. */"]
    src += [f"int {n}(void) {{ return 3; }}" for n in _STUB_FAIL]
    src += ["int cuDriverGetVersion(int *v) { if (v) *v = 12080; return 0; }",
            "int cuDeviceGetCount(int *c) { if (c) *c = 0; return 0; }",
            'int cuGetErrorName(int e, const char **s) { if (s) *s = "CUDA_ERROR_NOT_INITIALIZED"; return 0; }',
            'int cuGetErrorString(int e, const char **s) { if (s) *s = "initialization error"; return 0; }']
    (where / "stub.c").write_text("\n".join(src) + "\n")
    subprocess.run([gcc, "-shared", "-fPIC", "-w", "-o", str(where / "libcuda.so.1"),
                    str(where / "stub.c")], check=True)
    return where


CHILD = textwrap.dedent('''
    import sys
    sys.path.insert(0, sys.argv[2])
    import numpy as np
    from expertfs.runtime.io import (ExpertReader, KvikioBackend, aligned_empty, choose_backend,
                                     get_backend)
    from test_io_reader import write_expert_file
    from pathlib import Path
    tmp = Path(sys.argv[1])
    assert KvikioBackend.availability().available, KvikioBackend.availability()
    be = get_backend("kvikio")
    assert be.mode() == "compat", be.mode()
    data = np.random.default_rng(5).integers(0, 256, 6 * 4096 + 123, dtype=np.uint8).tobytes()
    (tmp / "d.bin").write_bytes(data)
    with be.open(tmp / "d.bin", queue_depth=4) as fh:
        import kvikio.defaults
        assert kvikio.defaults.get("auto_direct_io_read")      # O_DIRECT, as the direct backend
        for size in (1, 511, 4095, 4096, 4097, 3 * 4096 + 7):
            for off in (0, 1, 4096, 8195):
                a = aligned_empty(size)
                assert fh.read(a, off, size) == size
                assert a.numpy().tobytes() == data[off:off + size], (size, off)
                b = bytearray(size + 1)
                fh.read(memoryview(b)[1:], off, size)
                assert bytes(b[1:]) == data[off:off + size]
        futs = [fh.pread(aligned_empty(4097), i * 1000, 4097) for i in range(12)]
        assert all(f.result(30) == 4097 for f in futs)
    extents = write_expert_file(tmp / "experts.bin")
    with ExpertReader(path=tmp / "experts.bin", extents=extents, backend="kvikio") as r:
        assert all(r.read_expert_sync(e.layer, e.expert).verified for e in extents)
    big = tmp / "big.bin"
    big.write_bytes(np.random.default_rng(6).integers(0, 256, 2 << 20, dtype=np.uint8).tobytes())
    c = choose_backend(big, read_size=128 << 10, probe_bytes=1 << 20, cache_dir=tmp)
    assert "kvikio" in c.gbps, c
    from expertfs.runtime.io.auto import open_file
    import expertfs.runtime.io.auto as auto
    for direct, buffered, want in ((1.0, 1.1, True), (1.0, 1.3, False)):   # the tie rule
        fake = auto.AutoChoice("kvikio", "test", {"kvikio": 1.0, "direct": direct,
                                                  "buffered": buffered})
        auto.choose_backend = lambda *a, fake=fake, **k: fake
        with open_file(big, queue_depth=4) as fh:
            assert kvikio.defaults.get("auto_direct_io_read") == want, (direct, buffered)
            a = aligned_empty(4096)
            assert fh.read(a, 4096, 4096) == 4096
            assert a.numpy().tobytes() == big.read_bytes()[4096:8192]
    print("KVIKIO-HOST-OK", be.describe(), c.backend, c.gbps)
''')


def test_kvikio_host_path_under_stub_driver(tmp_path):
    pytest.importorskip("kvikio", reason="kvikio is an optional extra (pip install 'expertfs[kvikio]')")
    stub = _build_stub(tmp_path)
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = f"{stub}:{env.get('LD_LIBRARY_PATH', '')}".rstrip(":")
    env["EXPERTFS_CACHE_DIR"] = str(tmp_path / "cache")
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), str(Path(__file__).parent)],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "KVIKIO-HOST-OK kvikio (compat mode" in out.stdout


# -- failure modes, with a fake kvikio -------------------------------------------------------

class _Future:
    def __init__(self, n):
        self.n = n

    def get(self):
        return self.n


class _CuFile:
    """kvikio.CuFile over os.pread (into numpy host buffers)."""

    def __init__(self, path, mode):
        self.fd = os.open(path, os.O_RDONLY)

    def pread(self, buf, size, file_offset):
        data = os.pread(self.fd, size, file_offset)
        np.asarray(buf)[:len(data)] = np.frombuffer(data, dtype=np.uint8)
        return _Future(len(data))

    def close(self):
        os.close(self.fd)


class _Defaults:
    """kvikio.defaults of a current kvikio: get/set by name."""

    def __init__(self):
        self.values = {"num_threads": 1, "task_size": 4 << 20, "auto_direct_io_read": False}

    def get(self, key):
        return self.values[key]

    def set(self, key, value):
        self.values[key] = value

    def is_compat_mode_preferred(self):
        return True


class _OldDefaults:
    """kvikio.defaults of an older kvikio: no get/set, per-setting accessors."""

    def __init__(self):
        self.n, self.task = 1, 4 << 20

    def get_num_threads(self):
        return self.n

    def num_threads_reset(self, n):
        self.n = n

    def task_size(self):
        return self.task

    def task_size_reset(self, n):
        self.task = n

    def compat_mode(self):
        return True


def _fake_kvikio(monkeypatch, defaults=None, cufile=_CuFile, import_error=None, driver=True):
    mod = types.ModuleType("kvikio")
    mod.defaults = defaults if defaults is not None else _Defaults()
    mod.CuFile = cufile

    def import_module(name):
        if import_error is not None:
            raise import_error
        return mod if name == "kvikio" else mod.defaults
    monkeypatch.setattr(kvikio_backend.importlib, "import_module", import_module)

    def cdll(name):
        if not driver:
            raise OSError(f"{name}: cannot open shared object file: No such file or directory")
        return object()
    monkeypatch.setattr(kvikio_backend.ctypes, "CDLL", cdll)
    return mod


@pytest.fixture
def data_file(tmp_path):
    data = np.random.default_rng(3).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    p = tmp_path / "d.bin"
    p.write_bytes(data)
    return p, data


def _read_ok(path, data):
    with get_backend("kvikio").open(path, queue_depth=2) as fh:
        a = np.zeros(5000, dtype=np.uint8)
        assert fh.read(a, 4096, 5000) == 5000
        assert a.tobytes() == data[4096:9096]


@pytest.mark.parametrize("error, says", [
    (ImportError("No module named 'kvikio'"), "not installed"),
    (OSError("libcufile.so.0: cannot open shared object file"), "failed to import: OSError"),
    (RuntimeError("CUDA driver version is insufficient"), "failed to import: RuntimeError"),
])
def test_import_failures_are_unavailable_with_the_reason(monkeypatch, data_file, error, says):
    _fake_kvikio(monkeypatch, import_error=error)
    a = KvikioBackend.availability()
    assert not a.available and says in a.reason
    assert "unavailable" in KvikioBackend().describe()
    with pytest.raises(BackendUnavailable, match=says):
        get_backend("kvikio").open(data_file[0])


def test_no_driver_is_unavailable_with_the_reason(monkeypatch, data_file):
    _fake_kvikio(monkeypatch, driver=False)
    a = KvikioBackend.availability()
    assert not a.available and "libcuda.so.1" in a.reason
    with pytest.raises(BackendUnavailable, match="libcuda"):
        get_backend("kvikio").open(data_file[0])


def test_cufile_runtime_error_is_unavailable_and_auto_falls_back(monkeypatch, data_file,
                                                                tmp_path):
    """A box with GDS misconfigured: ``CuFile`` raises RuntimeError when a file is opened."""
    def broken(path, mode):
        raise RuntimeError("cuFile error: GPUDirect Storage not supported on current file "
                           "(cuFileHandleRegister failed: 5030)")
    _fake_kvikio(monkeypatch, cufile=broken)
    path, data = data_file
    assert KvikioBackend.availability().available
    with pytest.raises(BackendUnavailable, match="CuFile cannot open.*RuntimeError.*5030"):
        get_backend("kvikio").open(path)
    c = auto.choose_backend(path, read_size=256 << 10, probe_bytes=1 << 20, cache_dir=tmp_path)
    assert c.backend in ("direct", "buffered") and "5030" in c.skipped["kvikio"]
    assert "kvikio" in c.reason
    with auto.open_file(path, cache_dir=tmp_path, read_size=256 << 10) as fh:
        assert fh.backend.name != "kvikio"


def test_older_kvikio_without_defaults_get_opens_and_reads(monkeypatch, data_file):
    mod = _fake_kvikio(monkeypatch, defaults=_OldDefaults())
    path, data = data_file
    be = KvikioBackend(task_size=1 << 20)
    assert be.mode() == "compat"
    _read_ok(path, data)
    with be.open(path, queue_depth=6):
        pass
    assert mod.defaults.n == 6 and mod.defaults.task == 1 << 20     # the older setters
    assert "6 threads" in be.describe()


def test_a_kvikio_that_cannot_report_or_set_anything_still_reads(monkeypatch, data_file):
    _fake_kvikio(monkeypatch, defaults=types.SimpleNamespace())
    path, data = data_file
    assert KvikioBackend().mode() == "unknown"
    _read_ok(path, data)
    assert "? threads" in KvikioBackend().describe()


def test_current_kvikio_settings_go_through_get_and_set(monkeypatch, data_file):
    mod = _fake_kvikio(monkeypatch)
    path, data = data_file
    _read_ok(path, data)
    assert mod.defaults.values["num_threads"] == 4 and mod.defaults.values["auto_direct_io_read"]


def test_auto_picks_kvikio_only_when_it_measured_faster(monkeypatch, data_file, tmp_path):
    _fake_kvikio(monkeypatch)
    path, _ = data_file
    for kv, want in ((0.95, "direct"), (1.2, "kvikio")):
        monkeypatch.setattr(auto, "probe_backends", lambda *a, kv=kv, **k: (
            {"kvikio": kv, "direct": 1.0, "buffered": 0.9}, {}, 256 << 10))
        c = auto.choose_backend(path, cache_dir=tmp_path / str(kv))
        assert c.backend == want and c.destination == "host" and "into host memory" in c.reason
    with pytest.raises(Exception, match="not probed"):
        auto.choose_backend(path, cache_dir=tmp_path, destination="device")
