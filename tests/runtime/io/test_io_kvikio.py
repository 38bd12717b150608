"""kvikio's host path, exercised here without a GPU under a stub CUDA driver.

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
from pathlib import Path

import pytest

pytest.importorskip("kvikio", reason="kvikio is an optional extra (pip install 'expertfs[kvikio]')")

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
    stub = _build_stub(tmp_path)
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = f"{stub}:{env.get('LD_LIBRARY_PATH', '')}".rstrip(":")
    env["EXPERTFS_CACHE_DIR"] = str(tmp_path / "cache")
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), str(Path(__file__).parent)],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "KVIKIO-HOST-OK kvikio (compat mode" in out.stdout
