"""kill -9 a real repack at random moments: there is never a half-written store, and running
it again resumes (or restarts) to a store equal to the source byte for byte."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as T

from expertfs.repack import repack
from expertfs.store import Store
from expertfs.unpack import unpack
from expertfs.verify import verify
from gguf_builders import moe_gguf

# Small windows and checkpoints so a 50 MB model has hundreds of kill points (test-only knobs).
RUNNER = """
import json, sys
import expertfs.repack as r
r.CHECKPOINT_BYTES = 256 << 10
print('started', flush=True)
res = r.repack([sys.argv[1]], sys.argv[2], window_bytes=64 << 10)
print(json.dumps({"resumed": res.resumed_from_bytes}))
"""


def _start(src: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", RUNNER, str(src), str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_kill_9_anywhere_then_resume(tmp_path):
    src = moe_gguf(tmp_path / "m.gguf", layers=4, experts=16, hidden=512, ff=256,
                   types=(T.F16, T.F16, T.F16))[0]
    out = tmp_path / "m.efs"
    p = _start(src, tmp_path / "calib.efs")
    assert p.stdout.readline().strip() == "started"       # imports done: time the repack itself
    t0 = time.perf_counter()
    p.communicate(timeout=120)
    full = time.perf_counter() - t0
    assert p.returncode == 0
    rng = random.Random(1234)
    resumed = []
    for _ in range(8):
        p = _start(src, out)
        p.stdout.readline()
        time.sleep(rng.uniform(0.0, full))
        p.send_signal(signal.SIGKILL)
        stdout, _ = p.communicate(timeout=60)
        if stdout.strip():                    # the run finished before the kill
            resumed.append(json.loads(stdout.strip().splitlines()[-1])["resumed"])
            assert verify(str(out)).ok
            assert not Path(str(out) + ".partial").exists()
            shutil.rmtree(out)
        with pytest.raises(Exception):
            Store.open(str(out))             # never a half store under the final name
    res = repack([str(src)], str(out))
    resumed.append(res.resumed_from_bytes)
    assert any(r > 0 for r in resumed), "no kill landed after a checkpoint: nothing resumed"
    rep = verify(str(out), [str(src)])
    assert rep.ok, rep.problems
    unpack(str(out), str(tmp_path / "back.gguf"))
    assert (tmp_path / "back.gguf").read_bytes() == src.read_bytes()
    assert not Path(str(out) + ".partial").exists()


def test_changed_source_restarts_instead_of_resuming(tmp_path):
    a = moe_gguf(tmp_path / "a.gguf", seed=1)[0]
    out = tmp_path / "m.efs"
    import expertfs.repack as r
    partial = Path(str(out) + ".partial")
    # leave a partial store of source a (as a crash would), then repack a different file
    r.repack([str(a)], str(out))
    os.rename(out, partial)
    b = moe_gguf(tmp_path / "a.gguf", seed=2)[0]
    res = repack([str(b)], str(out))
    assert res.resumed_from_bytes == 0
    assert verify(str(out), [str(b)]).ok
