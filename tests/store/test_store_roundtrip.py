"""repack → verify → unpack on GGUFs written by gguf-py, checked against gguf-py's reader."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader

from expertfs.errors import UnsupportedModelError, UsageError
from expertfs.formats.moe_names import Role
from expertfs.store.layout import PART_ALIGN
from expertfs.store.repack import repack
from expertfs.store.reader import Store
from expertfs.store.unpack import unpack
from expertfs.store.verify import verify
from support.gguf_builders import QUANTISABLE, moe_gguf


def _roundtrip(tmp_path: Path, files: list[Path], **kw) -> Store:
    store = tmp_path / "m.efs"
    repack([str(f) for f in files], str(store), **kw)
    rep = verify(str(store), [str(f) for f in files])
    assert rep.ok, rep.problems
    s = Store.open(str(store))
    reader_files = [GGUFReader(f) for f in files]
    raw = {t.name: (f, t) for f, r in zip(files, reader_files) for t in r.tensors}
    with open(s.experts_path, "rb") as ef:
        data = ef.read()
    for ext in s.extents():
        assert ext.offset % s.alignment == 0 and ext.length % s.alignment == 0
        for p in ext.parts:
            assert p.rel_offset % PART_ALIGN == 0
            rec = s.tensors()[p.tensor_index]
            f, t = raw[rec.name]
            got = data[ext.offset + p.rel_offset: ext.offset + p.rel_offset + p.nbytes]
            # gguf-py's view of expert e of this tensor (numpy shape is reversed ne)
            want = np.ascontiguousarray(t.data[ext.expert]).tobytes()
            assert got == want, (rec.name, ext.layer, ext.expert)
    if len(files) == 1:
        out = tmp_path / "back.gguf"
        unpack(str(store), str(out))
        assert out.read_bytes() == files[0].read_bytes()
    return s


@pytest.mark.parametrize("qt", QUANTISABLE, ids=lambda t: t.name)
def test_roundtrip_every_quantisable_type(tmp_path, qt):
    files = moe_gguf(tmp_path / "m.gguf", types=(qt, qt, T.Q8_0), hidden=64, ff=64)
    _roundtrip(tmp_path, files).close()


def test_mixed_types_fused_gate_up_and_biases(tmp_path):
    files = moe_gguf(tmp_path / "m.gguf", types=(T.MXFP4, T.MXFP4, T.Q5_1), fused=True, biases=True)
    s = _roundtrip(tmp_path, files)
    roles = [p.role for p in s.extent(0, 0).parts]
    assert roles == [Role.GATE_UP, Role.DOWN, Role.GATE_BIAS, Role.UP_BIAS, Role.DOWN_BIAS]
    s.close()


def test_nextn_layer_is_marked(tmp_path):
    files = moe_gguf(tmp_path / "m.gguf", arch="glm4moe", layers=2, nextn=1)
    s = _roundtrip(tmp_path, files)
    assert s.layers == [0, 1, 2]
    assert [s.layer_info(i)["nextn"] for i in s.layers] == [False, False, True]
    s.close()


@pytest.mark.parametrize("align", [4096, 64 << 10, 2 << 20])
def test_alignment_options(tmp_path, align):
    files = moe_gguf(tmp_path / "m.gguf", alignment=64)
    s = _roundtrip(tmp_path, files, alignment=align)
    assert s.alignment == align
    s.close()


def test_split_gguf_reads_as_one_model(tmp_path):
    files = moe_gguf(tmp_path / "m.gguf", layers=3, split_max_tensors=7)
    assert len(files) > 1 and files[0].name.endswith("-00001-of-%05d.gguf" % len(files))
    s = _roundtrip(tmp_path, files)
    assert len(s.summary["sources"]) == len(files)
    # the first shard alone finds its siblings
    repack([str(files[0])], str(tmp_path / "again.efs"))
    assert verify(str(tmp_path / "again.efs"), [str(files[0])]).ok
    # unpack of a split source: one GGUF with the same tensors and metadata minus split.*
    out = tmp_path / "merged.gguf"
    unpack(str(tmp_path / "again.efs"), str(out))
    r = GGUFReader(out)
    assert [t.name for t in r.tensors] == [t.name for f in files for t in GGUFReader(f).tensors]
    assert "split.count" not in r.fields
    s.close()


def test_small_windows_cut_big_trunk_tensors(tmp_path, monkeypatch):
    files = moe_gguf(tmp_path / "m.gguf", hidden=256)
    store = tmp_path / "w.efs"
    repack([str(files[0])], str(store), window_bytes=8192)
    assert verify(str(store), [str(files[0])]).ok
    unpack(str(store), str(tmp_path / "b.gguf"))
    assert (tmp_path / "b.gguf").read_bytes() == files[0].read_bytes()


def test_dense_model_is_refused_clearly(tmp_path):
    f = moe_gguf(tmp_path / "dense.gguf", dense=True)[0]
    with pytest.raises(UnsupportedModelError, match="dense"):
        repack([str(f)], str(tmp_path / "d.efs"))
    assert not os.listdir(tmp_path) == [] and not (tmp_path / "d.efs").exists()
    assert not (tmp_path / "d.efs.partial").exists()


def test_existing_output_refused_then_forced(tmp_path, tiny_gguf):
    out = tmp_path / "m.efs"
    repack([str(tiny_gguf)], str(out))
    before = sorted(os.listdir(out))
    with pytest.raises(UsageError, match="already exists"):
        repack([str(tiny_gguf)], str(out))
    assert sorted(os.listdir(out)) == before
    repack([str(tiny_gguf)], str(out), force=True)
    assert verify(str(out)).ok
    assert not any(p.name.startswith("m.efs.") for p in tmp_path.iterdir())


def test_force_never_replaces_a_user_folder(tmp_path, tiny_gguf):
    user = tmp_path / "photos"
    user.mkdir()
    (user / "cat.jpg").write_bytes(b"meow")
    with pytest.raises(UsageError, match="not an expertfs store"):
        repack([str(tiny_gguf)], str(user), force=True)
    assert (user / "cat.jpg").read_bytes() == b"meow"


def test_output_over_the_source_is_refused(tmp_path, tiny_gguf):
    with pytest.raises(UsageError, match="overwrite the model"):
        repack([str(tiny_gguf)], str(tiny_gguf), force=True)


def test_verify_reports_each_bad_extent(tmp_path, tiny_gguf):
    out = tmp_path / "m.efs"
    repack([str(tiny_gguf)], str(out))
    s = Store.open(str(out))
    e1, e2 = s.extent(0, 1), s.extent(1, 3)
    s.close()
    with open(out / "experts.bin", "r+b") as f:
        for e in (e1, e2):
            f.seek(e.offset + e.parts[1].rel_offset + 5)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0xFF]))
    rep = verify(str(out))
    assert not rep.ok
    assert any("layer 0 expert 1" in p for p in rep.problems)
    assert any("layer 1 expert 3" in p for p in rep.problems)
    assert len(rep.problems) == 2


def test_unpack_refuses_corrupt_store(tmp_path, tiny_gguf):
    from expertfs.errors import IntegrityError
    out = tmp_path / "m.efs"
    repack([str(tiny_gguf)], str(out))
    with open(out / "experts.bin", "r+b") as f:
        f.seek(10)
        f.write(b"\xff\xff")
    with pytest.raises(IntegrityError, match="layer 0 expert 0"):
        unpack(str(out), str(tmp_path / "x.gguf"))
    assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "x.gguf.partial").exists()
