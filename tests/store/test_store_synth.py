"""Every architecture and quant type ``expertfs synth`` makes survives repack → unpack bit for
bit, and each extent's parts equal gguf-py's view of the expert's slice."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from expertfs.store.repack import repack
from expertfs.store.reader import Store
from expertfs.synth import ARCHES, SynthConfig, synthesize
from expertfs.store.unpack import unpack
from expertfs.store.verify import verify


def _check(tmp_path: Path, files: list[str]) -> set[str]:
    store = tmp_path / "s.efs"
    repack(files, str(store))
    rep = verify(str(store), files)
    assert rep.ok, rep.problems
    views = {t.name: t for f in files for t in GGUFReader(f).tensors}
    types = set()
    with Store.open(str(store)) as s, open(s.experts_path, "rb") as ef:
        data = ef.read()
        tensors = s.tensors()
        assert sum(1 for _ in s.extents()) == sum(s.n_experts(layer) for layer in s.layers)
        for e in s.extents():
            for p in e.parts:
                t = views[tensors[p.tensor_index].name]
                types.add(p.ggml_type.name)
                got = data[e.offset + p.rel_offset:e.offset + p.rel_offset + p.nbytes]
                assert got == np.ascontiguousarray(t.data[e.expert]).tobytes()
    out = tmp_path / "back.gguf"
    unpack(str(store), str(out))
    if len(files) == 1:
        assert out.read_bytes() == Path(files[0]).read_bytes()
    return types


@pytest.mark.parametrize("arch", ARCHES)
def test_every_arch_mixed_types(tmp_path, arch):
    cfg = SynthConfig.tiny(arch).replace(quant="mixed", n_layers=4)
    files = synthesize(cfg, str(tmp_path / f"{arch}.gguf"))
    _check(tmp_path, files)


def test_mixed_preset_covers_every_type_in_experts(tmp_path):
    from expertfs.synth import MIXED_TYPES
    cfg = SynthConfig.tiny("qwen3moe").replace(quant="mixed", n_layers=len(MIXED_TYPES))
    files = synthesize(cfg, str(tmp_path / "all.gguf"))
    types = _check(tmp_path, files)
    assert {t.name for t in MIXED_TYPES} <= types


def test_split_synth_roundtrip(tmp_path):
    cfg = SynthConfig.tiny("glm4moe").replace(n_layers=4)
    single = synthesize(cfg, str(tmp_path / "one.gguf"))
    files = synthesize(cfg, str(tmp_path / "sp.gguf"), split_max_bytes=1 << 20)
    assert len(files) > 1
    _check(tmp_path, files)
    unpack(str(tmp_path / "s.efs"), str(tmp_path / "merged.gguf"), force=True)
    a, b = GGUFReader(tmp_path / "merged.gguf"), GGUFReader(single[0])
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for x, y in zip(a.tensors, b.tensors):
        assert np.array_equal(np.asarray(x.data), np.asarray(y.data))
