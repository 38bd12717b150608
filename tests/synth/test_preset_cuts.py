"""A ``--like`` preset of every architecture, cut to its leading dense blocks and one MoE layer
(k + 2 routed experts, a 2048-token vocabulary; the real widths, heads, RoPE and routing
settings), through synth → repack → the engine: on a RAM tier of exactly k experts, under the
default policy and LRU, a prompt decoded token by token equals the batch's logits (a tier of k
experts used to fail at the first token: a seeded window LFU, per-layer quotas)."""

from __future__ import annotations

import os

import pytest
import torch

from expertfs.runtime.engine import Engine
from expertfs.store.repack import repack
from expertfs.synth import SynthConfig, synthesize

TOKENS = [5, 100, 200, 37, 400, 12, 7, 300, 255, 1, 2, 3, 77, 500]
#: one preset an architecture (the cheapest where there is a choice; both GLM-5 models)
PRESETS = ["Qwen3-30B-A3B", "Mixtral-8x7B", "gpt-oss-20b", "GLM-4.5-Air", "DeepSeek-V2-Lite",
           "GLM-5.2", "GLM-5.3-Flash"]


def _cut(like: str, quant: str) -> SynthConfig:
    base = SynthConfig.like(like)
    grouped = (base.expert_group_count or 1) > 1
    return SynthConfig.like(like, layers=max(2, base.n_dense_lead + 1), n_vocab=2048, quant=quant,
                            n_experts=16 if grouped else base.n_expert_used + 2)


def _store(tmp_path, like: str, quant: str) -> tuple[str, SynthConfig]:
    cfg = _cut(like, quant)
    gguf, store = str(tmp_path / "m.gguf"), str(tmp_path / "m.efs")
    synthesize(cfg, gguf)
    repack([gguf], store)
    return store, cfg


@pytest.mark.parametrize("like", PRESETS)
def test_a_tier_of_k_experts_decodes_as_the_batch(tmp_path, like):
    store, cfg = _store(tmp_path, like, "q4_0")
    n_moe = cfg.n_layers - cfg.n_dense_lead
    stride = os.path.getsize(os.path.join(store, "experts.bin")) // (n_moe * cfg.n_experts)
    for policy in ("default", "lru"):
        with Engine.open(store, provider="tiered", ram_bytes=stride * cfg.n_expert_used,
                         provider_options={"policy": policy, "warm_start": False}) as e:
            batch = e.logits(TOKENS)
            e.reset()
            steps = [e.prefill(TOKENS[:3]).reshape(-1, batch.shape[-1])[-1:]]
            steps += [e.decode(t).reshape(1, -1) for t in TOKENS[3:]]
        assert (torch.cat(steps) - batch[2:]).abs().max() < 1e-4, policy

