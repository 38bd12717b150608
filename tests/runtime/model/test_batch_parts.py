"""A prefill batch whose layer needs more experts than the RAM tier can hold at once is run in
parts (fetch, compute, release), with the same logits as one part: no CapacityError for a
small ``--ram`` and a long prompt."""

from __future__ import annotations

import pytest
import torch

from expertfs.runtime.engine import Engine
from support.cache_store import tiny_store


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return tiny_store(tmp_path_factory.mktemp("parts"))


@pytest.mark.parametrize("fused", ["auto", "off"])
def test_batch_wider_than_the_tier_runs_in_parts(store, fused):
    tokens = list(range(3, 400, 13))                    # 31 tokens: every expert of a layer
    with Engine.open(store, provider="direct", fused=fused) as e:
        want = e.logits(tokens)
        slot = max(e.store.extent(la, 0).length for la in e.store.layers)
    with Engine.open(store, provider="tiered", ram_bytes=3 * slot, fused=fused,
                     provider_options={"warm_start": False, "backend": "buffered",
                                       "record_usage": False}) as e:
        room = e.provider.max_experts_per_get
        assert 0 < room < e.config.n_experts               # the tier is narrower than a layer
        got = e.logits(tokens)
        assert e.provider.stats.misses >= e.config.n_experts
    assert torch.equal(got, want)


def test_batch_computes_experts_as_their_reads_land(store):
    """A cold tier wide enough for the layer: the batch's misses are all issued, then each
    expert is computed when its own read is in (the products of the first overlap the reads
    of the rest), with the same logits as a resident run."""
    tokens = list(range(3, 400, 13))
    with Engine.open(store, provider="direct", fused="auto") as e:
        want = e.logits(tokens)
    with Engine.open(store, provider="tiered", ram_bytes=1 << 30, fused="auto",
                     provider_options={"warm_start": False, "backend": "buffered",
                                       "record_usage": False}) as e:
        assert not 0 < e.provider.max_experts_per_get < e.config.n_experts   # one part
        got = e.logits(tokens)
        assert e.provider.stats.misses >= e.config.n_experts
        assert e.runner.stats.streamed > 0
    assert torch.equal(got, want)


def test_streamed_batch_takes_dequant_cache_hits(store):
    """The streamed batch path with the dequantized-expert cache: the second prompt's experts
    come from the cache, the logits stay those of a direct run."""
    tokens = list(range(3, 400, 13))      # the float path: the cache's (off for native types)
    with Engine.open(store, provider="direct", fused="off") as e:
        want = e.logits(tokens)
    with Engine.open(store, provider="tiered", ram_bytes=1 << 30, fused="off", dq_cache=1 << 30,
                     provider_options={"warm_start": False, "backend": "buffered",
                                       "record_usage": False}) as e:
        first = e.logits(tokens)
        again = e.logits(tokens)
        assert e.runner.stats.dq_hits > 0
    assert torch.allclose(first, want, atol=1e-4) and torch.allclose(again, want, atol=1e-4)


def test_batch_sum_is_the_per_expert_index_add(store):
    """The batch's pair buffer sums each token's weighted expert outputs in ascending expert
    order from zero: bit for bit what adding each expert's rows into a zero output with
    ``index_add_`` (experts ascending) gives, whatever order the router ranked them in."""
    from expertfs.runtime.model.ffn import expert_ffn
    with Engine.open(store, provider="direct", fused="auto") as e:
        runner, layer = e.runner, e.store.layers[0]
        blk = next(b for b in e.model.trunk.blocks if b.moe is not None)
        T, D = 9, e.config.n_embd
        x = torch.randn(T, D, generator=torch.Generator().manual_seed(3))
        ids, wts, _ = runner.router(x, blk.moe.router)
        ids, wts = ids.flip(1), wts.flip(1)                  # not in ascending expert order
        E = e.config.n_experts
        counts = torch.bincount(ids.flatten(), minlength=E).tolist()
        experts = [i for i in range(E) if counts[i]]
        got = runner._batched(layer, x, ids, wts, experts, counts)
        runner.provider.release(layer)
        weights = runner._weights(layer, experts)
        runner.provider.release(layer)
        want = torch.zeros(T, D)
        for ex in experts:
            t, j = (ids == ex).nonzero(as_tuple=True)
            y = expert_ffn(x.index_select(0, t), weights[ex], runner.fused, runner.act_quant,
                           0.0, 0.0).float()
            want.index_add_(0, t, y * wts[t, j][:, None])
    assert torch.equal(got, want)
