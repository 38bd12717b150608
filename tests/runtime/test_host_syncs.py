"""Issue 17 item 8: host syncs per decode token, checked without a GPU. ``HostSyncCounter``
records every torch call that would copy a tensor's value to the host were it on a GPU; a
decode token may make one per MoE layer (the expert ids the provider needs) and one for the
token id, nothing else: the sampled id goes back into the next decode on the device (no
``torch.tensor(..., device=)`` per token), sampling runs on the logits' device (no copy of the
logits), and a prompt batch counts its experts without ``bincount`` (a sync on CUDA)."""

from __future__ import annotations

import pytest
import torch

from expertfs.runtime.engine import Engine
from expertfs.runtime.generate import generate
from expertfs.runtime.hostsync import HostSyncCounter
from expertfs.runtime.sampling import Sampler, SamplingParams, draw, nucleus, nucleus_dense
from support.cache_store import tiny_store


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return tiny_store(tmp_path_factory.mktemp("syncs"))


def _compute_sites(c: HostSyncCounter) -> dict[str, int]:
    """Sites other than the I/O engine's reads into host buffers (host memory by design)."""
    return {k: v for k, v in c.by_site().items() if "@ buffers.py:" not in k}


@pytest.mark.parametrize("vram", [0, 1])
def test_decode_token_syncs_once_per_moe_layer_and_once_for_its_id(store, vram):
    with Engine.open(store, provider="direct", fused="off") as e:
        slot = max(e.store.extent(la, 0).length for la in e.store.layers)
    with Engine.open(store, provider="tiered", ram_bytes=64 * slot, vram_bytes=vram * 16 * slot,
                     fused="off", provider_options={"warm_start": False, "backend": "buffered",
                                                    "record_usage": False}) as e:
        moe = sum(b.moe is not None for b in e.trunk.blocks)
        g = generate(e, [3, 17, 40, 2], Sampler(), 7)
        next(g)                                      # prefill and the first token
        with HostSyncCounter() as c:
            steps = list(g)
        n = len(steps)
        sites = _compute_sites(c)
        assert sites == {"tolist @ moe.py:forward": moe * n, "__int__ @ generate.py:generate": n}
        assert sum(sites.values()) <= n * (moe + 3)


def test_prompt_batch_counts_experts_without_bincount(store):
    with Engine.open(store, provider="direct", fused="off") as e:
        moe = sum(b.moe is not None for b in e.trunk.blocks)
        with HostSyncCounter() as c:
            e.prefill(list(range(3, 60)))
        sites = _compute_sites(c)
        assert not any(k.startswith("bincount") for k in sites)
        assert sites == {"tolist @ moe.py:forward": moe, "tensor @ engine.py:_ids": 1}


def test_sampling_on_a_device_reads_nothing_back(monkeypatch):
    """On the meta device (no data at all: any read of a value would raise) greedy and sampled
    choices are made and stay on the device."""
    lg = torch.empty(300, device="meta")
    monkeypatch.setattr(Sampler, "_device_gen", lambda self, dev: None)
    for p in (SamplingParams(), SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=3)):
        with HostSyncCounter() as c:
            t = Sampler(p).sample(lg)
        assert t.device.type == "meta" and t.dim() == 0 and c.total == 0


def test_dense_nucleus_keeps_the_same_tokens_and_draws_from_them():
    g = torch.Generator().manual_seed(1)
    for p in (SamplingParams(temperature=0.9, top_p=0.7), SamplingParams(temperature=1.3, top_k=9),
              SamplingParams(temperature=0.5, top_k=20, top_p=0.95), SamplingParams(temperature=2.0)):
        for _ in range(5):
            lg = torch.randn(64, generator=g) * 3
            probs, idx = nucleus(lg, p)
            dense, didx = nucleus_dense(lg, p)
            n = probs.numel()
            if n < lg.numel():      # cut: the same tokens, most likely first
                assert torch.equal(didx[:n], idx) and (dense[n:] == 0).all()
            a, b = torch.zeros(64), torch.zeros(64)      # uncut: the CPU keeps id order
            a[idx], b[didx] = probs, dense
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)
    lg = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs, idx = nucleus_dense(lg, SamplingParams(temperature=1.0, top_p=0.9))
    gen = torch.Generator().manual_seed(7)
    xs = torch.stack([idx[draw(probs, gen)] for _ in range(4000)])
    freq = torch.bincount(xs, minlength=4).float() / xs.numel()
    assert freq[3] == 0
    assert torch.allclose(freq[:3], torch.tensor([0.5, 0.3, 0.15]) / 0.95, atol=0.03)


def test_cpu_sampling_is_unchanged_as_an_int_and_as_a_tensor():
    lg = torch.log(torch.tensor([0.5, 0.3, 0.2, 1e-9]))
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=42)
    a, b = Sampler(p), Sampler(p)
    xs = [a(lg) for _ in range(200)]
    ts = [b.sample(lg) for _ in range(200)]
    assert xs == [int(t) for t in ts] and all(t.dim() == 0 for t in ts)
    assert Sampler().sample(torch.tensor([0.0, 3.0, 3.0])).item() == 1


def test_nucleus_cut_equals_a_full_sort():
    """top-p alone grows a top-k until it holds the mass: the tokens and probabilities of a
    sort of the whole vocabulary, on peaked and flat distributions (several growth steps)."""
    g = torch.Generator().manual_seed(5)
    for scale in (8.0, 1.0, 0.05):
        lg = torch.randn(5000, generator=g) * scale
        for top_p in (0.5, 0.9, 0.999):
            p = SamplingParams(temperature=0.8, top_p=top_p)
            probs, idx = nucleus(lg, p)
            ref = torch.softmax((lg.double() - lg.max()) / 0.8, -1)
            vals, order = torch.sort(ref, descending=True)
            keep = int(torch.searchsorted(torch.cumsum(vals, -1), torch.tensor([top_p]))) + 1
            assert torch.equal(idx, order[:keep])
            assert torch.allclose(probs, (vals[:keep] / vals[:keep].sum()).float(), rtol=1e-6)
