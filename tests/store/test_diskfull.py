"""A full disk: a clear error, and nothing left behind (a real tmpfs of a few MB, as root)."""

from __future__ import annotations

import os
import subprocess
import uuid

import pytest
from gguf import GGMLQuantizationType as T

from expertfs.errors import DiskFullError
from expertfs.store.repack import repack
from support.gguf_builders import moe_gguf


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / f"fs-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_full_disk_is_a_clear_error_and_cleans_up(tmp_path, small_fs):
    src = moe_gguf(tmp_path / "m.gguf", layers=2, experts=8, hidden=256, ff=256,
                   types=(T.F16, T.F16, T.F16))[0]
    assert src.stat().st_size > 3 << 20
    out = small_fs / "m.efs"
    with pytest.raises(DiskFullError, match="full") as ei:
        repack([str(src)], str(out))
    assert "removed" in str(ei.value)
    assert os.listdir(small_fs) == []
