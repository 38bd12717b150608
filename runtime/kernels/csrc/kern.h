// expertfs native CPU kernels: matrix-vector products straight from ggml blocks.
//
// The interface between the torch binding (ops.cpp) and the kernel translation units
// (kern_scalar.cpp: portable C++; kern_avx2.cpp: AVX2+FMA+F16C, compiled for that target by a
// pragma and only called when the CPU has it). Everything here is plain C++: no torch, no
// standard-library templates, so the AVX2 unit cannot leak AVX2 code into shared inline symbols.
//
// A "row kernel" computes, for weight rows [r0, r1) of a (rows x cols) ggml matrix and nt
// activation vectors,  y[t*ys + r] = alpha * dot(W[r], x_t)  (+ y[t*ys + r] when accumulate).
//
// Two numerics:
//  - exact: float32 activations, float32 accumulation; equals F.linear(x, dequantize(W)) up to
//    float rounding (weights enter as scale * integer, factored per sub-block).
//  - q8: activations quantized the way llama.cpp does (Q8_K for K-quants and IQ4_XS, Q8_0 for
//    Q4_0/Q5_0/Q8_0/MXFP4, Q8_1 for Q4_1/Q5_1, fp16 / bf16 rounding for F16 / BF16) and integer
//    dot products per block: llama.cpp's own numerics.
#pragma once

#include <stdint.h>
#include <stddef.h>

namespace efs {

// ggml type ids (ggml.h enum ggml_type)
enum : int {
    T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
    T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_IQ2_XXS = 16,
    T_IQ2_XS = 17, T_IQ3_XXS = 18, T_IQ1_S = 19, T_IQ4_NL = 20, T_IQ3_S = 21, T_IQ2_S = 22,
    T_IQ4_XS = 23, T_IQ1_M = 29, T_BF16 = 30, T_TQ1_0 = 34, T_TQ2_0 = 35, T_MXFP4 = 39,
};

// Activation formats a kernel consumes.
enum XFmt : int {
    X_EXACT = 0,   // float32: natural order, 32-chunk permuted order, sums per 16 elements
    X_Q8K = 1,     // llama.cpp block_q8_K layout (d:f32, qs:i8[256], bsums:i16[16])
    X_Q8_0 = 2,    // QX8 blocks of 32 (d rounded through fp16)
    X_Q8_1 = 3,    // QX8 blocks of 32 with s = d * sum(qs), rounded through fp16
    X_F16R = 4,    // float32 rounded through fp16 (natural order)
    X_BF16R = 5,   // float32 rounded through bf16 (natural order)
};

struct Q8K {           // 292 bytes, as ggml's block_q8_K
    float d;
    int8_t qs[256];
    int16_t bsums[16];
};

struct QX8 {           // 40 bytes: ggml's block_q8_0 / block_q8_1 with the fp16 fields widened
    float d;           // fp16-rounded scale
    float s;           // fp16-rounded d * sum(qs) (Q8_1 only)
    int8_t qs[32];
};

// One prepared activation vector.
struct XPrep {
    const float* x;    // natural order (exact mode; F16R/BF16R rounded copies in q8 mode)
    const float* xp;   // exact: each 32-chunk permuted to the AVX2 unpack order (see kern_avx2)
    const float* s16;  // exact: sums of x over each 16 elements (cols / 16)
    const float* s32;  // exact: sums of x over each 32 elements (cols / 32)
    const float* xz;   // exact, AVX-512 table-lookup kernels: each 128-chunk permuted (perm128)
    const float* xh;   // exact, AVX-512 one-row kernels: xp's 32-halves interleaved (perm_h64)
    const float* xq;   // exact, AVX-512 Q2_K/Q3_K lookup: each 256-chunk permuted (perm_q2)
    const float* xi;   // exact, AVX-512 IQ4_XS lookup: each 128-chunk permuted (perm_iq4)
    const float* xg;   // exact, AVX-512 IQ2_XXS / IQ3 one-row kernels: each 32 (perm_g32)
    const void* q;     // q8 mode: Q8K or QX8 blocks
};

typedef void (*RowsFn)(const uint8_t* W, int64_t row_bytes, int64_t r0, int64_t r1,
                       int64_t cols, const XPrep* xs, int nt, float* y, int64_t ys,
                       float alpha, int accumulate);

struct TypeInfo {
    int type;
    int block;         // elements per block
    int bytes;         // bytes per block
};

// Block geometry of a supported type (nullptr when not supported).
const TypeInfo* type_info(int type);

// Which activation format the q8 mode uses for a weight type.
int q8_format(int type);

// Kernel tables. `mode`: 0 exact, 1 q8. nullptr when the type/mode is not implemented.
RowsFn scalar_rows(int type, int mode);
// Rows [r0, r1) of W (row_bytes each, `cols` weights) as float32 into y (r1 - r0 rows of
// `cols`), each block as ggml's dequantize_row_* gives it (the exact kernels' weights).
void dequant_rows(int type, const uint8_t* W, int64_t row_bytes, int64_t r0, int64_t r1,
                  int64_t cols, float* y);
RowsFn avx2_rows(int type, int mode);
bool avx2_compiled();
// dequant_rows in AVX2 for the types it has (Q4_K, Q5_K, Q6_K, the lattice IQ and TQ types;
// the same floats); false for the others.
bool avx2_dequant_rows(int type, const uint8_t* W, int64_t row_bytes, int64_t r0, int64_t r1,
                       int64_t cols, float* y);
RowsFn avx512_rows(int type, int mode);   // only the types that have an AVX-512 kernel
// The K-quants' AVX-512 (F, VL, BW) kernels (kern_k_avx512.cpp): exact Q2_K, Q3_K, Q5_K, Q6_K
// and IQ4_NL (two rows per vector, passes of 8 tokens) and q8 Q2_K ... Q6_K (passes of 8
// tokens; Q4_K, Q5_K and Q6_K two rows per vector), the AVX2 kernels' results bit for bit;
// nullptr for the rest (and without AVX-512BW).
RowsFn avx512_k_rows(int type, int mode);
extern bool g_gfni_on;                    // ops.cpp: exact Q6_K by GFNI (set_gfni)
extern bool g_splits_512;                 // ops.cpp: 512-bit operations in two halves (set_cpu)
bool avx512_compiled();

// Products of many tokens (qgemm.cpp; AVX-512F or AVX2): y[t * ys + r] = dot(W[r], x_t) for
// rows [r0, r1) and the nt tokens, whose activations come transposed: xt[k * tp + t] (tp a
// multiple of the ISA's lanes, QGEMM_LANES_AVX512 or QGEMM_LANES_AVX2; zeros past nt). Each
// QGEMM_PANEL rows x qgemm_kb(cols, tp) columns dequantized into `panel` (QGEMM_PANEL rows of
// qgemm_panel_stride(qgemm_kb(cols, tp)) floats of scratch; the floats dequant_rows gives), then
// multiplied by every token into `c` ((r1 - r0) x tp floats of scratch).
constexpr int64_t QGEMM_PANEL = 24, QGEMM_KB_MAX = 4096;
// Columns per block for tp (padded) tokens: whole rows up to QGEMM_KB_MAX (measured faster
// than blocks of 256 or 512 on the expert and trunk shapes of 768-4096 columns at 16-64
// tokens), and no more than keeps the block's activations (columns x tp floats, read once per
// panel) in half the L2 cache, the panel and the sums taking the rest: a prompt's 128 tokens
// over 4096 columns are 2 MiB, which would come from the L3 cache for every panel
// (bench/README.md). A whole number of 256-weight blocks. The sums are kept in memory between
// blocks and each goes on in column order, so the block size does not change a result's bits.
int64_t qgemm_kb(int64_t cols, int64_t tp);
constexpr int64_t QGEMM_LANES_AVX512 = 16, QGEMM_LANES_AVX2 = 8;
// A panel row's stride: its columns and one cache line, so that the rows do not all fall into
// one set of the L1 cache (rows a power of two apart in bytes would evict one another).
inline int64_t qgemm_panel_stride(int64_t kb) { return kb + 16; }
void avx512_qgemm_rows(int type, const uint8_t* W, int64_t row_bytes, int64_t r0, int64_t r1,
                       int64_t cols, const float* xt, int64_t tp, int64_t nt, float* panel,
                       float* c, float* y, int64_t ys);
void avx2_qgemm_rows(int type, const uint8_t* W, int64_t row_bytes, int64_t r0, int64_t r1,
                     int64_t cols, const float* xt, int64_t tp, int64_t nt, float* panel,
                     float* c, float* y, int64_t ys);
bool qgemm_compiled();

// q8 mode's products of many tokens (qgemm_q8.cpp; AVX-512 VNNI): y[t * ys + r] = the q8
// product of W[r] and token t for rows [r0, r1) (c: scratch of 32 * nt floats): the q8 row
// kernels' integer sums and float steps per block. x: the nt tokens' activations in the type's
// q8 format (q8_format), token-major: Q8K blocks of 256 (cols a multiple of 256), or QX8 blocks
// of 32 with xsum, each block's sum of its 32 bytes (cols a multiple of 32).
typedef void (*QgemmQ8Fn)(const uint8_t* W, int64_t row_bytes, int64_t r0, int64_t r1,
                          const void* x, const int32_t* xsum, int64_t nt, int64_t cols,
                          float* c, float* y, int64_t ys);
// The function for `type` (Q2_K ... Q6_K, IQ4_XS, the lattice IQ types, TQ1_0, TQ2_0; Q8_0,
// Q4_0, IQ4_NL, MXFP4), nullptr for the others and where not compiled; the caller checks
// that the CPU has AVX512-VNNI.
QgemmQ8Fn avx512_qgemm_q8(int type);
// The same in AVX2 with AVX-VNNI (256-bit vpdpbusd; Intel's cores since Alder Lake), the same
// bits; the caller checks that the CPU has AVX-VNNI. nullptr where the compiler predates the
// avxvnni target (GCC 11, clang 12): EFS_AVXVNNI_TARGET says whether it has it.
QgemmQ8Fn avxvnni_qgemm_q8(int type);
#if (defined(__clang__) && __clang_major__ >= 12) || \
    (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define EFS_AVXVNNI_TARGET 1
#else
#define EFS_AVXVNNI_TARGET 0
#endif

// Exact mode's products of many tokens on AMX (qgemm_amx.cpp; AMX-BF16 and AVX512-BF16):
// y[t * ys + r] = dot(W[r], x_t) for rows [r0, r1), cols as amx_qgemm takes them, up to float32
// rounding (bf16 parts that sum to the weights and the activations exactly). xb, xs: the nt
// tokens prepared by amx_prepare, a tile of 16 tokens a call (xb: 3 * tp * cols / 2 words, xs:
// cols / 16 * tp floats, the sums of x's groups of 16, tp = nt rounded up to 16).
typedef void (*QgemmAmxFn)(const uint8_t* W, int64_t row_bytes, int64_t r0, int64_t r1,
                           const uint32_t* xb, const float* xs, int64_t nt, int64_t cols,
                           float* y, int64_t ys);
// The function for `type` in rows of `cols` weights (the Q8_K types: Q2_K ... Q6_K, IQ4_XS,
// the lattice IQ types, TQ1_0, TQ2_0, cols a multiple of 256; the blocks of 32, Q8_0, Q4_0,
// Q5_0, Q4_1, Q5_1, IQ4_NL, MXFP4, a multiple of 32), nullptr for the others and where not
// compiled; the caller checks amx_enable().
QgemmAmxFn amx_qgemm(int type, int64_t cols);
// Token tile j (tokens 16 j ...) of amx_prepare's xb and xs.
void amx_prepare(const float* x, int64_t nt, int64_t cols, int64_t j, uint32_t* xb, float* xs);
// Whether this CPU has AMX-BF16 and AVX512-BF16 and the OS grants this process the tile state
// (asked once: Linux's ARCH_REQ_XCOMP_PERM).
bool amx_enable();
#if (defined(__clang__) && __clang_major__ >= 12) || \
    (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define EFS_AMX_TARGET 1
#else
#define EFS_AMX_TARGET 0
#endif

// Activation preparation (scalar; the AVX2 unit provides faster versions of the same).
void perm32(const float* x, float* xp, int64_t n);        // the AVX2 unpack order
void perm128(const float* x, float* xz, int64_t n);       // the AVX-512 Q4_K lookup order
void perm_h64(const float* xp, float* xh, int64_t n);     // the AVX-512 one-row order, from xp
void perm_q2(const float* x, float* xq, int64_t n);       // the AVX-512 Q2_K/Q3_K lookup order
void perm_iq4(const float* x, float* xi, int64_t n);      // the AVX-512 IQ4_XS lookup order
void perm_g32(const float* x, float* xg, int64_t n);      // the AVX-512 lattice IQ one-row order
// Which of the AVX-512 exact layouts a type's kernel reads: X_XZ (Q4_K's table lookup),
// X_XH (Q5_K's and Q6_K's one-row kernels), X_XQ (Q2_K's and Q3_K's table lookup), X_XI
// (IQ4_XS's), X_XG (IQ2_XXS's, IQ3_XXS's and IQ3_S's one-row kernels); the others read only
// x / xp / s16 / s32.
enum { X_XZ = 1, X_XH = 2, X_XQ = 4, X_XI = 8, X_XG = 16 };
// X_XG is prepared for batches of at least this many tokens (its kernels' passes from it)
constexpr int XG_FROM_TOKENS = 4;
int exact_layouts(int type);
void sums16(const float* x, float* s16, float* s32, int64_t n);
void quantize_q8k(const float* x, Q8K* y, int64_t n);      // llama.cpp quantize_row_q8_K_ref
void quantize_qx8(const float* x, QX8* y, int64_t n, int with_sum);  // llama.cpp x86 q8_0/q8_1
void round_f16(const float* x, float* y, int64_t n);
void round_bf16(const float* x, float* y, int64_t n);
void avx2_quantize_q8k(const float* x, Q8K* y, int64_t n);
void avx2_quantize_qx8(const float* x, QX8* y, int64_t n, int with_sum);

// One token's attention (small_ops.cpp attn_decode): query heads [h0, h1) of q [H, D] against
// their KV head's first S cache rows (kc [K, cap, D], vc [K, cap, Dv]; query head h reads KV
// head h / (H / K)): o[h] = softmax(q[h] . k * scale) v, into o [H, Dv]; p: S floats of scratch.
struct AttnArgs {
    const float *q, *kc, *vc;
    float* o;
    int64_t H, K, D, Dv, cap, S;
    float scale;
};
void avx2_attn_heads(const AttnArgs& a, int64_t h0, int64_t h1, float* p);

// g[i] = silu(g[i]) * u[i] = g / (1 + exp(-g)) * u; limit > 0: llama.cpp's swiglu_clamp,
// silu(min(g, limit)) * clamp(u, -limit, limit). alpha > 0: gpt-oss's swiglu_oai on the same
// clamped g, u: g / (1 + exp(-alpha g)) * (u + 1).
void silu_mul(float* g, const float* u, int64_t n, float limit = 0.f, float alpha = 0.f);
void avx2_silu_mul(float* g, const float* u, int64_t n, float limit = 0.f, float alpha = 0.f);
// g[i] = silu(g[i]) = g / (1 + exp(-g)); avx2_sigmoid: 1 / (1 + exp(-g)) (exp to about 1
// ulp under AVX2).
void avx2_silu(float* g, int64_t n);
void avx2_sigmoid(float* g, int64_t n);

// The lattice IQ types' codebooks (ggml-common.h's iq2xxs_grid ... iq1s_grid, ksigns_iq2xs),
// handed over from gguf-py at load (set_iq_tables, kern_iq.cpp), never copied by hand. Grid
// entries are packed as ggml packs them: byte j of an entry is its element j (IQ1: int8
// -1/0/1). ksigns_mask: byte j of entry k is 0xFF where bit j of ksigns[k] is set, else 0x01
// (a sign vector for _mm256_sign_epi8), derived from ksigns. `ok` once every table is set.
// The f_* tables are the small grids (IQ2_XXS, IQ2_XS, IQ3_XXS, IQ3_S) as float32, one entry
// of 8 (IQ3: 4) floats per index, and f_ksigns / f_bits the sign bits of ksigns[k] / of the
// byte k as float sign masks (0x80000000 where set): the exact kernels load those weights as
// floats, no conversion (IQ2_S's decoder keeps its int8 grid: in the L1 cache; its float form,
// f_iq2s, is the AVX-512 two-row kernels' table, as f_iq1). f_iq1 is IQ1_S's
// and IQ1_M's grid as the exact kernels' weights 8 g + delta: entry (neg << 11 | index), 8
// floats of 8 g - 1 where neg, else 8 g + 1 (128 KiB, in the L2 cache: a load an 8 weights
// where the int8 grid took a widening, a conversion and a multiply-add, measured faster).
struct IqTables {
    alignas(64) float f_iq1[2 * 2048 * 8];
    uint64_t i_iq1[2 * 2048];            // the same as int8 (q8 mode's integer weights)
    alignas(32) float f_iq2xxs[256 * 8];
    alignas(32) float f_iq2xs[512 * 8];
    alignas(32) float f_iq2s[1024 * 8];
    alignas(32) float f_iq3xxs[256 * 4];
    alignas(32) float f_iq3s[512 * 4];
    alignas(32) uint32_t f_ksigns[128 * 8];
    alignas(32) uint32_t f_bits[256 * 8];
    uint64_t iq2xxs[256];
    uint64_t iq2xs[512];
    uint64_t iq2s[1024];
    uint32_t iq3xxs[256];
    uint32_t iq3s[512];
    uint64_t iq1s[2048];
    uint8_t ksigns[128];
    uint64_t ksigns_mask[128];
    int8_t kvalues_iq4nl[16];
    bool ok;
};
extern IqTables g_iq;

// Stores one table by name (iq2xxs, iq2xs, iq2s, iq3xxs, iq3s, iq1s: grid entries of 8 or 4
// bytes; ksigns: 128 bytes; kvalues_iq4nl: 16 int8, checked against the built-in levels).
// Returns nullptr, or what is wrong.
const char* set_iq_table(const char* name, const uint8_t* data, int64_t nbytes);
bool is_iq_grid(int type);                // needs g_iq
bool is_iq_family(int type);              // the lattice types and TQ1_0 / TQ2_0 (kern_iq.cpp)

// The lattice IQ types and the ternary TQ1_0 / TQ2_0 in the portable unit (kern_iq.cpp): a
// block's floats as ggml's
// dequantize_row_* computes them, and the q8 dot product of a row with Q8_K activations.
void deq_block_iq(int type, const uint8_t* b, float* y);
float vdot_q8_iq(int type, const uint8_t* row, int64_t cols, const Q8K* y);

// The lattice IQ types' and TQ1_0 / TQ2_0's AVX2 kernels (kern_iq_avx2.cpp); nullptr when not
// implemented.
RowsFn avx2_iq_rows(int type, int mode);
// Their rows as float32 in AVX2, dequant_rows's floats bit for bit (false for other types).
bool avx2_iq_dequant_rows(int type, const uint8_t* W, int64_t row_bytes, int64_t r0, int64_t r1,
                          int64_t cols, float* y);
// Their and IQ4_NL's AVX-512 (F, VL, BW) kernels (kern_iq_avx512.cpp), bit for bit the AVX2
// ones' results (which they call for the token counts where those are as fast); nullptr where
// a type and mode keep the AVX2 kernel.
RowsFn avx512_iq_rows(int type, int mode);

// Scalar helpers shared by the units.
float fp16_to_fp32(uint16_t h);
uint16_t fp32_to_fp16(float f);          // round to nearest even, as F16C / ggml
float bf16_round(float f);               // round to nearest even, as ggml_compute_fp32_to_bf16
float e8m0_half(uint8_t e);              // ggml_e8m0_to_fp32_half: 2^(e-128)

}  // namespace efs
