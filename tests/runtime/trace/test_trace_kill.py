"""A trace writer killed with SIGKILL at a random point leaves a file that loads up to its last
complete chunk (``allow_partial=True``), and says it is unfinished otherwise; ``expertfs run
--trace`` killed mid-run leaves such a trace and its store untouched (``verify`` passes)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from expertfs.runtime.trace.file import TraceError, TraceReader, read_trace

ROOT = Path(__file__).resolve().parents[3]
ROWS = 16                                     # rows per chunk in the writer below

_WRITER = textwrap.dedent("""
    import sys
    from expertfs.runtime.trace.file import TraceHeader, TraceWriter
    h = TraceHeader(3, 32, 4, (0, 4096, 4096))
    with TraceWriter(sys.argv[1], h, chunk_rows=%d) as w:
        t = 0
        while True:                            # rows are a function of their index
            w.add(t // 2, 1 + t %% 2, [(t + j) %% 32 for j in range(4)], [0.25] * 4)
            t += 1
""" % ROWS)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    return env


def _kill_when(proc: subprocess.Popen, path: Path, min_bytes: int, delay: float,
               limit: float = 60.0) -> None:
    """SIGKILL ``proc`` ``delay`` seconds after ``path`` holds ``min_bytes``."""
    t0 = time.monotonic()
    while not (path.exists() and path.stat().st_size >= min_bytes):
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else proc.returncode
        assert time.monotonic() - t0 < limit, "the writer never wrote"
        time.sleep(0.01)
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def _check_prefix(path: Path, rows_per_chunk: int) -> int:
    """The file loads as complete up to its last chunk; strictly read, it is unfinished."""
    with pytest.raises(TraceError) as e:
        read_trace(path)
    assert str(path) in str(e.value) and ("truncated" in str(e.value)
                                          or "End record" in str(e.value))
    with TraceReader(path, allow_partial=True) as r:
        parts = list(r.chunks())
        assert r.complete is False and r.note and r.rows == sum(len(p) for p in parts)
    assert r.rows % rows_per_chunk == 0
    return r.rows


def test_killed_writer_leaves_a_loadable_prefix(tmp_path) -> None:
    rng = random.Random(23)
    script = tmp_path / "w.py"
    script.write_text(_WRITER)
    seen = set()
    for i in range(8):
        path = tmp_path / f"t{i}.eftrace"
        proc = subprocess.Popen([sys.executable, str(script), str(path)], env=_env(),
                                stderr=subprocess.PIPE)
        _kill_when(proc, path, 1, rng.uniform(0.0, 0.4))
        if path.stat().st_size < 32:           # killed before the header: nothing to load
            with pytest.raises(TraceError, match="truncated"):
                read_trace(path, allow_partial=True)
            continue
        n = _check_prefix(path, ROWS)
        _, c = read_trace(path, allow_partial=True)
        t = np.arange(n)
        assert (c.tokens == t // 2).all() and (c.layers == 1 + t % 2).all()
        assert (c.experts == (t[:, None] + np.arange(4)) % 32).all()
        seen.add(n > 0)
    assert True in seen                        # at least one kill landed after some chunks


_RUN = textwrap.dedent("""
    import sys
    from expertfs.runtime.trace import file
    file.TraceWriter.__init__.__kwdefaults__["chunk_rows"] = 32   # chunks often, to kill mid-run
    from expertfs.cli import main
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.slow
def test_killed_run_leaves_its_trace_and_store_intact(tmp_path) -> None:
    from expertfs.store.verify import verify
    from support.cache_store import make_store
    store = make_store(tmp_path)
    before = (Path(store) / "experts.bin").read_bytes()
    script = tmp_path / "run.py"
    script.write_text(_RUN)
    rng = random.Random(5)
    for i in range(3):
        path = tmp_path / f"run{i}.eftrace"
        proc = subprocess.Popen([sys.executable, str(script), "run", str(store), "-p", "hello",
                                 "-n", "100000", "--ignore-eos", "--fused", "off",
                                 "--trace", str(path)], env=_env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        _kill_when(proc, path, 400, rng.uniform(0.0, 1.0))
        n = _check_prefix(path, 32)
        assert n > 0
        _, c = read_trace(path, allow_partial=True)
        tokens = np.unique(c.tokens)                 # every token up to the last, each once
        assert (tokens == np.arange(len(tokens))).all()
        rep = verify(str(store))
        assert rep.ok, rep.problems
    assert (Path(store) / "experts.bin").read_bytes() == before
