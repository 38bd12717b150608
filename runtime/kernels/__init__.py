"""Native CPU kernels: matrix-vector products straight from ggml blocks (C++, AVX2+FMA+F16C
with a portable fallback, the CPU checked at load).

Two numerics, chosen per call by ``act_quant``:

- ``"off"`` (the default, *exact*): float32 activations and float32 accumulation. The result
  equals ``F.linear(x, dequantize(W))`` up to float rounding (weights enter as scale × integer,
  factored per sub-block: ``Σ_s d·sc_s·Σ q·x − dmin·m_s·Σ x``). Where the CPU has AMX-BF16
  (Intel, Sapphire Rapids on), a prompt's wide products of the Q8_K types (Q2_K ... Q6_K,
  IQ4_XS, the lattice IQ and TQ types) and of the blocks-of-32 types (Q8_0, Q4_0, Q5_0, Q4_1,
  Q5_1, IQ4_NL, MXFP4: rows of any multiple of 32 weights) run on the tile unit from exact
  bf16 parts of the weights and the activations (``qgemm_amx.cpp``; ``EXPERTFS_AMX=0`` or
  ``without_amx()`` keeps the float panel): the same bound, not the same bits.
- ``"q8"`` (opt-in, lossy): activations quantized the way llama.cpp quantizes them (Q8_K for
  the K-quants, the IQ types but IQ4_NL and the TQ types, Q8_0 for Q4_0/Q5_0/Q8_0/MXFP4/IQ4_NL, Q8_1 for
  Q4_1/Q5_1, fp16/bf16 rounding for F16/BF16) and integer dot products per block: llama.cpp's
  own numerics. Its
  quality cost against the exact mode is measured by ``bench/bench_decode_actquant.py``. Its
  wide products (``qgemm``: a prompt's) go through 8-bit integer panels where the CPU has
  AVX512-VNNI (or AVX-VNNI) and the type has one (the K-quants Q2_K-Q6_K, IQ4_XS, the lattice
  IQ and TQ types; with AVX512-VNNI also the blocks-of-32 types Q8_0, Q4_0, Q5_0, Q4_1, Q5_1,
  IQ4_NL and MXFP4 in rows of any multiple of 32 weights; ``widths.q8_panel``), else through
  the exact panel product (AMX's where it takes the type).

Types: Q4_K, Q6_K, Q5_K, Q8_0, Q4_0, Q2_K, Q3_K, IQ4_XS, MXFP4, Q5_0, Q5_1, Q4_1, BF16, F16,
IQ4_NL, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M (the lattice IQ types' codebooks
handed over from gguf-py at load, ``iq_tables``), TQ1_0, TQ2_0 (q8: Q8_K activations, llama.cpp's
``ggml_vec_dot_tq*_q8_K``).

``matvec(x, raw, type, shape)`` is ``x [T, in] @ W.T`` for a weight of torch shape
``(out, in)`` given as its ggml bytes; ``dequant(raw, type, shape)`` is that W as float32 (for
products wider than the several-token kernels); ``moe(x, w, gate, up, down, ...)`` is one decode step
through a layer's selected experts in one call (every expert's gate and up rows, SiLU·up, then
each output row summed over the experts' down rows, weighted), parallel over rows and experts
on torch's intra-op threads; ``moe_hidden``, ``moe_down_rows`` and ``moe_combine`` are its
steps (gate/up per expert, each expert's down rows, then their weighted sum in the given order),
so a layer can compute its resident experts while the others load and still get ``moe``'s
bits; ``expert_tokens`` is one expert over its tokens of a prompt (the products, the activation
and the weighting of ``runtime.model.ffn.expert_ffn`` in one call). A decode step's small
operations each have one call too (``rms_norm``, ``norm_rope_``, ``attn_decode``, ``route``,
``kda_step_``, ``sinkhorn_``, and glm5-next's ``hc_pre``, ``hc_post``, ``conv_step_`` and
``kda_token_``),
within float rounding of the torch code they replace. All return None when the
kernels are unavailable (no compiler, ``EXPERTFS_NATIVE=0``, a failed build: logged once) or do
not apply (type, device, dtype), so callers fall back to their torch paths.
"""

from . import cpu, widths
from .build import load, status
from .ops import (ACT_QUANT, TYPES, WIDE_TYPES, act_quant_mode,
                  attn_decode, available, conv_step_, dequant, expert_tokens, hc_post, hc_pre,
                  kda_step_, kda_token_, matvec,
                  max_tokens, moe, moe_combine, moe_down_rows, moe_hidden, norm_rope_, qgemm,
                  rms_norm, route, set_spin_us, set_threads, sinkhorn_, without_amx)

__all__ = ["ACT_QUANT", "TYPES", "WIDE_TYPES", "act_quant_mode", "cpu",
           "attn_decode", "available", "conv_step_", "dequant", "expert_tokens", "hc_post",
           "hc_pre", "kda_step_", "kda_token_", "load",
           "matvec", "max_tokens", "moe", "moe_combine", "moe_down_rows", "moe_hidden",
           "norm_rope_", "qgemm", "rms_norm", "route", "set_spin_us", "set_threads", "sinkhorn_",
           "status", "widths", "without_amx"]
