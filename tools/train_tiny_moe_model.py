"""The model of ``train_tiny_moe.py``: a transformers Glm4Moe plus its NextN/MTP block.

transformers' ``Glm4MoeForCausalLM`` builds no MTP weights, so the NextN block is transformers'
own generic ``MtpLayer`` (``transformers.modeling_layers``) around one more ``Glm4MoeDecoderLayer``
at layer index ``num_hidden_layers`` (so it is a MoE block with its own router, selection bias,
routed experts and shared expert). Its computation is GLM-4.5's / DeepSeek-V3's and llama.cpp's
(gguf_moe.md §6)::

    z = eh_proj([enorm(Embed(t_p)) ; hnorm(h_{p-1})])      # h: the trunk's output AFTER its final norm
    z = decoder_block(z)                                   # attention at position p, its own MoE
    logits = lm_head(shared_head_norm(z))                  # embedding and head shared with the trunk

``RouteRecorder`` hooks every ``Glm4MoeTopkRouter`` (trunk MoE layers and the NextN block) and
keeps what each returned: router logits, top-k weights, top-k ids. Masks: ``None`` is causal
(sdpa); a bool ``[1, 1, Q, K]`` tensor (True = attend) gives tree/draft masks.
"""

from __future__ import annotations

import dataclasses
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

CKPT_FORMAT = "expertfs-tiny-glm4moe/1"


@dataclass(frozen=True)
class Preset:
    """Model geometry and training schedule of one variant."""

    name: str
    vocab: int
    hidden: int
    layers: int              # trunk layers (the first ``dense`` dense), NextN not counted
    experts: int
    top_k: int
    moe_ff: int
    dense_ff: int
    heads: int
    kv_heads: int
    head_dim: int
    seq: int                 # training sequence length
    batch: int
    steps: int
    lr: float
    corpus_chars: int        # training text (characters) for the tokenizer and the LM
    held_chars: int = 400_000
    dense: int = 1
    shared: int = 1
    routed_scaling: float = 2.5        # GLM-4.5's routed_scaling_factor
    mtp_weight: float = 0.3            # DeepSeek-V3's lambda for the MTP loss
    balance_alpha: float = 1e-3        # sequence-wise balance loss
    bias_rate: float = 2e-3            # aux-loss-free selection-bias update (gamma)
    eval_every: int = 100
    warmup: int = 30


PRESETS: dict[str, Preset] = {
    # test fixture: the whole train → export → store → trace pipeline in well under a minute
    "tiny": Preset("tiny", vocab=512, hidden=64, layers=3, experts=16, top_k=4, moe_ff=32,
                   dense_ff=128, heads=4, kv_heads=2, head_dim=16, seq=64, batch=8, steps=200,
                   lr=4e-3, corpus_chars=1_000_000, held_chars=150_000, eval_every=50,
                   warmup=20),
    # the default: 6 layers (1 dense + 5 MoE) x 64 experts, top-4, + NextN; a few minutes
    "small": Preset("small", vocab=2048, hidden=128, layers=6, experts=64, top_k=4, moe_ff=64,
                    dense_ff=512, heads=4, kv_heads=2, head_dim=32, seq=256, batch=8, steps=500,
                    lr=3e-3, corpus_chars=8_000_000),
    # the larger geometry: 12 layers (1 dense + 11 MoE) x 64 experts, top-8, + NextN; same
    # width and vocabulary as small, so the cost goes into depth and routing (~2.5x small/step)
    "large": Preset("large", vocab=2048, hidden=128, layers=12, experts=64, top_k=8, moe_ff=64,
                    dense_ff=512, heads=4, kv_heads=2, head_dim=32, seq=256, batch=8, steps=600,
                    lr=3e-3, corpus_chars=8_000_000),
}


def preset(name: str, **over: Any) -> Preset:
    if name not in PRESETS:
        raise SystemExit(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **{k: v for k, v in over.items() if v is not None})


def hf_config(p: Preset):
    from transformers import Glm4MoeConfig
    cfg = Glm4MoeConfig(
        vocab_size=p.vocab, hidden_size=p.hidden, intermediate_size=p.dense_ff,
        moe_intermediate_size=p.moe_ff, num_hidden_layers=p.layers,
        num_attention_heads=p.heads, num_key_value_heads=p.kv_heads, head_dim=p.head_dim,
        n_routed_experts=p.experts, num_experts_per_tok=p.top_k, n_shared_experts=p.shared,
        first_k_dense_replace=p.dense, n_group=1, topk_group=1, norm_topk_prob=True,
        routed_scaling_factor=p.routed_scaling, use_qk_norm=True, attention_bias=True,
        rms_norm_eps=1e-5, max_position_embeddings=4096, tie_word_embeddings=False,
        num_nextn_predict_layers=1, initializer_range=0.02,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5})
    cfg._attn_implementation = "sdpa"
    return cfg


def padded_bmm_experts(self, hidden: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor) -> torch.Tensor:
    """Glm4MoeExperts' computation as two batched matmuls over per-expert padded token slots.

    Tokens are sorted by expert into a zero-padded ``[E, C, H]`` buffer (C = the busiest
    expert's count); padded rows give silu(0)·0 = 0, so the result equals the eager loop's up to
    summation order, with ~6 kernels per layer instead of 2 per expert (what training on two
    CPU cores needs). Registered as the transformers experts implementation ``padded_bmm``.
    """
    T, H = hidden.shape
    E, k = self.num_experts, top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    e_sorted = flat[order]
    counts = torch.bincount(flat, minlength=E)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(T * k, device=hidden.device) - starts[e_sorted]
    tok = order // k
    buf = hidden.new_zeros(E, int(counts.max()), H)
    buf = buf.index_put((e_sorted, slot), hidden[tok])
    gate, up = torch.bmm(buf, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)
    out = torch.bmm(self.act_fn(gate) * up, self.down_proj.transpose(1, 2))
    y = out[e_sorted, slot] * top_k_weights.reshape(-1)[order, None].to(out.dtype)
    return hidden.new_zeros(T, H).index_add(0, tok, y.to(hidden.dtype))


def _register_experts() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    if "padded_bmm" not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register("padded_bmm", padded_bmm_experts)


class TinyGlmMoe(nn.Module):
    """``lm``: transformers Glm4MoeForCausalLM; ``mtp``: transformers MtpLayer (the NextN block)."""

    def __init__(self, p: Preset, seed: int = 0) -> None:
        super().__init__()
        from transformers import Glm4MoeForCausalLM
        from transformers.modeling_layers import MtpLayer
        from transformers.models.glm4_moe.modeling_glm4_moe import (Glm4MoeDecoderLayer,
                                                                    Glm4MoeRMSNorm)
        self.preset = p
        torch.manual_seed(seed)
        self.config = cfg = hf_config(p)
        self.lm = Glm4MoeForCausalLM(cfg)
        self.mtp = MtpLayer(cfg, Glm4MoeDecoderLayer, Glm4MoeRMSNorm, cfg.num_hidden_layers,
                            use_post_norm=True)
        for m in self.mtp.modules():            # the same initialisation as the trunk's
            self.lm._init_weights(m)
        self.lm.float()
        self.mtp.float()

    @property
    def n_layers(self) -> int:
        return self.config.num_hidden_layers

    def set_experts(self, impl: str) -> None:
        """``eager`` (transformers' reference loop), ``grouped_mm`` or ``padded_bmm``."""
        _register_experts()
        self.lm.set_experts_implementation(impl)

    def routers(self) -> dict[int, nn.Module]:
        """Layer index → router (trunk MoE layers, then the NextN block at ``n_layers``)."""
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE
        out = {i: layer.mlp.gate for i, layer in enumerate(self.lm.model.layers)
               if isinstance(layer.mlp, Glm4MoeMoE)}
        out[self.n_layers] = self.mtp.mtp_block.mlp.gate
        return out

    # --- forward pieces ------------------------------------------------------------------

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm.model.embed_tokens(ids)

    def trunk(self, ids: torch.Tensor, position_ids: torch.Tensor | None = None,
              mask: torch.Tensor | None = None) -> torch.Tensor:
        """The trunk's last hidden state after the final norm (``t_h_nextn``), ``[B, T, H]``."""
        m = self.lm.model
        x = m.embed_tokens(ids)
        if position_ids is None:
            position_ids = torch.arange(ids.shape[1])[None]
        pe = m.rotary_emb(x, position_ids)
        for layer in m.layers:
            x = layer(x, attention_mask=mask, position_embeddings=pe, position_ids=position_ids)
        return m.norm(x)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm.lm_head(h)

    def nextn(self, ids: torch.Tensor, h_prev: torch.Tensor, position_ids: torch.Tensor,
              mask: torch.Tensor | None = None) -> torch.Tensor:
        """The NextN block on (Embed(ids), h_prev) at ``position_ids``; returns the normed output
        (``shared_head_norm(z)``), whose logits predict the token after ``ids``."""
        e = self.embed(ids)
        pe = self.lm.model.rotary_emb(e, position_ids)
        return self.mtp(e, h_prev, position_embeddings=pe, attention_mask=mask,
                        position_ids=position_ids, cache=None)


class RouteRecorder:
    """Forward hooks on every router; ``calls[layer]`` = list of (logits, weights, ids)."""

    def __init__(self, model: TinyGlmMoe, detach: bool = True) -> None:
        self.model, self.detach = model, detach
        self.calls: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        self._handles: list[Any] = []

    def __enter__(self) -> RouteRecorder:
        for layer, gate in self.model.routers().items():
            self._handles.append(gate.register_forward_hook(self._hook(layer)))
        return self

    def _hook(self, layer: int):
        def f(_mod, _inp, out):
            logits, w, idx = out
            if self.detach:
                logits, w = logits.detach(), w.detach()
            self.calls.setdefault(layer, []).append((logits, w, idx.detach()))
        return f

    def clear(self) -> None:
        self.calls.clear()

    def last(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.calls[layer][-1]

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


@contextmanager
def recording(model: TinyGlmMoe, detach: bool = True) -> Iterator[RouteRecorder]:
    with RouteRecorder(model, detach) as r:
        yield r


# --- checkpoints -----------------------------------------------------------------------------

def save_checkpoint(path: str, model: TinyGlmMoe, meta: dict[str, Any]) -> None:
    tmp = path + ".partial"
    torch.save({"format": CKPT_FORMAT, "preset": dataclasses.asdict(model.preset),
                "state_dict": model.state_dict(), "meta": meta}, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str) -> tuple[TinyGlmMoe, dict[str, Any]]:
    ck = torch.load(path, map_location="cpu", weights_only=False)
    if ck.get("format") != CKPT_FORMAT:
        raise SystemExit(f"{path}: not a {CKPT_FORMAT} checkpoint")
    model = TinyGlmMoe(Preset(**ck["preset"]))
    model.load_state_dict(ck["state_dict"])
    model.eval()
    return model, ck["meta"]

