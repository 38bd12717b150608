"""The NextN/MTP block's forward, exactly llama.cpp's ``graph_mtp`` (glm4moe, deepseek2).

At MTP position ``p`` the block takes the token ``t_p`` and a hidden state ``h`` (the trunk's
last hidden state of position ``p-1`` after ``output_norm``, or while chaining drafts the
block's own previous output) and predicts ``t_{p+1}``::

    e  = Embed(t_p)                    (nextn.embed_tokens when present, else token_embd)
    x  = eh_proj @ [rms(e)*enorm ; rms(h)*hnorm]          order [embedding ; hidden]
    x  = x + Attn(rms(x)*attn_norm)                        its own KV cache, RoPE at p
    x  = x + MoE(rms(x)*ffn_norm) (+ shared expert)        its own router and routed experts,
                                                          fetched through the provider
    hn = rms(x) * (nextn.shared_head_norm or output_norm)  t_h_nextn: chained as the next h
    logits = (nextn.shared_head_head or output) @ hn

``NextN`` owns the block's KV cache (one layer, positions aligned with the trunk's) and shares
the model's RoPE tables, expert runner (so the block's experts go through the same provider
and tiers) and compute dtype. Pure tensor code: pairing tokens with hidden states, catch-up and
rollback are the caller's (``expertfs.runtime.mtp.speculative``).

A row's K/V come from the block's input (before its FFN), and a row's FFN output is used only
by that row's ``hn`` and logits: so the FFN (the routed experts) runs only on the rows whose
output is asked for — the last (``"last"``, ``"hidden"``), every row (``"all"``) or none
(``"none"``: a catch-up that only fills the KV cache). The rows returned are exactly what a
full forward gives (llama.cpp prunes to its output rows the same way before the last FFN of
its main graph); the catch-up of accepted tokens and of the prompt reads no experts.
"""

from __future__ import annotations

import torch

from ..model.attention import KVCache, attention, causal_mask
from ..model.loader import BlockWeights
from ..model.mla import mla_attention
from ..model.model import Model
from ..model.rope import rms_norm
from ..model.weights import Embedding

__all__ = ["NextN", "nextn_block"]


def nextn_block(model: Model, index: int = 0) -> BlockWeights | None:
    """The model's ``index``-th NextN block when it was loaded with its ``eh_proj``."""
    blocks = model.trunk.nextn
    if index >= len(blocks) or "eh_proj" not in blocks[index].nextn:
        return None
    blk = blocks[index]
    if blk.moe is None and blk.dense is None:
        return None
    return blk


class NextN:
    def __init__(self, model: Model, blk: BlockWeights, n_ctx: int) -> None:
        self.model, self.blk, self.cfg = model, blk, model.cfg
        self.layer = blk.layer                       # n_layers (+ index): the provider's layer
        t = model.trunk
        ex = blk.nextn
        self.embed: Embedding = ex.get("embed_tokens", t.embed)          # type: ignore[assignment]
        self.head = ex.get("shared_head_head", t.output)
        self.head_norm = ex.get("shared_head_norm", t.output_norm)
        self.eh_proj, self.enorm, self.hnorm = ex["eh_proj"], ex["enorm"], ex["hnorm"]
        self.cache = KVCache(model.cfg, 1, n_ctx, model.dtype, model.device)
        self.attend = mla_attention if model.cfg.mla else attention
        self.hidden: torch.Tensor | None = None      # hn of every row of the last forward

    @property
    def pos(self) -> int:
        return self.cache.pos

    def reset(self, pos: int = 0) -> None:
        self.cache.reset(pos)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, h: torch.Tensor, logits: str = "last"
                ) -> torch.Tensor | None:
        """``ids [T]`` at positions ``pos .. pos+T-1`` paired row by row with ``h [T, n_embd]``
        → float32 logits of the last row (``"last"``), every row (``"all"``) or none
        (``"none"``: K/V only; ``"hidden"``: the last row's ``hn`` but no logits; ``"attn"``:
        the last row's state before the FFN, normed like ``hn`` — no experts read);
        ``self.hidden`` holds ``hn`` (float32) of the rows that were output."""
        cfg, m, blk = self.cfg, self.model, self.blk
        T = ids.shape[0]
        self.cache.reserve(T)
        p0 = self.cache.pos
        eps = cfg.rms_eps
        e = self.embed.lookup(ids, torch.float32)
        z = torch.cat((rms_norm(e, self.enorm, eps), rms_norm(h.float(), self.hnorm, eps)), -1)
        x = self.eh_proj(z.to(m.dtype)).float()
        cos, sin = m.rope.tables(p0, T)
        mask = causal_mask(p0, T, m.device)
        a = rms_norm(x, blk.attn_norm, eps).to(m.dtype)
        x = x + self.attend(a, blk.attn, cfg, m.rope, cos, sin, self.cache, 0, mask).float()
        self.cache.pos = p0 + T
        if logits == "none":
            return None
        if logits != "all":
            x = x[-1:]                                   # the rows whose output is used
        if logits == "attn":
            self.hidden = rms_norm(x, self.head_norm, eps)
            return None
        f = rms_norm(x, blk.ffn_norm, eps).to(m.dtype)
        y = m.runner.forward(self.layer, f, blk.moe) if blk.moe is not None else blk.dense(f)
        x = x + y.float()
        hn = rms_norm(x, self.head_norm, eps)
        self.hidden = hn
        if logits == "hidden":
            return None
        return self.head(hn.to(m.dtype)).float()

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes
