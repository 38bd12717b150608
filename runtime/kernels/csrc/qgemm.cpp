// Products of many tokens straight from ggml bytes (AVX-512F, 16 tokens a vector; AVX2, 8):
// Y[T, rows] = X[T, cols] . W^T, each weight dequantized once (into a panel that stays in the
// core's cache) and then used by every token, where the several-token kernels decode it
// again for each pass of 4-8 tokens and the wide path writes whole float chunks to memory for
// BLAS.
//
//  - a panel is QGEMM_PANEL rows of W over a block of columns, dequantized (16 weights a
//    conversion for Q4_K, Q5_K and Q6_K under AVX-512; avx2_dequant_rows or dequant_rows for the
//    others): the same floats as ggml's dequantize_row_* and gguf-py, so the result equals
//    F.linear(x, dequantize(W)) up to float summation order;
//  - the activations are transposed once per call into XT [cols][tp] (tp: T rounded up to a
//    multiple of the vector's lanes, zero-padded), so that one vector holds as many tokens'
//    activations at one k; a thread takes a run of panels and goes through the columns block
//    by block, so a block of XT is read from memory once per run and then from its L2 cache;
//  - the micro-kernel keeps MR rows x NV token vectors in registers (24 sums of the 32
//    AVX-512 registers, 12 of AVX2's 16) and, for each k, broadcasts each row's weight and
//    multiplies it into its NV token vectors: NV * MR fused multiply-adds for MR + NV loads,
//    the arithmetic bound of the core. Under AVX-512 the last 1-8 tokens take 8-token (AVX2)
//    vectors rather than a half-empty 16-token one; each token's sums are the same either way.
//    Where the CPU executes a 512-bit operation whole (a Zen 5, an Intel CPU: a 256-bit one
//    costs it as much), a tail of 17-32 tokens takes 12 rows x 2 vectors over XT's zero-padded
//    lanes: the same products as 32 tokens, where 24 rows x 1 vector and an 8-token pass cost
//    more than 32 tokens did (one broadcast a multiply-add, and a half-width pass); on a CPU
//    that splits it in two halves (a Zen 4: g_splits_512) the tail's 24 lanes keep the two
//    narrower passes.
#include "kern.h"

#include <string.h>
#include <unistd.h>

namespace efs {

int64_t qgemm_kb(int64_t cols, int64_t tp) {
    // this CPU's L2 cache (per core), 512 KiB where the system does not say
    static const int64_t l2 = [] {
        const long v = sysconf(_SC_LEVEL2_CACHE_SIZE);
        return v > 0 ? (int64_t)v : (int64_t)512 << 10;
    }();
    int64_t kb = l2 / 2 / (tp * (int64_t)sizeof(float)) / 256 * 256;
    kb = kb < 256 ? 256 : kb > QGEMM_KB_MAX ? QGEMM_KB_MAX : kb;
    return cols < kb ? cols : kb;
}

}  // namespace efs

#if defined(__x86_64__) || defined(__i386__)
#include "avx512_emulated.h"
#include "kern_avx2_util.h"

#define EFS_G __attribute__((target(EFS_T512_F)))
#define EFS_G2 __attribute__((target("avx2,fma,f16c")))
#define EFS_KT EFS_G
#include "kern_k_avx2.h"      // q45_scales, q45_planes, q6_planes: a block's fields

namespace efs {
namespace {

// 16 bytes as 16 floats, unsigned or signed.
EFS_G inline __m512 u8x16(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)); }
EFS_G inline __m512 i8x16(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)); }

// The panel decoders: one row of `cols` weights into y, each weight the float ggml's
// dequantize_row_* gives (kern_avx2.cpp's deq_q45_k / deq_q6_k, 16 weights a conversion).

// Q4_K / Q5_K: d1 * q - m1 (d1 = d * scale, m1 = dmin * min; a multiply, then a subtraction).
template <bool FIVE>
EFS_G void deq_q45_k_z(const uint8_t* b, int64_t cols, float* y) {
    const int BYTES = FIVE ? 176 : 144;
    for (int64_t i = 0; i < cols / 256; ++i, b += BYTES, y += 256) {
        alignas(32) float d1[8], m1[8];                  // d * scale, dmin * min
        _mm256_store_ps(m1, q45_scales(b, d1));
        const uint8_t* q = b + (FIVE ? 48 : 16);
        __m256i hb = FIVE ? loadu256(b + 16) : _mm256_setzero_si256();
        for (int j = 0; j < 4; ++j) {
            __m256i nib[2];
            q45_planes<FIVE>(loadu256(q + 32 * j), hb, nib[0], nib[1]);
            for (int h = 0; h < 2; ++h) {                 // sub-block 2j + h: 64j + 32h + l
                const __m512 d = _mm512_set1_ps(d1[2 * j + h]), m = _mm512_set1_ps(m1[2 * j + h]);
                float* o = y + 64 * j + 32 * h;
                _mm512_storeu_ps(o, _mm512_sub_ps(_mm512_mul_ps(d, u8x16(
                    _mm256_castsi256_si128(nib[h]))), m));
                _mm512_storeu_ps(o + 16, _mm512_sub_ps(_mm512_mul_ps(d, u8x16(
                    _mm256_extracti128_si256(nib[h], 1))), m));
            }
        }
    }
}

// Q6_K: (d * sc) * (q - 32).
EFS_G void deq_q6_k_z(const uint8_t* b, int64_t cols, float* y) {
    const __m256i k32 = _mm256_set1_epi8(32);
    for (int64_t i = 0; i < cols / 256; ++i, b += 210, y += 256) {
        const float d = f16(b + 208);
        const int8_t* sc = (const int8_t*)(b + 192);
        for (int h = 0; h < 2; ++h) {
            __m256i q[4];
            q6_planes(b, h, q);
            for (int k = 0; k < 4; ++k) {                 // elements 128h + 32k + l
                const __m256i v = _mm256_sub_epi8(q[k], k32);
                float* o = y + 128 * h + 32 * k;
                _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_set1_ps(d * (float)sc[8 * h + 2 * k]),
                                                  i8x16(_mm256_castsi256_si128(v))));
                _mm512_storeu_ps(o + 16, _mm512_mul_ps(
                    _mm512_set1_ps(d * (float)sc[8 * h + 2 * k + 1]),
                    i8x16(_mm256_extracti128_si256(v, 1))));
            }
        }
    }
}

// A run of whole blocks of one row (b: its first block; kn weights) into y: the AVX-512
// decoders, else the AVX2 unit's, else the portable ones.
EFS_G void deq_row(int type, const uint8_t* b, int64_t kn, float* y) {
    switch (type) {
        case T_Q4_K: deq_q45_k_z<false>(b, kn, y); return;
        case T_Q5_K: deq_q45_k_z<true>(b, kn, y); return;
        case T_Q6_K: deq_q6_k_z(b, kn, y); return;
        default:
            if (!avx2_dequant_rows(type, b, 0, 0, 1, kn, y)) dequant_rows(type, b, 0, 0, 1, kn, y);
    }
}

// The next panel's weight bytes, a cache line every 2^n columns of the products running now
// (`mask`: as many columns as spread the lines over the panel's first micro-kernel call; the
// later calls find none left): decoding a panel is the only part of the product that reads memory, and a panel of
// weights read afresh (each expert of a prompt is read once) waited on it there, while the
// products between two decodes read none. `rows` row segments of `seg` bytes, `rb` apart.
struct PanelPf {
    const char* at = nullptr;     // the next line
    const char* end = nullptr;    // the end of the current row's segment
    int64_t rb = 0, seg = 0, rows = 0;
    int64_t mask = -1;            // prefetch at the columns k with (k & mask) == 0 (-1: none)
    void set(const uint8_t* first, int64_t row_bytes, int64_t seg_bytes, int64_t n_rows,
             int64_t iters) {                    // iters: the columns of one call
        at = (const char*)first;
        end = at + seg_bytes;
        rb = row_bytes, seg = seg_bytes, rows = n_rows - 1;
        const int64_t lines = n_rows * ((seg_bytes + 63) / 64);
        int64_t every = lines > 0 ? iters / lines : 0;
        mask = 0;
        while (every >= 2) every >>= 1, mask = mask * 2 + 1;
    }
    inline void step(int64_t k) {
        if (mask < 0 || (k & mask) != 0) return;
        if (at >= end) {
            if (rows <= 0) return;
            at = end - seg + rb, end = at + seg, --rows;
        }
        _mm_prefetch(at, _MM_HINT_T0);
        at += 64;
    }
};

// MR rows x NV vectors of 16 tokens over the kn columns of a panel block: P: MR rows of the
// panel (stride ps), xt: XT at the block's first column and the group's first token (stride
// tp), c: the sums [MR][stride tp] at the group's first token, added to (from zero if first).
template <int MR, int NV>
EFS_G void micro(const float* P, int64_t ps, int64_t kn, const float* xt, int64_t tp, float* c,
                 bool first, PanelPf& pf) {
    __m512 acc[MR][NV];
#pragma GCC unroll 32
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v)
            acc[r][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * tp + 16 * v);
    for (int64_t k = 0; k < kn; ++k) {       // the sums stay in registers (loops unrolled)
        pf.step(k);
        __m512 x[NV];
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) x[v] = _mm512_loadu_ps(xt + k * tp + 16 * v);
#pragma GCC unroll 32
        for (int r = 0; r < MR; ++r) {
            const __m512 w = _mm512_set1_ps(P[r * ps + k]);
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(w, x[v], acc[r][v]);
        }
    }
#pragma GCC unroll 32
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) _mm512_storeu_ps(c + r * tp + 16 * v, acc[r][v]);
}

// The same in AVX2 (8 tokens a vector).
template <int MR, int NV>
EFS_G2 void micro8(const float* P, int64_t ps, int64_t kn, const float* xt, int64_t tp,
                   float* c, bool first, PanelPf& pf) {
    __m256 acc[MR][NV];
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v)
            acc[r][v] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + r * tp + 8 * v);
    for (int64_t k = 0; k < kn; ++k) {
        pf.step(k);
        __m256 x[NV];
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) x[v] = _mm256_loadu_ps(xt + k * tp + 8 * v);
#pragma GCC unroll 16
        for (int r = 0; r < MR; ++r) {
            const __m256 w = _mm256_broadcast_ss(P + r * ps + k);
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_fmadd_ps(w, x[v], acc[r][v]);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) _mm256_storeu_ps(c + r * tp + 8 * v, acc[r][v]);
}

// Rows [r0, r1) of W, columns [k0, k0 + kn), into the panel (stride ps; zeros for the rows
// past r1 up to QGEMM_PANEL): `deq` dequantizes one row's run of whole blocks.
template <class Deq>
void fill_panel(const Deq& deq, const TypeInfo* ti, const uint8_t* W, int64_t rb, int64_t r0,
                int64_t r1, int64_t k0, int64_t kn, float* panel, int64_t ps) {
    const int64_t off = k0 / ti->block * ti->bytes;
    for (int64_t r = r0; r < r1; ++r) deq(W + r * rb + off, kn, panel + (r - r0) * ps);
    for (int64_t r = r1 - r0; r < QGEMM_PANEL; ++r) memset(panel + r * ps, 0, kn * sizeof(float));
}

// Rows [r0, r1) into y: for each block of qgemm_kb(cols, tp) columns (whose activations stay in
// the L2 cache while every panel of the rows uses them), each panel dequantized for those
// columns and multiplied into the sums c [r1 - r0][tp], which go to y at the end, the next
// panel's bytes prefetched during the products (PanelPf). `mul(P, ps, kn, xt, c, first, pf)`
// runs one panel's token groups.
template <class Deq, class Mul>
void rows_by_blocks(const Deq& deq, const Mul& mul, int type, const uint8_t* W, int64_t rb,
                    int64_t r0, int64_t r1, int64_t cols, const float* xt, int64_t tp,
                    int64_t nt, float* panel, float* c, float* y, int64_t ys) {
    const TypeInfo* ti = type_info(type);
    const int64_t kb = qgemm_kb(cols, tp), ps = qgemm_panel_stride(kb);
    PanelPf pf;
    for (int64_t k0 = 0; k0 < cols; k0 += kb) {
        const int64_t kn = cols - k0 < kb ? cols - k0 : kb;
        for (int64_t p0 = r0; p0 < r1; p0 += QGEMM_PANEL) {
            const int64_t p1 = p0 + QGEMM_PANEL < r1 ? p0 + QGEMM_PANEL : r1;
            fill_panel(deq, ti, W, rb, p0, p1, k0, kn, panel, ps);
            // the next panel: the next rows of this block of columns, else the next block's first
            const int64_t q0 = p1 < r1 ? p1 : r0, c0 = p1 < r1 ? k0 : k0 + kb;
            const int64_t qn = c0 >= cols ? 0 : cols - c0 < kb ? cols - c0 : kb;
            const int64_t q1 = q0 + QGEMM_PANEL < r1 ? q0 + QGEMM_PANEL : r1;
            pf.mask = -1;
            if (qn > 0)
                pf.set(W + q0 * rb + c0 / ti->block * ti->bytes, rb, qn / ti->block * ti->bytes,
                       q1 - q0, kn);
            mul(panel, ps, kn, xt + k0 * tp, c + (p0 - r0) * tp, k0 == 0, pf);
        }
    }
    for (int64_t t = 0; t < nt; ++t)
        for (int64_t r = r0; r < r1; ++r) y[t * ys + r] = c[(r - r0) * tp + t];
}


}  // namespace

void avx512_qgemm_rows(int type, const uint8_t* W, int64_t rb, int64_t r0, int64_t r1,
                       int64_t cols, const float* xt, int64_t tp, int64_t nt, float* panel,
                       float* c, float* y, int64_t ys) {
    const auto deq = [type](const uint8_t* b, int64_t kn, float* o) { deq_row(type, b, kn, o); };
    const auto mul = [nt, tp](const float* P, int64_t ps, int64_t kn, const float* xb, float* cb,
                              bool first, PanelPf& pf) {
        int64_t t0 = 0;
        const int64_t pair_over = g_splits_512 ? 24 : 16;  // XT's lanes reach t0 + 32 past 16
        for (; t0 + pair_over < nt; t0 += 32)         // 12 rows x 2 vectors
            for (int64_t s = 0; s < QGEMM_PANEL; s += 12)
                micro<12, 2>(P + s * ps, ps, kn, xb + t0, tp, cb + s * tp + t0, first, pf);
        if (nt - t0 > 8) {                             // 9-16 left (split: 9-24): 24 x 1
            micro<24, 1>(P, ps, kn, xb + t0, tp, cb + t0, first, pf);
            t0 += 16;
        }
        if (t0 < nt)                     // up to 8 left: 8-token vectors, not half-empty ones
            for (int64_t s = 0; s < QGEMM_PANEL; s += 12)
                micro8<12, 1>(P + s * ps, ps, kn, xb + t0, tp, cb + s * tp + t0, first, pf);
    };
    rows_by_blocks(deq, mul, type, W, rb, r0, r1, cols, xt, tp, nt, panel, c, y, ys);
}

void avx2_qgemm_rows(int type, const uint8_t* W, int64_t rb, int64_t r0, int64_t r1,
                     int64_t cols, const float* xt, int64_t tp, int64_t nt, float* panel,
                     float* c, float* y, int64_t ys) {
    const auto deq = [type](const uint8_t* b, int64_t kn, float* o) {
        if (!avx2_dequant_rows(type, b, 0, 0, 1, kn, o)) dequant_rows(type, b, 0, 0, 1, kn, o);
    };
    const auto mul = [nt, tp](const float* P, int64_t ps, int64_t kn, const float* xb, float* cb,
                              bool first, PanelPf& pf) {
        int64_t t0 = 0;
        for (; t0 + 8 < nt; t0 += 16)                 // 16 tokens: 6 rows x 2 vectors
            for (int64_t s = 0; s < QGEMM_PANEL; s += 6)
                micro8<6, 2>(P + s * ps, ps, kn, xb + t0, tp, cb + s * tp + t0, first, pf);
        if (t0 < nt)                                   // up to 8 left: 12 rows x 1 vector
            for (int64_t s = 0; s < QGEMM_PANEL; s += 12)
                micro8<12, 1>(P + s * ps, ps, kn, xb + t0, tp, cb + s * tp + t0, first, pf);
    };
    rows_by_blocks(deq, mul, type, W, rb, r0, r1, cols, xt, tp, nt, panel, c, y, ys);
}

bool qgemm_compiled() { return true; }

}  // namespace efs

#else  // not x86

namespace efs {
void avx512_qgemm_rows(int, const uint8_t*, int64_t, int64_t, int64_t, int64_t, const float*,
                       int64_t, int64_t, float*, float*, float*, int64_t) {}
void avx2_qgemm_rows(int, const uint8_t*, int64_t, int64_t, int64_t, int64_t, const float*,
                     int64_t, int64_t, float*, float*, float*, int64_t) {}
bool qgemm_compiled() { return false; }
}  // namespace efs

#endif
