"""Build the trunk of a model from a store: per-block weights under llama.cpp's tensor names.

Names (``blk.N.`` prefix): ``attn_norm``, ``attn_{q,k,v}`` (+ ``.bias``), ``attn_output``,
``attn_{q,k}_norm`` (optional), the FFN norm (``ffn_norm``; glm4moe ``post_attention_norm``),
a router ``ffn_gate_inp`` (+ ``exp_probs_b.bias``) and shared expert ``ffn_*_shexp`` on MoE
blocks, ``ffn_{gate,up,down}`` on dense ones; globals ``token_embd``, ``output_norm`` and
``output`` (absent: tied to ``token_embd``). A block is MoE when it has a router. NextN blocks
(``blk.{n_layers}...``) are loaded the same way plus their ``nextn.*`` tensors; they are kept
for the MTP draft (``expertfs.runtime.mtp``) and never run by ``Model.forward``; a NextN
``embed_tokens`` is an ``Embedding`` (row lookups), the other NextN matrices are ``Linear``.
An architecture with its own module (``archs``) builds its blocks' attention weights itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...errors import StoreError
from ...formats.ggml import GGMLType
from .archs import arch_module
from .attention import AttentionWeights
from .mla import HeadMatrices, MLAWeights
from .config import ModelConfig
from .ffn import DenseFFN
from .moe import MoEWeights
from .qmatvec import SUPPORTED
from .router import RouterWeights
from .weights import Embedding, Linear, RawTensor, TrunkReader, plan_float

__all__ = ["BlockWeights", "TrunkWeights", "load_trunk", "linears", "mapped_matrices"]

_NEXTN = ("eh_proj", "enorm", "hnorm", "embed_tokens", "shared_head_head", "shared_head_norm")


@dataclass
class BlockWeights:
    layer: int
    attn_norm: torch.Tensor
    attn: AttentionWeights | MLAWeights
    ffn_norm: torch.Tensor
    moe: MoEWeights | None = None
    dense: DenseFFN | None = None
    nextn: dict[str, torch.Tensor | Linear | Embedding] = field(default_factory=dict)


@dataclass
class TrunkWeights:
    embed: Embedding
    blocks: list[BlockWeights]          # the n_layers decoder blocks, in order
    nextn: list[BlockWeights]           # NextN/MTP blocks (loaded, not run)
    output_norm: torch.Tensor
    output: Linear
    float_bytes: int = 0                # trunk bytes held dequantized (copies, not the map)
    quant_bytes: int = 0                # trunk bytes read in place from the map (ggml blocks,
                                        # F32 tensors, the embedding)


class _Builder:
    def __init__(self, reader: TrunkReader, cfg: ModelConfig, dtype: torch.dtype,
                 device: torch.device, float_names: set[str], fused: bool) -> None:
        self.r, self.cfg, self.dtype, self.device = reader, cfg, dtype, device
        self.float_names, self.fused = float_names, fused
        self.keep_heads = False         # per-head 3-D tensors as ggml bytes (``heads``)
        self.float_bytes = self.quant_bytes = 0

    def _count(self, nbytes: int, float_copy: torch.Tensor | None) -> None:
        """``nbytes`` of the trunk loaded: held as ``float_copy``, or read in place from the
        map (ggml bytes: ``float_copy`` None; an F32 tensor ``to_float`` returned as a view)."""
        if float_copy is None or self.r.span_of(float_copy) is not None:
            self.quant_bytes += nbytes
        else:
            self.float_bytes += nbytes

    def vec(self, name: str, *, f32: bool = True) -> torch.Tensor:
        t = self.r.get(name).to_float(torch.float32 if f32 else self.dtype, self.device)
        self._count(t.numel() * t.element_size(), t)
        return t

    def opt_vec(self, name: str) -> torch.Tensor | None:
        return self.vec(name) if name in self.r else None

    def lin(self, base: str, *, bias: bool = True) -> Linear:
        w = self.r.get(base + ".weight")
        b = self.r.opt(base + ".bias") if bias else None
        lin = Linear.load(w, b, dtype=self.dtype, device=self.device,
                          quantized=w.name not in self.float_names)
        lin.fused = self.fused
        self._count(lin.nbytes, lin.weight)
        return lin

    def heads(self, name: str) -> HeadMatrices:
        """A per-head 3-D tensor (``attn_k_b``/``attn_v_b``): kept as ggml bytes for the native
        kernels when the one-token products are fused and the trunk is not forced to float."""
        raw = self.r.get(name)
        hm = HeadMatrices.quantized(raw) if self.keep_heads and self.device.type == "cpu" \
            else None
        if hm is not None:
            self.quant_bytes += hm.nbytes
            return hm
        hm = HeadMatrices(raw.to_float(self.dtype, self.device))
        self.float_bytes += hm.nbytes
        return hm

    def mla(self, p: str) -> MLAWeights:
        r = self.r
        w = MLAWeights(self.lin(p + "attn_kv_a_mqa"), self.vec(p + "attn_kv_a_norm.weight"),
                       self.heads(p + "attn_k_b.weight"),                       # [H, L, N]
                       self.heads(p + "attn_v_b.weight"),                       # [H, V, L]
                       self.lin(p + "attn_output"))
        if p + "attn_q.weight" in r:
            w.wq = self.lin(p + "attn_q")
        else:
            w.wq_a, w.wq_b = self.lin(p + "attn_q_a"), self.lin(p + "attn_q_b")
            w.q_a_norm = self.vec(p + "attn_q_a_norm.weight")
        return w

    def block(self, i: int) -> BlockWeights:
        p, cfg = f"blk.{i}.", self.cfg
        mod = arch_module(cfg.spec)
        if mod is not None:
            attn = mod.load_attention(self, p, i)
        elif cfg.mla:
            attn: AttentionWeights | MLAWeights = self.mla(p)
        else:
            attn = AttentionWeights(self.lin(p + "attn_q"), self.lin(p + "attn_k"),
                                    self.lin(p + "attn_v"), self.lin(p + "attn_output"),
                                    self.opt_vec(p + "attn_q_norm.weight"),
                                    self.opt_vec(p + "attn_k_norm.weight"))
        blk = BlockWeights(i, self.vec(p + "attn_norm.weight"), attn,
                           self.vec(p + cfg.spec.post_attn_norm + ".weight"))
        if p + "ffn_gate_inp.weight" in self.r:
            router = RouterWeights(self.vec(p + "ffn_gate_inp.weight"),
                                   self.opt_vec(p + "exp_probs_b.bias"))
            if router.weight.shape != (cfg.n_experts, cfg.n_embd):
                raise StoreError(f"blk.{i}.ffn_gate_inp has shape {tuple(router.weight.shape)}, "
                                 f"expected ({cfg.n_experts}, {cfg.n_embd})", path=self.r.path,
                                 fix="the metadata and the tensors disagree; reconvert")
            shared = None
            if p + "ffn_gate_shexp.weight" in self.r:
                shared = DenseFFN(self.lin(p + "ffn_gate_shexp"), self.lin(p + "ffn_up_shexp"),
                                  self.lin(p + "ffn_down_shexp"))
            blk.moe = MoEWeights(router, shared)
        else:
            blk.dense = DenseFFN(self.lin(p + "ffn_gate"), self.lin(p + "ffn_up"),
                                 self.lin(p + "ffn_down"))
        if mod is not None and hasattr(mod, "finish_block"):
            mod.finish_block(self, blk)         # per-layer FFN settings (swiglu clamps)
        return blk

    def nextn_extras(self, blk: BlockWeights) -> None:
        p = f"blk.{blk.layer}.nextn."
        for n in _NEXTN:
            name = p + n + ".weight"
            if name not in self.r:
                continue
            raw = self.r.get(name)
            if n == "embed_tokens":             # looked up by row, like token_embd
                blk.nextn[n] = Embedding(raw, self.device)
                self.quant_bytes += raw.nbytes
            else:
                blk.nextn[n] = self.vec(name) if len(raw.shape) == 1 else self.lin(p + n, bias=False)


def _matrices(reader: TrunkReader, cfg: ModelConfig, nextn: bool) -> list[RawTensor]:
    """Every 2-D trunk tensor the forward multiplies by (routers and the embedding excluded)."""
    out = []
    last = cfg.n_block if nextn else cfg.n_layers
    tied = "output.weight" not in reader
    for name in sorted(reader.names()):
        raw = reader.get(name)
        if len(raw.shape) != 2 or "ffn_gate_inp" in name or name.endswith("nextn.embed_tokens.weight"):
            continue
        if name == "token_embd.weight" and not tied:
            continue
        if name.startswith("blk."):
            if int(name.split(".")[1]) >= last:
                continue
        out.append(raw)
    return out


def _kept_quantized(device: torch.device) -> frozenset:
    """The quantized types the fused one-token products take from their bytes on ``device``."""
    from .. import kernels as native
    if torch.device(device).type != "cpu" or not native.available():
        return SUPPORTED
    return SUPPORTED | (native.TYPES - {GGMLType.F16, GGMLType.BF16})


def load_trunk(reader: TrunkReader, cfg: ModelConfig, *, dtype: torch.dtype,
               device: torch.device, trunk_mode: str = "auto",
               float_budget: int | None = None, nextn: bool = True,
               fused: bool = False) -> TrunkWeights:
    """Dequantize (or keep) every trunk tensor of ``cfg``'s model from ``reader``.

    ``fused``: one-token products of quantized matrices go through ``qmatvec`` (and under
    ``trunk_mode="auto"`` the types it supports stay quantized: its compiled types, and on the
    CPU every quantized type of the native kernels when they are built); MLA's per-head
    ``attn_k_b``/``attn_v_b`` then stay ggml bytes too where the native kernels take them
    (``mla.HeadMatrices``; float32 compute, any ``trunk_mode`` but ``float``)."""
    float_names = plan_float(_matrices(reader, cfg, nextn), trunk_mode, dtype, float_budget,
                             _kept_quantized(device) if fused else frozenset())
    b = _Builder(reader, cfg, dtype, device, float_names, fused)
    b.keep_heads = fused and trunk_mode != "float" and dtype == torch.float32
    embed = Embedding(reader.get("token_embd.weight"), device)
    if embed.shape != (cfg.n_vocab, cfg.n_embd):
        if embed.shape[1] != cfg.n_embd:
            raise StoreError(f"token_embd has shape {embed.shape}, n_embd is {cfg.n_embd}",
                             path=reader.path, fix="reconvert the model")
    blocks = [b.block(i) for i in range(cfg.n_layers)]
    extra = []
    if nextn:
        for i in range(cfg.n_layers, cfg.n_block):
            if f"blk.{i}.attn_norm.weight" not in reader:     # a trunk-only GGUF
                continue
            blk = b.block(i)
            b.nextn_extras(blk)
            extra.append(blk)
    out_norm = b.vec("output_norm.weight")
    if "output.weight" in reader:
        output = b.lin("output", bias=False)
    else:                                   # tied embeddings (llama.cpp falls back the same way)
        output = Linear.load(reader.get("token_embd.weight"), None, dtype=dtype, device=device,
                             quantized="token_embd.weight" not in float_names)
        output.fused = fused
    return TrunkWeights(embed, blocks, extra, out_norm, output,
                        b.float_bytes, b.quant_bytes + embed.raw.nbytes)


def linears(t: TrunkWeights, nextn: bool = False) -> list[Linear]:
    """Every ``Linear`` the decoder blocks and the output head multiply by (``nextn``: the
    NextN blocks' too, and their own projections)."""
    out = [t.output]
    for b in t.blocks + (t.nextn if nextn else []):
        for obj in (b.attn, b.dense, b.moe.shared if b.moe else None):
            out += _linears_of(obj)
        if nextn:
            out += [v for v in b.nextn.values() if isinstance(v, Linear)]
    return out


def set_act_quant(t: TrunkWeights, mode: str) -> None:
    """The trunk's one-token products (attention, dense and shared FFNs, the output head, the
    NextN blocks) take ``mode``'s activations: ``"q8"`` quantizes them as llama.cpp does
    (lossy, opt-in), ``"off"`` keeps them exact."""
    for lin in linears(t, nextn=True):
        if lin.q is not None and lin.fused:
            lin.act_quant = None if mode == "off" else mode
    for b in t.blocks + t.nextn:                          # MLA's per-head k_b / v_b products
        for hm in _attrs_of(b.attn, HeadMatrices):
            hm.act_quant = None if mode == "off" else mode


def mapped_matrices(obj: object) -> list[RawTensor]:
    """The ggml bytes a weights object multiplies straight from the trunk's mapping every call:
    its ``Linear``s kept quantized and its per-head MLA matrices kept as bytes."""
    return ([lin.q for lin in _linears_of(obj) if lin.q is not None]
            + [h.raw for h in _attrs_of(obj, HeadMatrices) if h.raw is not None])


def _linears_of(obj: object) -> list[Linear]:
    return _attrs_of(obj, Linear)


def _attrs_of(obj: object, kind: type) -> list:
    """The ``kind`` attributes of a weights dataclass, nested ones (an indexer's, a glm5-next
    layer's MLA) included."""
    if obj is None:
        return []
    out = []
    for v in vars(obj).values():
        if isinstance(v, kind):
            out.append(v)
        elif hasattr(v, "__dataclass_fields__"):
            out += _attrs_of(v, kind)
    return out
