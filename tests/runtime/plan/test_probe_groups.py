"""``plan``'s GPU figure for a routed-expert layer is the runtime's device path
(``probe.probe_group_layers``: ``expert_groups.group_rows`` over k experts), measured here on
the CPU with the same code: one figure per distinct layer, fused gate_up included, and the
layer cost ``predict`` takes for the GPU uses it instead of k times each matrix's."""

from __future__ import annotations

import dataclasses

from expertfs.cli.plan import geometry_from_synth
from expertfs.runtime.plan.native import layer_cost, layer_key
from expertfs.runtime.plan.probe import probe_group_layers
from expertfs.runtime.plan.rates import stated_gpu
from expertfs.synth import SynthConfig


def test_group_layers_are_measured_per_distinct_layer():
    for arch, fuse in (("qwen3moe", False), ("deepseek2", True)):
        g = geometry_from_synth(dataclasses.replace(SynthConfig.tiny(arch), fuse_gate_up=fuse)
                                if fuse else SynthConfig.tiny(arch))
        got, detail = probe_group_layers(g, "cpu", 0.3)
        keys = {layer_key(p, g.k) for p in g.expert_parts}
        assert set(got) == keys and len(detail) == len(keys), arch
        for key, c in got.items():
            assert 0 < c.gbps.slow <= c.gbps.fast and "group_rows" in c.gbps.source
        gpu = dataclasses.replace(stated_gpu([m.ggml_type for p in g.expert_parts for m in p]),
                                  layers=got)
        parts = g.expert_parts[0]
        nb = g.k * sum(m.nbytes for m in parts)
        assert layer_cost(gpu, parts, g.k, "slow") == nb / (got[layer_key(parts, g.k)]
                                                            .gbps.slow * 1e9)
