"""``repack --consume-source``: the GGUF's blocks are released as the store fills, refusals are
typed, and the store unpacks to the original GGUF bit for bit."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as T

import expertfs.store.repack as rp
from expertfs.cli import main
from expertfs.errors import DiskFullError, UsageError
from expertfs.store import consume, consume_checks
from expertfs.store.inspect import inspect_path
from expertfs.store.unpack import unpack
from support.gguf_builders import moe_gguf

WINDOW = 64 << 10


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _model(path: Path, **kw) -> Path:
    kw.setdefault("types", (T.F16, T.F16, T.F16))
    return moe_gguf(path, layers=kw.pop("layers", 4), experts=16, hidden=256, ff=256, **kw)[0]


@pytest.fixture
def small_ckpt(monkeypatch):
    monkeypatch.setattr(rp, "CHECKPOINT_BYTES", 256 << 10)


def _mount(tmp_path: Path, kind: str, size: str) -> Path:
    mnt = tmp_path / f"{kind}-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    cmd = ["mount", "-t", kind, "-o", f"size={size}", kind, str(mnt)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a {kind} here (needs root): {r.stderr.strip()}")
    return mnt


@pytest.fixture
def mounts(tmp_path):
    made: list[Path] = []

    def make(kind: str, size: str = "16m") -> Path:
        made.append(_mount(tmp_path, kind, size))
        return made[-1]
    yield make
    for m in made:
        subprocess.run(["umount", str(m)], check=False)


def _consume_and_check(src: Path, out: Path, back: Path) -> list[int]:
    """Repack in place, sampling the source's allocated bytes; unpack must give it back."""
    want, size = _sha(src), src.stat().st_size
    allocated: list[int] = []
    freed: list[int] = []
    res = rp.repack([str(src)], str(out), window_bytes=WINDOW, consume_source=True,
                    progress=lambda d, t: allocated.append(os.stat(src).st_blocks * 512),
                    on_freed=freed.append)
    assert not src.exists()                     # deleted once the store was published
    assert res.summary["in_place"]["released_bytes"] == freed[-1] > size * 0.9
    assert freed == sorted(freed) and len(freed) > 5
    assert inspect_path(str(out))["in_place"]["sources"] == [src.name]
    unpack(str(out), str(back))
    assert _sha(back) == want
    return allocated


def test_punches_behind_the_windows_on_ext4_and_unpacks_bit_for_bit(tmp_path, small_ckpt):
    src = _model(tmp_path / "m.gguf")
    assert consume.fs_type(str(tmp_path)) != "unknown"
    alloc = _consume_and_check(src, tmp_path / "m.efs", tmp_path / "back.gguf")
    assert alloc[-1] < alloc[0] // 4           # the source shrank while the store grew


def test_split_gguf_is_consumed_shard_by_shard(tmp_path, small_ckpt):
    shards = moe_gguf(tmp_path / "s.gguf", layers=4, experts=16, hidden=256, ff=256,
                      types=(T.F16, T.F16, T.F16), split_max_tensors=12)
    assert len(shards) > 2
    joined = tmp_path / "joined.efs"
    rp.repack([str(p) for p in shards], str(joined))     # the merged GGUF, for comparison
    unpack(str(joined), str(tmp_path / "want.gguf"))
    seen: list[list[int]] = []
    rp.repack([str(shards[0])], str(tmp_path / "s.efs"), window_bytes=WINDOW,
              consume_source=True,
              progress=lambda d, t: seen.append([os.stat(p).st_blocks for p in shards]))
    assert not any(p.exists() for p in shards)
    assert any(s[0] < seen[0][0] and s[-1] == seen[0][-1] for s in seen) or \
        any(s[-1] < seen[0][-1] and s[0] == seen[0][0] for s in seen)  # one shard before another
    unpack(str(tmp_path / "s.efs"), str(tmp_path / "back.gguf"))
    assert _sha(tmp_path / "back.gguf") == _sha(tmp_path / "want.gguf")


def test_tmpfs_too_small_for_two_copies_builds_in_place(tmp_path, mounts, small_ckpt):
    fs = mounts("tmpfs", "16m")
    src = _model(fs / "m.gguf", layers=2)
    assert 8 << 20 < src.stat().st_size < 14 << 20
    with pytest.raises(DiskFullError, match="removed"):
        rp.repack([str(src)], str(fs / "a.efs"), window_bytes=WINDOW)
    assert sorted(os.listdir(fs)) == ["m.gguf"]
    _consume_and_check(src, fs / "m.efs", tmp_path / "back.gguf")


def test_disk_full_mid_run_keeps_the_partial_store_and_resumes(tmp_path, mounts, small_ckpt):
    fs = mounts("tmpfs", "16m")
    src = _model(fs / "m.gguf", layers=2)
    want = _sha(src)
    ballast = fs / "ballast"

    def fill(done: int, total: int) -> None:
        if done > total // 2 and not ballast.exists():
            with open(ballast, "wb") as f:
                try:
                    while True:
                        f.write(bytes(1 << 16))
                        f.flush()
                except OSError:
                    pass
    with pytest.raises(DiskFullError, match="kept") as ei:
        rp.repack([str(src)], str(fs / "m.efs"), window_bytes=WINDOW, consume_source=True,
                  progress=fill)
    assert "run the same command again" in str(ei.value)
    assert (fs / "m.efs.partial" / consume.CONSUMING).exists()
    ballast.unlink()
    res = rp.repack([str(src)], str(fs / "m.efs"), window_bytes=WINDOW, consume_source=True)
    assert res.resumed_from_bytes > 0 and not src.exists()
    unpack(str(fs / "m.efs"), str(tmp_path / "back.gguf"))
    assert _sha(tmp_path / "back.gguf") == want


def test_refused_where_holes_cannot_be_punched(tmp_path, mounts):
    fs = mounts("ramfs")                   # a real file system without fallocate
    src = _model(fs / "m.gguf", layers=1)
    want = _sha(src)
    with pytest.raises(UsageError, match=r"\(ramfs\) cannot punch holes"):
        rp.repack([str(src)], str(tmp_path / "m.efs"), consume_source=True)
    assert _sha(src) == want and not (tmp_path / "m.efs.partial").exists()


def test_refused_by_a_failing_probe(tmp_path, monkeypatch):
    src = _model(tmp_path / "m.gguf", layers=1)
    monkeypatch.setattr(consume_checks, "_probe", lambda d: OSError(95, "Operation not supported"))
    with pytest.raises(UsageError, match="cannot punch holes"):
        rp.repack([str(src)], str(tmp_path / "m.efs"), consume_source=True)


@pytest.mark.parametrize("case", ["symlink", "hardlink", "trailing"])
def test_refusals_leave_the_source_alone(tmp_path, case, capsys):
    src = _model(tmp_path / "m.gguf", layers=1)
    arg = src
    if case == "symlink":
        arg = tmp_path / "link.gguf"
        arg.symlink_to(src)
    elif case == "hardlink":
        os.link(src, tmp_path / "other.gguf")
    else:                                        # bytes after the data that unpack would drop
        with open(src, "ab") as fh:
            fh.write(b"\x01")
    want = _sha(src)
    assert main(["repack", str(arg), "-o", str(tmp_path / "m.efs"), "--consume-source"]) == 2
    err = capsys.readouterr().err
    assert {"symlink": "symbolic link", "hardlink": "hard links", "trailing": "bit for bit"}[case] in err
    assert "Traceback" not in err
    assert _sha(src) == want and not (tmp_path / "m.efs").exists()


def test_published_but_not_yet_deleted_finishes_on_rerun(tmp_path, monkeypatch, small_ckpt):
    src = _model(tmp_path / "m.gguf", layers=1)
    want = _sha(src)

    def die(*a):
        raise KeyboardInterrupt
    monkeypatch.setattr(consume, "finish_in_place", die)
    with pytest.raises(KeyboardInterrupt):
        rp.repack([str(src)], str(tmp_path / "m.efs"), window_bytes=WINDOW, consume_source=True)
    assert src.exists() and (tmp_path / "m.efs").is_dir()
    monkeypatch.undo()
    monkeypatch.setattr(rp, "CHECKPOINT_BYTES", 256 << 10)
    rp.repack([str(src)], str(tmp_path / "m.efs"), window_bytes=WINDOW, consume_source=True)
    assert not src.exists() and not (tmp_path / "m.efs" / consume.CONSUMING).exists()
    assert main(["inspect", str(tmp_path / "m.efs")]) == 0
    unpack(str(tmp_path / "m.efs"), str(tmp_path / "back.gguf"))
    assert _sha(tmp_path / "back.gguf") == want


RUNNER = """
import json, sys, time, random
import expertfs.store.repack as r
r.CHECKPOINT_BYTES = 256 << 10
def tick(done, total):
    print("window", done, flush=True)
res = r.repack([sys.argv[1]], sys.argv[2], window_bytes=64 << 10, consume_source=True,
               progress=tick, resume=sys.argv[3] == "resume")
print(json.dumps({"resumed": res.resumed_from_bytes}), flush=True)
"""


def _run(src: Path, out: Path, mode: str = "resume") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", RUNNER, str(src), str(out), mode],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_kill_9_at_random_points_then_resume_gives_the_gguf_back(tmp_path):
    import random
    import shutil
    import signal
    import time
    pristine = _model(tmp_path / "pristine.gguf", layers=2)
    want = _sha(pristine)
    rng = random.Random(20)
    resumed = 0
    for trial in range(20):
        src, out = tmp_path / "m.gguf", tmp_path / "m.efs"
        shutil.copyfile(pristine, src)
        for _ in range(rng.choice((1, 1, 2, 3))):          # kill it, and sometimes its resume
            p = _run(src, out)
            for _ in range(rng.randrange(0, 200)):
                if not p.stdout.readline():
                    break
            time.sleep(rng.random() * 0.01)
            p.send_signal(signal.SIGKILL)
            p.communicate(timeout=60)
        p = _run(src, out)
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr
        resumed += json.loads(stdout.splitlines()[-1])["resumed"] > 0
        assert not src.exists() and not Path(str(out) + ".partial").exists()
        unpack(str(out), str(tmp_path / "back.gguf"), force=True)
        assert _sha(tmp_path / "back.gguf") == want, f"trial {trial}"
        shutil.rmtree(out)
    assert resumed >= 10


def test_an_interrupted_in_place_repack_cannot_start_over(tmp_path, monkeypatch, small_ckpt):
    src = _model(tmp_path / "m.gguf", layers=2)
    want = _sha(src)

    def stop(done: int, total: int) -> None:
        if done > total // 2:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        rp.repack([str(src)], str(tmp_path / "m.efs"), window_bytes=WINDOW, consume_source=True,
                  progress=stop)
    for kw in ({}, {"consume_source": True, "resume": False},
               {"consume_source": True, "window_bytes": 2 * WINDOW}):
        with pytest.raises(UsageError, match="cannot start over"):
            rp.repack([str(src)], str(tmp_path / "m.efs"), **{"window_bytes": WINDOW, **kw})
    rp.repack([str(src)], str(tmp_path / "m.efs"), window_bytes=WINDOW, consume_source=True)
    unpack(str(tmp_path / "m.efs"), str(tmp_path / "back.gguf"))
    assert _sha(tmp_path / "back.gguf") == want
