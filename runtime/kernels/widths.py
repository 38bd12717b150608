"""How many tokens one native product should take before a batch goes to the panel product
(``kernels.qgemm``: each panel of weights decoded once and multiplied by every token), per type,
ISA and numerics, as measured (bench/README.md): ``max_tokens``."""

from __future__ import annotations

from types import ModuleType

from ...formats.ggml import GGMLType
from .build import load
from .cpu import amd_full_512, splits_512

__all__ = ["max_tokens", "q8_panel", "splits_512", "WIDE_TYPES", "WIDE_TYPES_AVX2",
           "WIDE_TYPES_Q8_AVX2", "WIDE_TYPES_FULL512", "WIDE_TYPES_Q8_FULL512",
           "WIDE_TYPES_Q8_VNNI", "WIDE_TYPES_Q8_VNNI_SPLIT512", "WIDE_TYPES_Q8_VNNI_ZEN5",
           "WIDE_TYPES_Q8_AVXVNNI", "WIDE_TYPES_AMX"]

#: Most tokens per native product, per type, under the AVX-512 kernels on a CPU that executes
#: 512-bit operations as two 256-bit halves (AMD Zen 4, ``splits_512``; exact numerics): the
#: widest batch up to which the rows kernels took at least 1.05 times less time than the panel
#: product (``kernels.qgemm``, which every batch past the limit takes), in the geometric mean
#: over the expert and trunk shapes on 2 threads (``bench_kernels.py --prefill -t 2 --tokens
#: 4,6,8,10,12,16,24,32,48,64,96,128,192``; two runs, the lower limit where they differ;
#: bench/README.md). The rows kernels stay ahead of the panel up to more tokens than on the
#: full-width Zen 5 of ``WIDE_TYPES_FULL512``, the table-lookup types' by far the most.
WIDE_TYPES = {
    GGMLType.Q4_K: 12, GGMLType.Q5_K: 12, GGMLType.Q6_K: 12, GGMLType.Q2_K: 48,
    GGMLType.Q3_K: 32, GGMLType.Q4_0: 48, GGMLType.Q8_0: 48, GGMLType.Q4_1: 12,
    GGMLType.Q5_0: 48, GGMLType.Q5_1: 32, GGMLType.MXFP4: 96, GGMLType.IQ4_XS: 48,
    GGMLType.IQ4_NL: 64, GGMLType.IQ2_XXS: 12, GGMLType.IQ2_XS: 12, GGMLType.IQ2_S: 12,
    GGMLType.IQ3_XXS: 12, GGMLType.IQ3_S: 12, GGMLType.IQ1_S: 12, GGMLType.IQ1_M: 12,
    GGMLType.TQ1_0: 8, GGMLType.TQ2_0: 8,
}

#: The same under the AVX2 kernels (exact, then q8), past which ``wide_linear`` takes the
#: product through ``qgemm`` in AVX2. Exact: measured with 8 to 128 tokens on 2 threads with the
#: kernels held to AVX2 and MKL's AVX2 code (an AVX2 box's products; ``bench_kernels.py
#: --prefill --isa avx2``, ``EXPERTFS_GEMM=mkl``); 8 where qgemm is as fast at 8 tokens; the
#: lattice IQ and TQ types again after their panel took the AVX2 dequantization (4-48 tokens:
#: the panel product is faster from 6, IQ2_XXS from 8). q8:
#: measured the same way on an AVX2-only CPU (a first-generation Zen) after the q8 kernels took
#: up to 4 tokens per decode of the weights.
WIDE_TYPES_AVX2 = {
    GGMLType.Q4_K: 8, GGMLType.Q5_K: 8, GGMLType.Q6_K: 8, GGMLType.Q8_0: 12, GGMLType.Q4_0: 12,
    GGMLType.Q2_K: 32, GGMLType.Q3_K: 24, GGMLType.IQ4_XS: 24, GGMLType.MXFP4: 32,
    GGMLType.IQ4_NL: 32, GGMLType.IQ2_XXS: 6, GGMLType.IQ2_XS: 4, GGMLType.IQ2_S: 4,
    GGMLType.IQ3_XXS: 4, GGMLType.IQ3_S: 4, GGMLType.IQ1_S: 4, GGMLType.IQ1_M: 4,
    GGMLType.TQ1_0: 4, GGMLType.TQ2_0: 4, GGMLType.Q4_1: 12, GGMLType.Q5_0: 32,
    GGMLType.Q5_1: 32,
}
WIDE_TYPES_Q8_AVX2 = {
    GGMLType.Q4_K: 12, GGMLType.Q5_K: 8, GGMLType.Q6_K: 8, GGMLType.Q8_0: 16, GGMLType.Q4_0: 12,
    GGMLType.Q2_K: 12, GGMLType.Q3_K: 16, GGMLType.IQ4_XS: 64, GGMLType.MXFP4: 32,
    GGMLType.IQ4_NL: 24, GGMLType.IQ2_XXS: 128, GGMLType.IQ2_XS: 64, GGMLType.IQ2_S: 128,
    GGMLType.IQ3_XXS: 128, GGMLType.IQ3_S: 48, GGMLType.IQ1_S: 16, GGMLType.IQ1_M: 24,
    GGMLType.TQ1_0: 12, GGMLType.TQ2_0: 24, GGMLType.Q4_1: 12, GGMLType.Q5_0: 24,
    GGMLType.Q5_1: 32,
}

#: The same under the AVX-512 kernels on a CPU with full-width 512-bit units (a Zen 5, an Intel
#: CPU), exact then q8 (the q8 rows kernels against the exact panel: q8 for a type without an
#: integer panel); exact measured on a Zen 5 as ``WIDE_TYPES`` (``bench_kernels.py --prefill -t
#: 2 --rounds 3 --tokens 4,6,8,10,12,16,24,32,48,64``, two runs, the lower limit where they
#: differ), after the table-lookup rows kernels of Q2_K, Q3_K, IQ4_XS and IQ4_NL and the one-row
#: K-quant kernels, which took the limits from 8-24 to where the split CPU's stand; again (8 to 96
#: tokens) after Q4_K's, IQ4_XS's and Q3_K's rows kernels took rows in pairs past a 32 KiB pass
#: and the panel's 17-32-token tail its two-vector kernel (qgemm.cpp): Q4_K 12 -> 24, Q6_K 12 ->
#: 20, Q3_K 32 -> 64, IQ4_XS 48 -> 64, TQ2_0 8 -> 10; and IQ2_XXS's, IQ3_XXS's and IQ3_S's (8-32
#: tokens) after their one-row kernels: 12 -> 20, 16, 16; q8 on a Zen 5 with 8 to 128 tokens,
#: before the integer panel existed.
WIDE_TYPES_FULL512 = {
    GGMLType.Q4_K: 24, GGMLType.Q5_K: 12, GGMLType.Q6_K: 20, GGMLType.Q8_0: 48,
    GGMLType.Q4_0: 48, GGMLType.Q2_K: 48, GGMLType.Q3_K: 64, GGMLType.IQ4_XS: 64,
    GGMLType.MXFP4: 64, GGMLType.IQ4_NL: 64, GGMLType.IQ2_XXS: 20, GGMLType.IQ2_XS: 12,
    GGMLType.IQ2_S: 12, GGMLType.IQ3_XXS: 16, GGMLType.IQ3_S: 16, GGMLType.IQ1_S: 12,
    GGMLType.IQ1_M: 12, GGMLType.TQ1_0: 8, GGMLType.TQ2_0: 10, GGMLType.Q4_1: 12,
    GGMLType.Q5_0: 32, GGMLType.Q5_1: 24,
}
WIDE_TYPES_Q8_FULL512 = {
    GGMLType.Q4_K: 8, GGMLType.Q5_K: 8, GGMLType.Q6_K: 12, GGMLType.Q8_0: 8, GGMLType.Q4_0: 8,
    GGMLType.Q2_K: 16, GGMLType.Q3_K: 32, GGMLType.IQ4_XS: 12, GGMLType.MXFP4: 16,
    GGMLType.IQ4_NL: 48, GGMLType.IQ2_XXS: 128, GGMLType.IQ2_XS: 128, GGMLType.IQ2_S: 128,
    GGMLType.IQ3_XXS: 128, GGMLType.IQ3_S: 128, GGMLType.IQ1_S: 32, GGMLType.IQ1_M: 64,
    GGMLType.TQ1_0: 32, GGMLType.TQ2_0: 48, GGMLType.Q4_1: 8, GGMLType.Q5_0: 16,
    GGMLType.Q5_1: 16,
}

#: (kernel ISA, 512-bit operations split in two, numerics) → table. q8 on a CPU that splits them
#: (a Zen 4, which has AVX512-VNNI) takes the integer panel's table for every type; a type
#: without one would take the full-width CPU's q8 table, the only one measured against the
#: exact panel under AVX-512.
_WIDE = {("avx512", True, 0): WIDE_TYPES, ("avx512", True, 1): WIDE_TYPES_Q8_FULL512,
         ("avx512", False, 0): WIDE_TYPES_FULL512, ("avx512", False, 1): WIDE_TYPES_Q8_FULL512,
         ("avx2", False, 0): WIDE_TYPES_AVX2, ("avx2", False, 1): WIDE_TYPES_Q8_AVX2}


def max_tokens(ggml_type: GGMLType, default: int, act_quant: str | None = None) -> int:
    """Most tokens one native product should take for ``ggml_type`` in ``act_quant``'s numerics
    (more: the panel product, ``qgemm``): the figure measured for the ISA the kernels run and the
    CPU's 512-bit units (``splits_512``): ``WIDE_TYPES`` under AVX-512 on a CPU that splits
    512-bit operations, the ``_FULL512`` tables on one that does not, the ``_AVX2`` tables under
    AVX2; where q8's integer panel takes the type ``WIDE_TYPES_Q8_VNNI_SPLIT512``/
    ``WIDE_TYPES_Q8_VNNI_ZEN5`` (``amd_full_512``)/``WIDE_TYPES_Q8_VNNI``/
    ``WIDE_TYPES_Q8_AVXVNNI``, and ``WIDE_TYPES_AMX`` where exact mode's
    AMX panel does; else ``default``."""
    mod = load()
    if mod is None:
        return default
    isa, q8 = mod.isa(), act_quant is not None and act_quant != "off"
    split = isa == "avx512" and splits_512()
    if q8 and int(ggml_type) in _panel_types(mod, isa):
        vnni = (WIDE_TYPES_Q8_AVXVNNI if isa != "avx512" else
                WIDE_TYPES_Q8_VNNI_SPLIT512 if split else
                WIDE_TYPES_Q8_VNNI_ZEN5 if amd_full_512() else WIDE_TYPES_Q8_VNNI)
        return vnni.get(ggml_type, default)
    if not q8 and ggml_type in WIDE_TYPES_AMX and mod.amx():
        return WIDE_TYPES_AMX[ggml_type]
    return _WIDE.get((isa, split, int(q8)), {}).get(ggml_type, default)


#: q8 mode where the CPU has the integer panel product (AVX512-VNNI, ``q8_panel``): past these
#: token counts a batch goes to it. Measured on the AVX-512 Xeon over 2048x7168, 768x2048,
#: 2048x768 and 1536x4096 at 4-16 tokens (``bench_kernels.py --prefill -t 2 --tokens
#: 4,6,8,10,12,16``, the q8 ratio's geometric mean): the widest batch up to which the panel
#: product takes at least 1.05 times the rows kernels' time; where it does not even at 4 tokens
#: (Q4_K, IQ3_XXS, TQ1_0: a tie there), 4, which the rows kernels take in one pass
#: (bench/README.md). The blocks-of-32 types (Q8_0, Q4_0, IQ4_NL, MXFP4: rows of whole
#: 256-weight panels only) the same way at 4-128 tokens: 4. IQ4_XS, Q2_K and Q3_K (their
#: panels added later) the same way at 4-24 tokens: 6, 4 and 6; Q5_0, Q4_1 and Q5_1 (Q8_0 and
#: Q8_1 activations, panels added later still): 4. IQ1_S's and IQ1_M's again (6-16 tokens) after
#: their rows kernels took the gathered table: 6 -> 8 and 8 -> 10.
WIDE_TYPES_Q8_VNNI = {
    GGMLType.Q2_K: 4, GGMLType.Q3_K: 6, GGMLType.Q4_K: 4, GGMLType.Q5_K: 4, GGMLType.Q6_K: 8,
    GGMLType.IQ2_XXS: 4,
    GGMLType.IQ2_XS: 6, GGMLType.IQ2_S: 8, GGMLType.IQ3_XXS: 4, GGMLType.IQ3_S: 8,
    GGMLType.IQ1_S: 8, GGMLType.IQ1_M: 10, GGMLType.TQ1_0: 4, GGMLType.TQ2_0: 8,
    GGMLType.Q8_0: 4, GGMLType.Q4_0: 4, GGMLType.IQ4_NL: 4, GGMLType.MXFP4: 4,
    GGMLType.IQ4_XS: 6, GGMLType.Q5_0: 4, GGMLType.Q4_1: 4, GGMLType.Q5_1: 4,
}

#: The same on a CPU that splits 512-bit operations (a Zen 4, ``splits_512``), measured as
#: ``WIDE_TYPES`` (the q8 ratio, 4-192 tokens, two runs, the lower limit where they differ):
#: the q8 rows kernels stay ahead of the integer panel up to 8-24 tokens there, not 4-10.
WIDE_TYPES_Q8_VNNI_SPLIT512 = {
    GGMLType.Q4_K: 12, GGMLType.Q5_K: 12, GGMLType.Q6_K: 16, GGMLType.Q2_K: 16,
    GGMLType.Q3_K: 12, GGMLType.Q4_0: 8, GGMLType.Q8_0: 8, GGMLType.Q4_1: 8, GGMLType.Q5_0: 8,
    GGMLType.Q5_1: 8, GGMLType.MXFP4: 8, GGMLType.IQ4_XS: 12, GGMLType.IQ4_NL: 8,
    GGMLType.IQ2_XXS: 16, GGMLType.IQ2_XS: 16, GGMLType.IQ2_S: 16, GGMLType.IQ3_XXS: 12,
    GGMLType.IQ3_S: 12, GGMLType.IQ1_S: 12, GGMLType.IQ1_M: 8, GGMLType.TQ1_0: 12,
    GGMLType.TQ2_0: 24,
}

#: The same on an AMD CPU with full-width 512-bit units (a Zen 5, ``amd_full_512``), measured as
#: ``WIDE_TYPES_FULL512`` (the q8 ratio, 4-64 tokens, two runs, the lower limit): its q8 rows
#: kernels stay ahead of the integer panel to 4-16 tokens, where the Xeon's to 4-10
#: (bench/README.md, "The whole matrix on a Zen 5 box").
WIDE_TYPES_Q8_VNNI_ZEN5 = {
    GGMLType.Q4_K: 10, GGMLType.Q5_K: 8, GGMLType.Q6_K: 12, GGMLType.Q2_K: 8, GGMLType.Q3_K: 8,
    GGMLType.Q4_0: 4, GGMLType.Q8_0: 6, GGMLType.Q4_1: 4, GGMLType.Q5_0: 4, GGMLType.Q5_1: 4,
    GGMLType.MXFP4: 4, GGMLType.IQ4_XS: 8, GGMLType.IQ4_NL: 6, GGMLType.IQ2_XXS: 8,
    GGMLType.IQ2_XS: 8, GGMLType.IQ2_S: 8, GGMLType.IQ3_XXS: 8, GGMLType.IQ3_S: 8,
    GGMLType.IQ1_S: 8, GGMLType.IQ1_M: 8, GGMLType.TQ1_0: 8, GGMLType.TQ2_0: 16,
}

#: The same at the AVX2 tier with AVX-VNNI (the panel product in 256-bit vectors): measured on
#: the Xeon with the kernels held to AVX2 (``bench_kernels.py --prefill -t 2 --isa avx2``, the
#: same shapes, 4-128 tokens): the panel product takes less time than the AVX2 q8 rows kernels
#: from 4 tokens, or ties there (bench/README.md), so past 4, their one pass.
WIDE_TYPES_Q8_AVXVNNI = {t: 4 for t in WIDE_TYPES_Q8_VNNI        # (no blocks-of-32 form)
                         if t not in (GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.IQ4_NL,
                                      GGMLType.MXFP4, GGMLType.Q5_0, GGMLType.Q4_1,
                                      GGMLType.Q5_1)}

#: Exact mode where the CPU has AMX-BF16 and the type an AMX panel product (``qgemm_amx.cpp``;
#: the blocks-of-32 types in rows of any multiple of 32 weights): past these token counts a
#: batch goes to it. Measured on the AVX-512 Xeon as the q8 limits above (``bench_kernels.py
#: --prefill -t 2 --tokens 4,6,8,10,12,16,24``, the exact ratio's geometric mean, at least
#: 1.05; bench/README.md);
#: Q4_0's and IQ4_NL's again (4-16 tokens) after their nibbles took the table decode, and the
#: folded form's (4-12 tokens: Q6_K and IQ2_XS 12 -> 10) after its decode took the pipeline;
#: Q5_0, Q4_1 and Q5_1 (llama.cpp's fallbacks for Q4_K and Q5_K), measured as the others: 4;
#: IQ1_M's again (8-16 tokens) after its rows kernels took the float table: 8 -> 12.
WIDE_TYPES_AMX = {
    GGMLType.Q2_K: 8, GGMLType.Q3_K: 6, GGMLType.Q4_K: 8, GGMLType.Q5_K: 8,
    GGMLType.IQ4_XS: 4, GGMLType.IQ2_XXS: 8,
    GGMLType.IQ3_XXS: 8, GGMLType.IQ3_S: 8, GGMLType.IQ1_S: 8, GGMLType.TQ1_0: 6,
    GGMLType.TQ2_0: 6, GGMLType.Q6_K: 10, GGMLType.IQ2_XS: 10, GGMLType.IQ2_S: 8,
    GGMLType.IQ1_M: 12, GGMLType.Q8_0: 8, GGMLType.Q4_0: 6, GGMLType.IQ4_NL: 6,
    GGMLType.MXFP4: 8, GGMLType.Q5_0: 4, GGMLType.Q4_1: 4, GGMLType.Q5_1: 4,
}

#: ISA in use → the type ids q8 mode's integer panel product takes there
_Q8_PANEL: dict[str, frozenset[int]] = {}


def _panel_types(mod: ModuleType, isa: str) -> frozenset[int]:
    types = _Q8_PANEL.get(isa)
    if types is None:
        types = _Q8_PANEL[isa] = frozenset(mod.info().get("q8_panel_types", ()))
    return types


def q8_panel(mod: ModuleType, ggml_type: GGMLType | int) -> bool:
    """Whether q8 mode's integer panel product (AVX512-VNNI, or AVX-VNNI at the AVX2 tier) takes
    ``ggml_type`` at the ISA the kernels run now (``set_isa`` may change it; looked up once per
    ISA)."""
    return int(ggml_type) in _panel_types(mod, mod.isa())
