"""A small ``--like GLM-5.3-Flash --layers 4`` model in the Maya-S mix survives repack → verify →
unpack bit for bit: every new tensor kind (mHC, KDA with its 4-D convolutions and ``ssm_a``, the
k-pool indexer, the NextN block and its experts), the F32 mixing weights byte-exact in trunk.bin;
and a tiny GLM-5.2 (glm-dsa) as well."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from expertfs.store.reader import Store
from expertfs.store.repack import repack
from expertfs.store.unpack import unpack
from expertfs.store.verify import verify
from expertfs.synth import SynthConfig, synthesize

_F32_EXACT = ("hc_attn_", "hc_ffn_", "ssm_a", "ssm_dt", "ssm_conv1d", "exp_probs_b",
              "indexer_compressor_", "ffn_gate_inp")


def _round_trip(tmp_path: Path, cfg: SynthConfig) -> None:
    src = synthesize(cfg, str(tmp_path / "m.gguf"))[0]
    store = tmp_path / "m.efs"
    repack([src], str(store))
    rep = verify(str(store), [src])
    assert rep.ok, rep.problems
    views = {t.name: t for t in GGUFReader(src).tensors}
    with Store.open(str(store)) as s:
        assert s.architecture == cfg.arch
        assert sorted(s.layers) == [i for i in range(cfg.block_count) if cfg.is_moe_block(i)]
        trunk = Path(s.trunk_path).read_bytes()
        exact = 0
        for name, rec in s.trunk_tensors().items():
            if any(k in name for k in _F32_EXACT):
                assert rec.ggml_type.name == "F32", name
                got = trunk[rec.offset:rec.offset + rec.nbytes]
                assert got == np.ascontiguousarray(views[name].data).tobytes(), name
                exact += 1
        assert exact > 0
    out = tmp_path / "back.gguf"
    unpack(str(store), str(out))
    assert out.read_bytes() == Path(src).read_bytes()


@pytest.mark.slow
def test_glm53_flash_4_layers_maya_s(tmp_path):
    # the real per-layer structure (4 mHC streams, KDA 128-dim heads, MLA 1536/512/256, indexer
    # 32x128 k-pool 16), narrowed so the file stays small
    cfg = SynthConfig.like("GLM-5.3-Flash", layers=4, quant="maya-s").replace(
        n_embd=512, n_head=8, n_experts=16, n_vocab=1024, n_ff=1024, n_ff_exp=512).validate()
    _round_trip(tmp_path, cfg)


def test_glm_dsa_tiny(tmp_path):
    _round_trip(tmp_path, SynthConfig.tiny("glm-dsa", quant="maya-s"))
