"""The decoder: embedding → blocks (attention, dense or routed FFN) → output norm → logits.

Every architecture in ``config.ARCHS`` is one pre-norm residual stack; what differs (rope
pairing and extent, q/k norm, biases, router semantics, shared experts, dense leading layers)
is carried by the config and by which tensors the store holds. An architecture with layer
kinds of its own (``archs``: glm-dsa's indexed MLA) supplies the attention step, and may run
the blocks itself (``forward_blocks``: glm5-next's mHC residual streams). The residual
stream stays in float32 (as ggml keeps activations); matrices are applied in the compute dtype.

``forward(ids)`` appends ``len(ids)`` positions to the KV cache and returns float32 logits of
the last position (``logits="last"``), of every position (``"all"``) or none (``"none"``).
``hidden=True`` also keeps every position's last hidden state after the output norm (float32
``[T, n_embd]``, llama.cpp's ``t_h_nextn``) in ``Model.hidden``: the NextN/MTP block's input.
"""

from __future__ import annotations

import torch

from .archs import arch_module
from .attention import KVCache, attention, causal_mask
from .config import ModelConfig
from .loader import BlockWeights, TrunkWeights
from .mla import mla_attention
from .moe import ExpertRunner
from .rope import Rope, rms_norm

__all__ = ["Model", "SMALL_STEP_TOKENS", "SMALL_STEP_CONTEXT"]

#: A forward of at most this many tokens over at most this many positions runs torch's own ops
#: (norms, rope, attention) on one thread when ``Model.small_steps_one_thread`` is set: a decode
#: step is hundreds of tiny ops, each of which would wake torch's other threads and fight the
#: native kernels' pool for the cores (measured faster resident and under a memory cap in an
#: in-process A/B; see bench/README.md). Beyond this context attention is big enough to share.
SMALL_STEP_TOKENS = 8
SMALL_STEP_CONTEXT = 1024


class Model:
    def __init__(self, cfg: ModelConfig, trunk: TrunkWeights, runner: ExpertRunner, *,
                 device: torch.device, dtype: torch.dtype, n_ctx: int,
                 lookahead: bool = False, lookahead_margin: int = 2,
                 prefill_prefetch: bool = False) -> None:
        self.cfg, self.trunk, self.runner = cfg, trunk, runner
        self.device, self.dtype = device, dtype
        self.rope = Rope(cfg, device)
        self.cache = KVCache(cfg, cfg.n_layers, n_ctx, dtype, device)
        mod = arch_module(cfg.spec)
        self.attend = mod.Attention(cfg, self.cache) if mod is not None else \
            mla_attention if cfg.mla else attention
        self._blocks = getattr(mod, "forward_blocks", None)     # an arch's own stack (mHC)
        self.lookahead = lookahead
        self.lookahead_k = cfg.n_expert_used + max(0, lookahead_margin)
        self.prefill_prefetch = prefill_prefetch
        self.hidden: torch.Tensor | None = None      # t_h_nextn of the last hidden=True forward
        self.small_steps_one_thread = False          # set by the engine with the native kernels
        self.trunk_stream = None      # a model.trunk_stream.TrunkStream under a tight limit

    def close(self) -> None:
        """Stop the trunk's streaming thread, if any (the weights stay until collected)."""
        if self.trunk_stream is not None:
            self.trunk_stream.close()

    @property
    def pos(self) -> int:
        return self.cache.pos

    def can_reset(self, pos: int) -> bool:
        """Can the model go back to ``pos`` (a recurrent state may keep only recent positions)?"""
        check = getattr(self.attend, "can_reset", None)
        return check is None or check(pos, self.cache.pos)

    def reset(self, pos: int = 0) -> None:
        if hasattr(self.attend, "reset"):               # state beside the cache (KDA)
            self.attend.reset(pos, self.cache.pos)
        self.cache.reset(pos)
        if self.runner.lookahead is not None:
            self.runner.lookahead.reset_pending()

    def predict_next(self, layer: int, x: torch.Tensor) -> tuple[int, torch.Tensor] | None:
        """Layer ``layer+1``'s router on this layer's residual stream (glm5-next: this layer's
        FFN input from its streams), through its own FFN norm: with the lookahead on, or for a
        prompt batch with ``prefill_prefetch`` (top-k per token: the batch's union is what the
        next layer will mostly read)."""
        nxt = layer + 1
        batch = x.shape[0] > 1 and self.prefill_prefetch and not self.lookahead
        if not (self.lookahead or batch) or nxt >= self.cfg.n_layers:
            return None
        blk = self.trunk.blocks[nxt]
        if blk.moe is None:
            return None
        xp = rms_norm(x, blk.ffn_norm, self.cfg.rms_eps)
        k = self.cfg.n_expert_used if batch else self.lookahead_k
        return nxt, self.runner.router.top(xp, blk.moe.router, k)

    def ffn(self, layer: int, blk: BlockWeights, h: torch.Tensor,
            pred: tuple[int, torch.Tensor] | None) -> torch.Tensor:
        """Block ``blk``'s FFN on its normed input ``h``: the routed experts, handed the next
        layer's prediction ``pred`` (``predict_next``), or the dense FFN with ``pred``
        prefetched first."""
        if self.trunk_stream is not None:
            self.trunk_stream.at(layer)
        if blk.moe is not None:
            return self.runner.forward(layer, h, blk.moe, pred)
        if pred is not None:
            self.runner.prefetch(*pred)
        return blk.dense(h)

    def forward(self, ids: torch.Tensor, logits: str = "last",
                hidden: bool = False) -> torch.Tensor | None:
        """``ids [T]`` (int64, on the device) → float32 logits ``[T or 1, n_vocab]``."""
        T = ids.shape[0]
        if not (self.small_steps_one_thread and T <= SMALL_STEP_TOKENS
                and self.cache.pos + T <= SMALL_STEP_CONTEXT):
            return self._forward(ids, logits, hidden)
        n = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return self._forward(ids, logits, hidden)
        finally:
            torch.set_num_threads(n)

    @torch.inference_mode()
    def _forward(self, ids: torch.Tensor, logits: str, hidden: bool) -> torch.Tensor | None:
        cfg, T = self.cfg, ids.shape[0]
        self.cache.reserve(T)
        p0 = self.cache.pos
        x = self.trunk.embed.lookup(ids, torch.float32)                # [T, D] residual
        cos, sin = self.rope.tables(p0, T)
        mask = causal_mask(p0, T, self.device)
        attend = self.attend
        if self._blocks is not None:
            x = self._blocks(self, x, cos, sin, mask)
        for blk in self.trunk.blocks if self._blocks is None else ():
            L = blk.layer
            h = rms_norm(x, blk.attn_norm, cfg.rms_eps).to(self.dtype)
            x = x + attend(h, blk.attn, cfg, self.rope, cos, sin, self.cache, L, mask).float()
            h = rms_norm(x, blk.ffn_norm, cfg.rms_eps).to(self.dtype)
            x = x + self.ffn(L, blk, h, self.predict_next(L, x)).float()
        self.cache.pos = p0 + T
        if self.trunk_stream is not None:
            self.trunk_stream.at(cfg.n_layers, measure=logits != "none")   # the head's turn
        if hidden:
            self.hidden = rms_norm(x, self.trunk.output_norm, cfg.rms_eps)   # row-wise: the
            x = self.hidden                                   # same rows as normed below
        if logits == "none":
            return None
        if logits == "last":
            x = x[-1:]
        h = (x if hidden else rms_norm(x, self.trunk.output_norm, cfg.rms_eps)).to(self.dtype)
        return self.trunk.output(h).float()
