"""``ModelConfig``: a model's hyper-parameters, read from GGUF metadata as llama.cpp reads them.

``ModelConfig.from_gguf(kv, tensor_names)`` takes the store's metadata (``Store.gguf_kv()``) and
the trunk tensor names, applies the architecture's defaults (``ARCHS``) and checks that this
runtime can run it. Keys are ``"{arch}.<key>"`` (gguf-py ``Keys.LLM``); defaults follow
llama.cpp's ``llama-model.cpp`` per architecture:

- ``n_layers = block_count - nextn_predict_layers``; the NextN/MTP blocks are loaded, not run.
- RoPE: NEOX (rotate halves) for qwen3moe / glm4moe, NORM (adjacent pairs) for llama;
  ``n_rot = rope.dimension_count`` (glm4moe: partial, head_dim / 2), scaling linear or YaRN.
- Router: qwen3moe and llama are softmax with weight normalisation; glm4moe reads
  ``expert_gating_func`` (default sigmoid), ``expert_weights_norm`` (default false),
  ``expert_weights_scale`` (default 0 = none) and the group keys; deepseek2 the same keys with
  gating defaulting to softmax (sigmoid for GLM-4.7-Flash's shape, as llama.cpp guesses).
- deepseek2 attention is MLA (``attention.kv_lora_rank``, ``key_length_mla``,
  ``value_length_mla``, optional ``q_lora_rank``); YaRN's magnitude correction goes into the
  attention scale (``mscale² / sqrt(key_length_mla)``, ``rope.scaling.yarn_log_multiplier``
  stored ×0.1), not into cos/sin.
- An architecture with layer kinds of its own names its module in ``runtime/model/archs``
  (``ArchSpec.module``): that module's ``configure`` reads its own keys into ``ModelConfig.ext``
  (glm-dsa: the DSA indexer's ``IndexerConfig``) and it builds its attention weights and step.
  glm5-next's ``attention.head_count_kv`` is a per-layer array (read by its module) and its MLA
  has no RoPE (``rope.dimension_count`` 0). gpt-oss (module ``gpt_oss``): NEOX RoPE with YaRN's
  correction range unrounded, the router's SOFTMAX_WEIGHT gating (top-k logits, then softmax).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from ...errors import UnsupportedModelError

__all__ = ["ModelConfig", "ArchSpec", "ARCHS", "GATING_SOFTMAX", "GATING_SIGMOID",
           "GATING_SOFTMAX_WEIGHT", "ROPE_NEOX", "ROPE_NORM"]

GATING_SOFTMAX, GATING_SIGMOID, GATING_SOFTMAX_WEIGHT = 1, 2, 3   # llama_expert_gating_func_type
ROPE_NORM, ROPE_NEOX = "norm", "neox"


@dataclass(frozen=True)
class ArchSpec:
    """What llama.cpp hard-wires for one ``general.architecture``."""

    rope: str                      # ROPE_NEOX or ROPE_NORM
    gating: int | None             # fixed gating; None = read expert_gating_func
    default_gating: int            # when the key is absent
    norm_w: bool | None            # fixed weight normalisation; None = read expert_weights_norm
    read_scale: bool               # expert_weights_scale is honoured
    post_attn_norm: str            # the FFN input norm's tensor name
    nextn: bool = False            # may carry NextN blocks
    mla: bool = False              # DeepSeek multi-head latent attention
    module: str | None = None      # runtime.model.archs.<module> composes the layers
    kv_per_layer: bool = False     # attention.head_count_kv is a per-layer array read by the
                                   # module (glm5-next: 0 = KDA, 1 = MLA)
    nope: bool = False             # rope.dimension_count may be 0 (no RoPE at all)


ARCHS: dict[str, ArchSpec] = {
    "qwen3moe": ArchSpec(ROPE_NEOX, GATING_SOFTMAX, GATING_SOFTMAX, True, False, "ffn_norm"),
    "glm4moe": ArchSpec(ROPE_NEOX, None, GATING_SIGMOID, None, True, "post_attention_norm",
                        nextn=True),
    "llama": ArchSpec(ROPE_NORM, GATING_SOFTMAX, GATING_SOFTMAX, True, True, "ffn_norm"),
    "deepseek2": ArchSpec(ROPE_NORM, None, GATING_SOFTMAX, None, True, "ffn_norm", nextn=True,
                          mla=True),
    "glm-dsa": ArchSpec(ROPE_NORM, None, GATING_SIGMOID, None, True, "ffn_norm", nextn=True,
                        mla=True, module="glm_dsa"),
    "glm5-next": ArchSpec(ROPE_NORM, None, GATING_SIGMOID, None, True, "ffn_norm", nextn=True,
                          mla=True, module="glm5_next", kv_per_layer=True, nope=True),
    "gpt-oss": ArchSpec(ROPE_NEOX, GATING_SOFTMAX_WEIGHT, GATING_SOFTMAX_WEIGHT, False, False,
                        "post_attention_norm", module="gpt_oss"),
}


def _get(kv: Mapping[str, Any], key: str, default: Any = None) -> Any:
    e = kv.get(key)
    if e is None:
        return default
    return getattr(e, "value", e)


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layers: int                   # decoder blocks that run (block_count - n_nextn)
    n_nextn: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int                  # key_length
    v_head_dim: int                # value_length
    n_vocab: int
    n_ff: int                      # dense FFN width (leading dense layers)
    n_ff_exp: int
    n_experts: int
    n_expert_used: int
    n_expert_shared: int
    n_dense_lead: int
    rms_eps: float
    rope: str
    n_rot: int
    rope_base: float
    rope_freq_scale: float = 1.0   # 1 / scaling factor (linear and YaRN)
    rope_yarn: bool = False
    rope_orig_ctx: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_truncate: bool = True     # floor/ceil YaRN's correction range (llama.cpp always does;
                                   # gpt-oss defines it unrounded)
    gating: int = GATING_SOFTMAX
    norm_w: bool = True
    w_scale: float = 0.0           # 0 = no scaling (llama.cpp's scale_w false)
    n_group: int = 1
    n_group_used: int = 1
    n_ctx_train: int = 4096
    # MLA (deepseek2); kv_lora_rank 0 = not MLA
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    k_head_mla: int = 0            # qk_nope + qk_rope per head
    v_head_mla: int = 0
    yarn_log_mul: float = 0.0
    ext: Any = None                # the arch module's own parameters (ArchSpec.module)
    spec: ArchSpec = field(default=ARCHS["qwen3moe"], compare=False, repr=False)

    @property
    def n_block(self) -> int:
        return self.n_layers + self.n_nextn

    def is_moe(self, layer: int) -> bool:
        return self.n_experts > 0 and layer >= self.n_dense_lead

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def qk_nope(self) -> int:
        return self.k_head_mla - self.n_rot

    @property
    def rope_mscale_in_attention(self) -> bool:
        """deepseek2: YaRN's magnitude correction scales the scores, not cos/sin."""
        return self.mla

    @property
    def kq_scale(self) -> float:
        if self.mla:
            m = 1.0
            if self.rope_yarn and self.rope_freq_scale != 1.0:
                m = 1.0 + 0.1 * self.yarn_log_mul * math.log(1.0 / self.rope_freq_scale)
            return m * m / math.sqrt(self.k_head_mla)
        return 1.0 / math.sqrt(self.head_dim)

    def replace(self, **kw: Any) -> ModelConfig:
        return replace(self, **kw)

    @classmethod
    def from_gguf(cls, kv: Mapping[str, Any], tensor_names: set[str] | None = None,
                  path: str | None = None) -> ModelConfig:
        """Read the config of the model whose metadata is ``kv`` (name → KVEntry or value)."""
        arch = _get(kv, "general.architecture")
        if arch not in ARCHS:
            raise UnsupportedModelError(
                f"architecture {arch!r} is not supported by the runtime", path=path,
                fix="supported: " + ", ".join(ARCHS))
        spec = ARCHS[arch]
        a = lambda key, default=None: _get(kv, f"{arch}.{key}", default)  # noqa: E731
        block_count = int(a("block_count", 0))
        n_nextn = int(a("nextn_predict_layers", 0) or 0)
        n_embd = int(a("embedding_length", 0))
        n_head = _scalar(a("attention.head_count", 0), "attention.head_count", path)
        n_head_kv = n_head if spec.kv_per_layer else \
            _scalar(a("attention.head_count_kv", n_head), "attention.head_count_kv", path)
        head_dim = int(a("attention.key_length", 0) or (n_embd // max(n_head, 1)))
        n_experts = int(a("expert_count", 0) or 0)
        n_used = _scalar(a("expert_used_count", 0) or 0, "expert_used_count", path)
        if n_experts < 1 or n_used < 1:
            raise UnsupportedModelError("the model has no routed experts (expert_count is 0)",
                                        path=path, fix="expertfs runs Mixture-of-Experts models")
        n_vocab = int(a("vocab_size", 0) or len(_get(kv, "tokenizer.ggml.tokens", []) or []))
        n_ff = _scalar(a("feed_forward_length", 0) or 0, "feed_forward_length", path)
        n_ff_exp = int(a("expert_feed_forward_length", 0) or 0)
        if not n_ff_exp:        # llama (Mixtral): experts are sized by feed_forward_length
            n_ff_exp = n_ff if arch == "llama" else n_ff // max(n_used, 1)
        gating = spec.gating or int(a("expert_gating_func", 0) or 0) or spec.default_gating
        if arch == "deepseek2" and not a("expert_gating_func") and \
                block_count - n_nextn in (47, 48) and n_vocab == 154880:
            gating = GATING_SIGMOID                  # GLM-4.7-Flash, as llama.cpp guesses
        norm_w = spec.norm_w if spec.norm_w is not None else bool(a("expert_weights_norm", False))
        w_scale = float(a("expert_weights_scale", 0.0) or 0.0) if spec.read_scale else 0.0
        scaling = str(a("rope.scaling.type", "none") or "none")
        factor = float(a("rope.scaling.factor", 0.0) or 0.0)
        cfg = cls(
            arch=arch, n_layers=block_count - n_nextn, n_nextn=n_nextn, n_embd=n_embd,
            n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
            v_head_dim=int(a("attention.value_length", 0) or head_dim),
            n_vocab=n_vocab, n_ff=n_ff, n_ff_exp=n_ff_exp, n_experts=n_experts,
            n_expert_used=n_used, n_expert_shared=int(a("expert_shared_count", 0) or 0),
            n_dense_lead=int(a("leading_dense_block_count", 0) or 0),
            rms_eps=float(a("attention.layer_norm_rms_epsilon", 1e-6)),
            rope=spec.rope,
            n_rot=int(a("rope.dimension_count", 0) or (0 if spec.nope else head_dim)),
            rope_base=float(a("rope.freq_base", 10000.0)),
            rope_freq_scale=1.0 / factor if scaling in ("linear", "yarn") and factor > 0 else 1.0,
            rope_yarn=scaling == "yarn",
            rope_orig_ctx=int(a("rope.scaling.original_context_length", 0) or
                              a("context_length", 4096)),
            # the file's (the converter writes the model's; Kimi-K2's are 1 / 1), as transformers
            # computes; llama.cpp 0.3.36 reads them for grok and mistral3 only, its deepseek2
            # keeps 32 / 1 (so its Kimi-K2 logits drift from these with the position)
            yarn_beta_fast=float(a("rope.scaling.yarn_beta_fast", 32.0) or 32.0),
            yarn_beta_slow=float(a("rope.scaling.yarn_beta_slow", 1.0) or 1.0),
            gating=gating, norm_w=norm_w, w_scale=w_scale,
            n_group=int(a("expert_group_count", 1) or 1),
            n_group_used=int(a("expert_group_used_count", 1) or 1),
            n_ctx_train=int(a("context_length", 4096)),
            q_lora_rank=int(a("attention.q_lora_rank", 0) or 0) if spec.mla else 0,
            kv_lora_rank=int(a("attention.kv_lora_rank", 0) or 0) if spec.mla else 0,
            k_head_mla=int(a("attention.key_length_mla", 0) or 0) if spec.mla else 0,
            v_head_mla=int(a("attention.value_length_mla", 0) or 0) if spec.mla else 0,
            yarn_log_mul=float(a("rope.scaling.yarn_log_multiplier", 0.0) or 0.0) / 0.1,
            spec=spec)
        if spec.module is not None:
            from .archs import arch_module
            cfg = arch_module(spec).configure(cfg, a, path)
        cfg._validate(tensor_names, path)
        return cfg

    def _validate(self, names: set[str] | None, path: str | None) -> None:
        def bad(problem: str, fix: str = "the GGUF metadata is inconsistent; reconvert the model"):
            return UnsupportedModelError(f"{self.arch}: {problem}", path=path, fix=fix)

        if self.n_layers < 1 or self.n_embd < 1 or self.n_head < 1 or self.n_head_kv < 1:
            raise bad(f"{self.n_layers} layers, n_embd {self.n_embd}, {self.n_head}/{self.n_head_kv}"
                      " heads")
        if self.n_head % self.n_head_kv:
            raise bad(f"{self.n_head} heads is not a multiple of {self.n_head_kv} KV heads")
        if self.n_rot % 2 or not 0 < self.n_rot <= self.head_dim and \
                not (self.spec.nope and self.n_rot == 0):
            raise bad(f"rope dimension {self.n_rot} for head_dim {self.head_dim}")
        if not 1 <= self.n_expert_used <= self.n_experts:
            raise bad(f"top-{self.n_expert_used} of {self.n_experts} experts")
        if self.n_group > 1 and (self.n_experts % self.n_group or
                                 not 0 < self.n_group_used <= self.n_group):
            raise bad(f"expert groups {self.n_group_used}/{self.n_group} for {self.n_experts} experts")
        if self.n_group > 1 and self.n_experts // self.n_group < 2:
            # a group is scored by its two best experts (llama.cpp's build_moe_ffn)
            raise bad(f"expert groups of {self.n_experts // self.n_group} expert: group-limited "
                      "routing scores each group by its two best")
        if self.spec.mla and not (self.kv_lora_rank and self.k_head_mla > self.n_rot
                                  and self.v_head_mla):
            raise bad("MLA without kv_lora_rank / key_length_mla / value_length_mla",
                      "reconvert the model with a current convert_hf_to_gguf.py")
        if self.n_nextn and not self.spec.nextn:
            raise bad("NextN blocks on an architecture that has none")
        if self.n_vocab < 1:
            raise bad("no vocabulary size (no tokenizer.ggml.tokens)")
        if names is not None:
            need = ["token_embd.weight", "output_norm.weight"]
            missing = [n for n in need if n not in names]
            if missing:
                raise bad("tensor " + ", ".join(missing) + " is missing",
                          "the store is not a complete model; repack it from the full GGUF")


def _scalar(v: Any, key: str, path: str | None) -> int:
    """A per-layer array key that is the same for every layer, or a scalar."""
    if isinstance(v, (list, tuple)) or hasattr(v, "tolist"):
        vals = set(int(x) for x in (v.tolist() if hasattr(v, "tolist") else v))
        if len(vals) != 1:
            raise UnsupportedModelError(f"{key} differs between layers", path=path,
                                        fix="per-layer head/expert counts are not supported")
        return vals.pop()
    return int(v)
