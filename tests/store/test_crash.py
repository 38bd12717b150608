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
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as T

from expertfs.store.repack import repack
from expertfs.store.reader import Store
from expertfs.store.unpack import unpack
from expertfs.store.verify import verify
from support.gguf_builders import moe_gguf

# Small windows and checkpoints so a 50 MB model has hundreds of kill points (test-only knobs).
RUNNER = """
import json, sys
import expertfs.store.repack as r
r.CHECKPOINT_BYTES = 256 << 10
tick = lambda done, total: print("window", done, flush=True)
res = r.repack([sys.argv[1]], sys.argv[2], window_bytes=64 << 10, progress=tick)
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
    n_windows = sum(1 for line in p.communicate(timeout=120)[0].splitlines()
                    if line.startswith("window"))
    assert p.returncode == 0 and n_windows > 50
    rng = random.Random(1234)
    resumed = []
    for _ in range(8):
        p = _start(src, out)
        seen = []
        for _ in range(rng.randrange(0, n_windows)):    # kill after a random window (or later)
            line = p.stdout.readline()
            if not line:
                break
            seen.append(line)
        p.send_signal(signal.SIGKILL)
        stdout, _ = p.communicate(timeout=60)
        for line in seen + stdout.splitlines():
            if line.startswith("{"):               # it finished: did it resume?
                resumed.append(json.loads(line)["resumed"])
        if out.exists():                          # published before the kill: complete
            assert verify(str(out), [str(src)]).ok
            assert not Path(str(out) + ".partial").exists()
            shutil.rmtree(out)
        with pytest.raises(Exception):
            Store.open(str(out))             # never a half store under the final name
    res = repack([str(src)], str(out), window_bytes=64 << 10)   # the same options resume
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
    import expertfs.store.repack as r
    partial = Path(str(out) + ".partial")
    # leave a partial store of source a (as a crash would), then repack a different file
    r.repack([str(a)], str(out))
    os.rename(out, partial)
    b = moe_gguf(tmp_path / "a.gguf", seed=2)[0]
    res = repack([str(b)], str(out))
    assert res.resumed_from_bytes == 0
    assert verify(str(out), [str(b)]).ok
