"""``SynthConfig``: the geometry, quantization and seed of a synthetic model.

One flat frozen dataclass; ``SynthConfig()`` is the tiny qwen3moe used by tests and the demo,
``SynthConfig.tiny(arch)`` a tiny model of another architecture, ``SynthConfig.like(name)`` a
real model's geometry (``presets.py``). Field names follow GGUF's (``n_embd``, ``n_ff_exp``...).
``validate()`` checks everything llama.cpp's loader would trip over and raises ``UsageError``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import UsageError
from .presets import like_fields, tiny_fields
from .quant import QuantSpec, parse_quant

__all__ = ["SynthConfig", "ARCHES", "MAX_LAYERS"]

#: llama.cpp architectures synth can write, by ``general.architecture``
ARCHES = ("qwen3moe", "glm4moe", "llama", "deepseek2", "gpt-oss", "glm5-next", "glm-dsa")
MAX_LAYERS = 512             # LLAMA_MAX_LAYERS
MAX_EXPERTS = 512            # LLAMA_MAX_EXPERTS
_FUSED_OK = ("deepseek2",)   # arches whose loader has create_tensor_gate_up_exps
_NEXTN_OK = ("glm4moe", "deepseek2", "glm5-next", "glm-dsa")
DSA_ARCHES = ("glm5-next", "glm-dsa")     # MLA + the DSA lightning indexer


@dataclass(frozen=True)
class SynthConfig:
    arch: str = "qwen3moe"
    name: str = "expertfs synth"
    n_layers: int = 2                 # decoder layers; block_count = n_layers + n_nextn
    n_embd: int = 256
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64
    n_ff: int = 512                  # dense FFN width (leading dense blocks)
    n_ff_exp: int = 256              # per routed expert
    n_experts: int = 8
    n_expert_used: int = 2
    n_expert_shared: int = 0
    n_dense_lead: int = 0
    n_nextn: int = 0                 # NextN/MTP blocks appended after the decoder layers
    nextn_heads: bool = False        # write the optional nextn.embed_tokens/shared_head_head
    n_vocab: int = 1024
    n_ctx_train: int = 4096
    rope_freq_base: float = 1_000_000.0
    rope_dim: int = 0                # rope.dimension_count; 0 = not written (whole head)
    rms_eps: float = 1e-6
    qk_norm: bool = True
    qkv_bias: bool = False
    # routing (glm4moe, deepseek2)
    gating: int = 0                  # expert_gating_func: 0 = not written, 1 softmax, 2 sigmoid
    expert_weights_scale: float = 0.0    # 0 = not written
    expert_weights_norm: bool | None = None
    expert_group_count: int = 0          # 0 = not written
    expert_group_used_count: int = 0
    probs_bias: bool = False         # exp_probs_b (e_score_correction_bias)
    # MLA (deepseek2)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    # gpt-oss
    sliding_window: int = 0
    # DSA indexer (glm-dsa, glm5-next); a layer's indexer is full when
    # max(i - indexer_offset + 1, 0) % indexer_freq == 0 (transformers' schedule), shared otherwise
    indexer_heads: int = 0
    indexer_head_dim: int = 0
    indexer_top_k: int = 0
    indexer_freq: int = 1
    indexer_offset: int = 2
    indexer_kpool: int = 0           # glm5-next k-pool compression
    # glm5-next: KDA layers (MLA where i % kda_interval == kda_interval - 1), mHC streams
    kda_interval: int = 0
    kda_head_dim: int = 0
    ssm_conv_kernel: int = 0
    kda_gate_lower_bound: float = 0.0    # 0 = not written
    hc_mult: int = 0
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    swiglu_limit: float = 0.0        # 0 = not written
    # rope scaling, as convert_hf_to_gguf writes it
    rope_scaling: str = ""           # "" | "yarn" | "linear"
    rope_scaling_factor: float = 0.0
    rope_orig_ctx: int = 0
    yarn_beta_fast: float = 0.0
    yarn_beta_slow: float = 0.0
    yarn_log_mul: float = 0.0
    tokenizer: str = ""              # tokenizer family (synth/tokenizer.py FAMILIES); "" = the arch's
    fuse_gate_up: bool = False       # ffn_gate_up_exps instead of ffn_gate_exps + ffn_up_exps
    quant: str = "default"
    seed: int = 0

    # ---- constructors -------------------------------------------------------------------

    @classmethod
    def tiny(cls, arch: str = "qwen3moe", **over: object) -> SynthConfig:
        """A few-MB model of ``arch`` with every tensor kind the architecture has."""
        return cls(**{**tiny_fields(arch), **over}).validate()

    @classmethod
    def like(cls, name: str, layers: int | None = None, **over: object) -> SynthConfig:
        """A real model's geometry (``presets.PRESETS``), optionally cut to ``layers`` layers."""
        cfg = cls(**{**like_fields(name), **over})
        return (cfg.with_layers(layers) if layers else cfg).validate()

    def replace(self, **changes: object) -> SynthConfig:
        return dataclasses.replace(self, **changes)

    def with_layers(self, n_layers: int) -> SynthConfig:
        """Scale to ``n_layers`` decoder layers, keeping at least one MoE layer."""
        if n_layers < 1:
            raise UsageError(f"--layers {n_layers}: a model needs at least one layer",
                             fix="pass --layers 1 or more")
        return self.replace(n_layers=n_layers, n_dense_lead=min(self.n_dense_lead, n_layers - 1))

    # ---- derived ------------------------------------------------------------------------

    @property
    def block_count(self) -> int:
        return self.n_layers + self.n_nextn

    @property
    def tokenizer_family(self) -> str:
        return self.tokenizer or self.arch

    @property
    def quant_spec(self) -> QuantSpec:
        return parse_quant(self.quant)

    @property
    def is_mla(self) -> bool:
        return self.arch in ("deepseek2", *DSA_ARCHES)

    def is_moe_block(self, i: int) -> bool:
        return i >= self.n_dense_lead

    def is_kda_block(self, i: int) -> bool:
        """A glm5-next KDA (linear attention) layer; NextN blocks are MLA."""
        k = self.kda_interval
        return self.arch == "glm5-next" and i < self.n_layers and k > 0 and i % k != k - 1

    def indexer_full(self, i: int) -> bool:
        """The layer runs its own indexer (and has its tensors); NextN blocks always do."""
        if i >= self.n_layers:
            return True
        return max(i - self.indexer_offset + 1, 0) % max(self.indexer_freq, 1) == 0

    # ---- checks -------------------------------------------------------------------------

    def validate(self) -> SynthConfig:
        """Raise ``UsageError`` for a geometry llama.cpp's loader (or this writer) rejects."""
        def bad(problem: str, fix: str) -> UsageError:
            return UsageError(f"synth {self.arch}: {problem}", fix=fix)

        if self.arch not in ARCHES:
            raise UsageError(f"unknown architecture {self.arch!r}", fix=f"use one of {', '.join(ARCHES)}")
        for f in ("n_layers", "n_embd", "n_head", "n_head_kv", "n_ff_exp", "n_experts",
                  "n_expert_used", "n_vocab", "n_ctx_train"):
            if getattr(self, f) < 1:
                raise bad(f"{f} is {getattr(self, f)}", f"give {f} a positive value")
        if self.block_count > MAX_LAYERS:
            raise bad(f"{self.block_count} blocks; llama.cpp allows {MAX_LAYERS}",
                      "pass fewer --layers")
        if self.n_experts > MAX_EXPERTS:
            raise bad(f"{self.n_experts} experts; llama.cpp allows {MAX_EXPERTS}", "pass fewer --experts")
        if not 1 <= self.n_expert_used <= self.n_experts:
            raise bad(f"top-k {self.n_expert_used} with {self.n_experts} experts",
                      "pass --top-k between 1 and --experts")
        if self.n_head % self.n_head_kv:
            raise bad(f"{self.n_head} heads is not a multiple of {self.n_head_kv} KV heads",
                      "choose n_head_kv dividing n_head")
        if not 0 <= self.n_dense_lead < self.n_layers:
            raise bad(f"{self.n_dense_lead} leading dense blocks of {self.n_layers} layers",
                      "keep at least one MoE layer")
        if self.n_nextn and self.arch not in _NEXTN_OK:
            raise bad("NextN blocks are read by llama.cpp only for glm4moe and deepseek2",
                      "drop n_nextn or pick one of those arches")
        if self.fuse_gate_up and self.arch not in _FUSED_OK:
            raise bad("llama.cpp's loader for this arch has no ffn_gate_up_exps",
                      "drop --fuse-gate-up or use --arch deepseek2")
        if self.expert_group_count > 1 and (self.n_experts % self.expert_group_count or
                                            not 0 < self.expert_group_used_count < self.expert_group_count):
            raise bad(f"expert groups {self.expert_group_used_count}/{self.expert_group_count} "
                      f"do not fit {self.n_experts} experts",
                      "use a group count dividing the expert count and fewer used groups")
        g, used = self.expert_group_count, self.expert_group_used_count
        per = self.n_experts // max(1, g)
        if g > 1 and (per < 2 or used * per < self.n_expert_used):
            # routing scores a group by its two best experts and picks top-k in the used groups
            need = g * max(2, -(-self.n_expert_used // used))
            raise bad(f"expert groups {used}/{g} of {per} expert(s) each cannot route "
                      f"top-{self.n_expert_used}", f"use at least {need} experts")
        if self.arch == "deepseek2":
            if min(self.kv_lora_rank, self.qk_nope_dim, self.qk_rope_dim, self.v_head_dim) < 1:
                raise bad("MLA needs kv_lora_rank, qk_nope_dim, qk_rope_dim and v_head_dim",
                          "use SynthConfig.tiny('deepseek2') or --like DeepSeek-V3")
            if self.q_lora_rank and self.n_layers in (26, 27):
                raise bad(f"llama.cpp treats a {self.n_layers}-layer deepseek2 as V2-Lite (no "
                          "q_lora_rank) and would not find attn_q_a", "pick another --layers")
        if self.arch in DSA_ARCHES:
            self._validate_dsa(bad)
        if self.arch == "gpt-oss" and self.sliding_window < 1:
            raise bad("gpt-oss needs attention.sliding_window", "set sliding_window")
        if self.arch in ("qwen3moe", "llama") and self.rope_dim not in (0, self.head_dim):
            raise bad(f"rope.dimension_count {self.rope_dim} differs from head_dim {self.head_dim}",
                      "this arch ropes the whole head; leave rope_dim at 0")
        if self.arch == "llama" and self.n_ff != self.n_ff_exp:
            raise bad("Mixtral-style llama sizes experts by feed_forward_length, so n_ff must "
                      "equal n_ff_exp", "set both to the same value")
        self.quant_spec  # parses, raising UsageError on a bad spec
        return self

    def _validate_dsa(self, bad) -> None:
        if min(self.q_lora_rank, self.kv_lora_rank, self.qk_nope_dim, self.v_head_dim,
               self.indexer_heads, self.indexer_head_dim, self.indexer_top_k) < 1:
            raise bad("MLA with the DSA indexer needs q_lora_rank, kv_lora_rank, qk_nope_dim, "
                      "v_head_dim and the indexer heads, head size and top-k",
                      f"use SynthConfig.tiny({self.arch!r}) or a --like preset")
        if self.arch == "glm-dsa" and self.qk_rope_dim < 1:
            raise bad("glm-dsa ropes part of each head", "set qk_rope_dim")
        if self.arch == "glm5-next":
            if self.qk_rope_dim:
                raise bad("glm5-next's MLA is nope-only", "set qk_rope_dim to 0")
            if self.hc_mult != 4:
                raise bad(f"hc_mult {self.hc_mult}: llama.cpp supports 4 mHC streams only",
                          "set hc_mult to 4")
            if self.indexer_kpool < 2 or self.indexer_top_k % self.indexer_kpool:
                raise bad(f"index top-k {self.indexer_top_k} is not a multiple of k-pool "
                          f"{self.indexer_kpool} (> 1)", "pick a k-pool dividing the top-k")
            if min(self.kda_interval, self.kda_head_dim, self.ssm_conv_kernel) < 1:
                raise bad("KDA layers need kda_interval, kda_head_dim and ssm_conv_kernel",
                          "use SynthConfig.tiny('glm5-next') or --like GLM-5.3-Flash")
