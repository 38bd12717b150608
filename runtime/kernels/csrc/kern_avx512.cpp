// AVX-512 (F, VL) kernels, used on CPUs that have it (ops.cpp checks), for the types where they
// beat the AVX2 unit; every other type keeps its AVX2 kernel. Same rules as kern_avx2.cpp:
// target attributes on every function, only <immintrin.h>, C headers and the AVX2 unit's
// shared headers (whose inline helpers it calls, under this unit's wider target).
//
// Exact Q4_K, IQ4_XS, Q2_K and Q3_K (and the blocks of 32: Q4_0, IQ4_NL, MXFP4, below) by
// table lookup: vpermps takes its 16-entry index from the low 4 bits of each dword and ignores
// the rest, so shifting the 64 bytes of packed nibbles right by 4k (k = 0..7) and looking each
// dword up in the table {0.0, 1.0, ..., 15.0} (IQ4_XS: its kvalues) yields 8 vectors of 16
// exact float weights, with no mask and no int->float conversion (about 30% fewer operations
// per weight than the unpack of kern_avx2.cpp); the 2- and 3-bit types the same way, 2 bits
// at a time. The activations are permuted to match (perm128, perm_iq4, perm_q2). Their sums
// run in another order than the AVX2 kernels', so their last bits differ from the AVX2 unit's;
// per token they do not depend on the batch.
#include "kern.h"

#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include "avx512_emulated.h"
#include "kern_avx2_util.h"

#define EFS_Z __attribute__((target(EFS_T512_FVL)))
#define EFS_ZI __attribute__((target(EFS_T512_FVL), always_inline)) inline
#define EFS_KT EFS_Z
#include "kern_k_avx2.h"
#include "kern_q45_z.h"       // q45_scales_z: a Q4_K block's scales and mins, as the AVX2 kernels

namespace efs {
namespace {

enum { F_NIB, F_Q23, F_B32 };   // a table-lookup type's family of kernels (Z::FAMILY)

// A pass of nt tokens' float32 activations past 32 KiB, a common L1 data cache: where two
// rows' weights and sums overflow the registers (past two tokens for Q4_K and IQ4_XS, at any
// count for Q3_K), taking rows in pairs costs less than re-reading the activations from L2 for
// every row, but more than from L1.
EFS_ZI bool x_past_l1d(int nt, int64_t cols) { return !x_in_l1(nt, cols, 2); }

EFS_ZI float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

EFS_ZI float f16_z(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

EFS_ZI float hsum512(__m512 a) {
    return hsum256(_mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(
        _mm512_extractf64x4_pd(_mm512_castps_pd(a), 1))));
}

EFS_ZI void put_z(float* o, float v, float alpha, int accumulate) {
    *o = accumulate ? *o + alpha * v : alpha * v;
}

// The 4-bit super-block types by table lookup: 64 bytes of packed nibbles are one load of 16
// dwords, and nibble k of every dword (k = 0..7: the dwords shifted right by 4k) looked up in a
// table of 16 floats gives 16 exact weights a vector. Rows two at a time where a pass of one or
// two tokens has more than 16 KiB of activations (they would be re-read from L2 for every row),
// or a pass of more tokens past x_past_l1d, one otherwise (pairs).
//
// Q4_K: d, dmin, scales[12], qs[128]. 64 bytes of qs = chunks j, j+1 (32 bytes each, low
// nibbles sub-block 2j, high 2j+1). Dword l of the load, nibble k: lanes 0..7 are chunk j,
// 8..15 chunk j+1, so for even k the lanes hold sub-blocks (2j, 2j+2), for odd k (2j+1, 2j+3);
// the table {0, ..., 15}, the mins from the sums of 32 activations (s32).
struct ZQ4K {
    static constexpr int BYTES = 144, QS = 16;
    static constexpr int FAMILY = F_NIB, PER = 4;
    static constexpr bool MIN = true;
    EFS_ZI static __m512 tbl() {
        return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    }
    EFS_ZI static const float* x(const XPrep& p) { return p.xz; }
    EFS_ZI static const float* sums(const XPrep& p) { return p.s32; }
    EFS_ZI static bool pairs(int nt, int64_t cols) {
        return nt <= 2 ? !x_in_l1(nt, cols, 4) : x_past_l1d(nt, cols);
    }
    EFS_ZI static __m512 scales(const uint8_t* b) { return q45_scales_z(b); }
    EFS_ZI static __m512 even(__m512 sv, int h) { return q45_pair(sv, 4 * h, 4 * h + 2); }
    EFS_ZI static __m512 odd(__m512 sv, int h) { return q45_pair(sv, 4 * h + 1, 4 * h + 3); }
};

// IQ4_XS: d, scales_h:u16, scales_l[4], qs[128]; group g of 32 (16 bytes: low nibbles its
// elements 0..15, high 16..31) scaled by d (ls - 32), ls 6 bits (iq4xs_ls). Dword l of a load
// lies in group l / 4 for every k, so all 8 vectors take one scale vector; the table is
// kvalues_iq4nl as floats. Passes and pairs as Q4_K's.
struct ZIQ4XS : ZQ4K {
    static constexpr int BYTES = 136, QS = 8;
    static constexpr bool MIN = false;
    EFS_ZI static __m512 tbl() {
        return _mm512_setr_ps(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69,
                              89, 113);
    }
    EFS_ZI static const float* x(const XPrep& p) { return p.xi; }
    // The block's 8 group scales d (ls - 32) in lanes 0..7.
    EFS_ZI static __m512 scales(const uint8_t* b) {
        uint16_t sh;
        uint32_t sl;
        memcpy(&sh, b + 2, 2);
        memcpy(&sl, b + 4, 4);
        const __m256i lo = _mm256_and_si256(
            _mm256_srlv_epi32(_mm256_set1_epi32((int)sl),
                              _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
            _mm256_set1_epi32(15));
        const __m256i hi = _mm256_and_si256(
            _mm256_srlv_epi32(_mm256_set1_epi32((int)sh << 4),
                              _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
            _mm256_set1_epi32(0x30));
        const __m256i ls = _mm256_sub_epi32(_mm256_or_si256(lo, hi), _mm256_set1_epi32(32));
        return _mm512_castps256_ps512(
            _mm256_mul_ps(_mm256_set1_ps(f16_z(b)), _mm256_cvtepi32_ps(ls)));
    }
    EFS_ZI static __m512 even(__m512 sv, int h) {
        const int g = 4 * h;
        return _mm512_permutexvar_ps(_mm512_setr_epi32(g, g, g, g, g + 1, g + 1, g + 1, g + 1,
                                                       g + 2, g + 2, g + 2, g + 2, g + 3, g + 3,
                                                       g + 3, g + 3),
                                     sv);
    }
    EFS_ZI static __m512 odd(__m512 sv, int h) { return even(sv, h); }
};

// R rows at a time (1 or 2), each with its own sums in the same order (the same bits), the
// activation vectors loaded once for all of them.
template <int NT, int R, class Z>
EFS_ZI int64_t nib_rows_z(const uint8_t* W, int64_t rb, int64_t r, int64_t r1, int64_t nb,
                          const float* const* xz, const float* const* s32, float* y,
                          int64_t ys, float alpha, int accumulate) {
    const __m512 tbl = Z::tbl();
    RowCursor<R> rc(W, rb, r);
    const uint8_t* const* b = rc.b;
    for (; r + R <= r1; r += R) {
        rc.at(W, rb, r);
        __m512 acc[R][NT];
        __m256 am[R][NT];
        for (int j = 0; j < R; ++j)
            for (int t = 0; t < NT; ++t) {
                acc[j][t] = _mm512_setzero_ps();
                am[j][t] = _mm256_setzero_ps();
            }
        for (int64_t i = 0; i < nb; ++i) {
            rc.prefetch(Z::BYTES);
            __m512 sv[R];
            for (int j = 0; j < R; ++j) {
                sv[j] = Z::scales(b[j]);
                if constexpr (Z::MIN) {
                    const __m256 mn = _mm512_castps512_ps256(sv[j]);
                    for (int t = 0; t < NT; ++t)
                        am[j][t] = _mm256_fmadd_ps(mn, _mm256_loadu_ps(s32[t] + 8 * i), am[j][t]);
                }
            }
            for (int h = 0; h < 2; ++h) {
                __m512 w[R][8], se[R], so[R];
                for (int j = 0; j < R; ++j) {
                    const __m512i v = _mm512_loadu_si512((const void*)(b[j] + Z::QS + 64 * h));
                    w[j][0] = _mm512_permutexvar_ps(v, tbl);
                    for (int k = 1; k < 8; ++k)
                        w[j][k] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4 * k), tbl);
                    se[j] = Z::even(sv[j], h);
                    so[j] = Z::odd(sv[j], h);
                }
                for (int t = 0; t < NT; ++t) {
                    const float* x = xz[t] + 256 * i + 128 * h;
                    __m512 xv[8];
                    for (int k = 0; k < 8; ++k) xv[k] = _mm512_loadu_ps(x + 16 * k);
                    for (int j = 0; j < R; ++j) {
                        __m512 a0 = _mm512_mul_ps(w[j][0], xv[0]);
                        __m512 a1 = _mm512_mul_ps(w[j][1], xv[1]);
                        a0 = _mm512_fmadd_ps(w[j][2], xv[2], a0);
                        a1 = _mm512_fmadd_ps(w[j][3], xv[3], a1);
                        a0 = _mm512_fmadd_ps(w[j][4], xv[4], a0);
                        a1 = _mm512_fmadd_ps(w[j][5], xv[5], a1);
                        a0 = _mm512_fmadd_ps(w[j][6], xv[6], a0);
                        a1 = _mm512_fmadd_ps(w[j][7], xv[7], a1);
                        acc[j][t] = _mm512_fmadd_ps(a0, se[j], acc[j][t]);
                        acc[j][t] = _mm512_fmadd_ps(a1, so[j], acc[j][t]);
                    }
                }
            }
            rc.step(Z::BYTES);
        }
        for (int j = 0; j < R; ++j)
            for (int t = 0; t < NT; ++t)
                put_z(y + (int64_t)t * ys + r + j,
                      Z::MIN ? hsum512(acc[j][t]) - hsum256(am[j][t]) : hsum512(acc[j][t]),
                      alpha, accumulate);
    }
    return r;
}



// Q2_K (scales[16]: low nibble scale, high nibble min of each 16 weights; qs[64]; d, dmin)
// and Q3_K (hmask[32]; qs[64]; scales[12], 6-bit less 32; d) by table lookup. The 64 bytes of
// qs are one load of 16 dwords; value k (0..15) of dword l is bits 2k, 2k + 1: byte
// 4l + k / 4 of qs at shift 2 (k % 4), the weight 128 (l / 8) + 32 (k % 4) + 4 (l % 8) + k / 4
// of sub-block 8 (l / 8) + 2 (k % 4) + (l % 8 >= 4). vpermps reads bits 0..3 of each dword:
// Q2_K shifts the dwords right by 2k and looks up {0, 1, 2, 3} x 4 (the next value's bits only
// repeat the table), 2 operations per 16 weights where the two-row unpack takes 4; Q3_K first
// puts each of a group's 4 bytes' high bit (hmask bit 4 (l / 8) + k % 4 of byte 4 (l % 8) +
// k / 4) beside its two low bits (a shift of qs, one of the hmask and a bitwise select), then
// shifts by bytes and looks up {-4, ..., 3} x 2: 2.5 operations per 16 weights, not 5. The four
// vectors of one k % 4 share their sub-blocks' scales (lanes 0..3, 4..7, 8..11, 12..15:
// sub-blocks 2j, 2j + 1, 8 + 2j, 9 + 2j), so each group of four is summed and scaled once;
// Q2_K's mins come from the sums of 16 activations (s16), as in the AVX2 kernel, taken from the
// same sums. The activations in the matching order (perm_q2). Sums in another order than the
// AVX2 kernels', so the last bits differ from them; per token the same on any batch.
struct ZQ2 {
    static constexpr int BYTES = 84;
    static constexpr int FAMILY = F_Q23, PER = 4;
    EFS_ZI static const float* x(const XPrep& p) { return p.xq; }
    EFS_ZI static const float* sums(const XPrep& p) { return p.s16; }
    // two rows at a time from three tokens, or where one or two have more than 16 KiB of
    // activations: each activation vector loaded once for both rows (passes of up to 4
    // tokens: 8 tokens' sums for two rows would spill)
    EFS_ZI static bool pairs(int nt, int64_t cols) { return nt >= 3 || !x_in_l1(nt, cols, 4); }
    EFS_ZI static __m512 tbl() {
        return _mm512_setr_ps(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
    }
    // The block's 16 sub-block scales, its qs, and the mins' term taken from each token's sum.
    template <int NT>
    EFS_ZI static void begin(const uint8_t* b, const float* const* s16, int64_t i, __m512& S,
                             __m512i& q, __m512i&, __m512* acc) {
        const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)b));
        S = _mm512_mul_ps(_mm512_set1_ps(f16_z(b + 80)),
                          _mm512_cvtepi32_ps(_mm512_and_si512(c, _mm512_set1_epi32(15))));
        const __m512 M = _mm512_mul_ps(_mm512_set1_ps(f16_z(b + 82)),
                                       _mm512_cvtepi32_ps(_mm512_srli_epi32(c, 4)));
        for (int t = 0; t < NT; ++t)
            acc[t] = _mm512_fnmadd_ps(M, _mm512_loadu_ps(s16[t] + 16 * i), acc[t]);
        q = _mm512_loadu_si512((const void*)(b + 16));
    }
    EFS_ZI static __m512i group(__m512i q, __m512i, int) { return q; }
    EFS_ZI static __m512i at(__m512i q, int g, int m) {
        return _mm512_srli_epi32(q, 2 * g + 8 * m);
    }
};

struct ZQ3 : ZQ2 {                  // its activations in ZQ2's order
    static constexpr int BYTES = 110, PER = 8;
    // passes of up to 8 tokens; two rows at a time only past x_past_l1d (two rows' decode
    // state spills at any token count)
    EFS_ZI static bool pairs(int nt, int64_t cols) { return x_past_l1d(nt, cols); }
    EFS_ZI static __m512 tbl() {
        return _mm512_setr_ps(-4, -3, -2, -1, 0, 1, 2, 3, -4, -3, -2, -1, 0, 1, 2, 3);
    }
    // The scales, qs, and the hmask with its second 128 weights' bits (4..7) shifted to 0..3.
    template <int NT>
    EFS_ZI static void begin(const uint8_t* b, const float* const*, int64_t, __m512& S,
                             __m512i& q, __m512i& h, __m512*) {
        const __m128i sc = q3k_scales_v(b + 96);
        S = _mm512_mul_ps(_mm512_set1_ps(f16_z(b + 108)),
                          _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(sc),
                                                              _mm512_set1_epi32(32))));
        q = _mm512_loadu_si512((const void*)(b + 32));
        const __m256i hm = _mm256_loadu_si256((const __m256i*)b);
        h = _mm512_inserti64x4(_mm512_castsi256_si512(hm), _mm256_srli_epi32(hm, 4), 1);
    }
    // Bits 0, 1 of each byte the value's low bits (qs >> 2g), bit 2 its high bit (hmask bit g).
    EFS_ZI static __m512i group(__m512i q, __m512i h, int g) {
        const __m512i hs = g >= 2 ? _mm512_srli_epi32(h, g - 2) : _mm512_slli_epi32(h, 2 - g);
        return _mm512_ternarylogic_epi32(_mm512_srli_epi32(q, 2 * g), hs,
                                         _mm512_set1_epi32(0x03030303), 0xE4);   // c ? a : b
    }
    EFS_ZI static __m512i at(__m512i v, int, int m) { return _mm512_srli_epi32(v, 8 * m); }
};

template <int NT, int R, class Z>
EFS_ZI int64_t q23_rows_z(const uint8_t* W, int64_t rb, int64_t r, int64_t r1, int64_t nb,
                          const float* const* xq, const float* const* s16, float* y,
                          int64_t ys, float alpha, int accumulate) {
    const __m512 tbl = Z::tbl();
    RowCursor<R> rc(W, rb, r);
    const uint8_t* const* b = rc.b;
    for (; r + R <= r1; r += R) {
        rc.at(W, rb, r);
        __m512 acc[R][NT];
        for (int j = 0; j < R; ++j)
            for (int t = 0; t < NT; ++t) acc[j][t] = _mm512_setzero_ps();
        for (int64_t i = 0; i < nb; ++i) {
            rc.prefetch(Z::BYTES);
            __m512 S[R];
            __m512i q[R], h[R];
            for (int j = 0; j < R; ++j)
                Z::template begin<NT>(b[j], s16, i, S[j], q[j], h[j], acc[j]);
            for (int g = 0; g < 4; ++g) {                 // g = k % 4
                __m512 w[R][4], sg[R];
                for (int j = 0; j < R; ++j) {
                    const __m512i v = Z::group(q[j], h[j], g);
                    for (int m = 0; m < 4; ++m)               // k = g + 4m
                        w[j][m] = _mm512_permutexvar_ps(Z::at(v, g, m), tbl);
                    sg[j] = _mm512_permutexvar_ps(
                        _mm512_setr_epi32(2 * g, 2 * g, 2 * g, 2 * g, 2 * g + 1, 2 * g + 1,
                                          2 * g + 1, 2 * g + 1, 8 + 2 * g, 8 + 2 * g, 8 + 2 * g,
                                          8 + 2 * g, 9 + 2 * g, 9 + 2 * g, 9 + 2 * g, 9 + 2 * g),
                        S[j]);
                }
                for (int t = 0; t < NT; ++t) {
                    const float* x = xq[t] + 256 * i + 64 * g;
                    const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
                    const __m512 x2 = _mm512_loadu_ps(x + 32), x3 = _mm512_loadu_ps(x + 48);
                    for (int j = 0; j < R; ++j) {
                        const __m512 a0 = _mm512_fmadd_ps(w[j][2], x2, _mm512_mul_ps(w[j][0], x0));
                        const __m512 a1 = _mm512_fmadd_ps(w[j][3], x3, _mm512_mul_ps(w[j][1], x1));
                        acc[j][t] = _mm512_fmadd_ps(_mm512_add_ps(a0, a1), sg[j], acc[j][t]);
                    }
                }
            }
            rc.step(Z::BYTES);
        }
        for (int j = 0; j < R; ++j)
            for (int t = 0; t < NT; ++t)
                put_z(y + (int64_t)t * ys + r + j, hsum512(acc[j][t]), alpha, accumulate);
    }
    return r;
}

// The super-block lookup types' rows (Z::pairs: R = 2 where the type says, then one at a time).
template <int NT, int R, class Z>
EFS_ZI int64_t lut_rows_z(const uint8_t* W, int64_t rb, int64_t r, int64_t r1, int64_t nb,
                          const float* const* xo, const float* const* sums, float* y,
                          int64_t ys, float alpha, int accumulate) {
    if constexpr (Z::FAMILY == F_NIB)
        return nib_rows_z<NT, R, Z>(W, rb, r, r1, nb, xo, sums, y, ys, alpha, accumulate);
    else
        return q23_rows_z<NT, R, Z>(W, rb, r, r1, nb, xo, sums, y, ys, alpha, accumulate);
}

template <int NT, class Z>
EFS_ZI void ex_lut_z(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                     const XPrep* xs, float* y, int64_t ys, float alpha, int accumulate) {
    const int64_t nb = cols / 256;
    const float* xo[NT];
    const float* sums[NT];
    for (int t = 0; t < NT; ++t) { xo[t] = Z::x(xs[t]); sums[t] = Z::sums(xs[t]); }
    int64_t r = r0;
    if (Z::pairs(NT, cols))
        r = lut_rows_z<NT, 2, Z>(W, rb, r, r1, nb, xo, sums, y, ys, alpha, accumulate);
    lut_rows_z<NT, 1, Z>(W, rb, r, r1, nb, xo, sums, y, ys, alpha, accumulate);
}


// Exact blocks of 32 weights w = d * q against natural-order activations, two blocks in flight
// per row (even blocks into one accumulator, odd into the other). A block type gives its byte
// size, its scale and its 32 weights as two vectors of 16 floats (low: 0..15, high: 16..31).
//
// The 4-bit types by the same table lookup as Q4_K: the 16 bytes of nibbles widened to 16
// dwords, looked up directly (low nibbles) and shifted by 4 (high nibbles) in the type's table
// of 16 floats: Q4_0 {-8.0, ..., 7.0}, IQ4_NL kvalues_iq4nl, MXFP4 kvalues_mxfp4 (twice the
// E2M1 values, with e8m0h's halved block scale, as ggml dequantizes it). Like Q8_0's, their
// sums run in 16 lanes, not the AVX2 kernels' 8, so their last bits differ from the AVX2
// unit's.
EFS_ZI void nibbles_z(const uint8_t* qs, __m512 tbl, __m512& lo, __m512& hi) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)qs));
    lo = _mm512_permutexvar_ps(v, tbl);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), tbl);
}
struct ZQ4_0 {
    static constexpr int BYTES = 18;
    static constexpr int FAMILY = F_B32, PER = 8;
    static constexpr bool SCALED_PAIRS = true;
    EFS_ZI static float d(const uint8_t* b) { return f16_z(b); }
    EFS_ZI static void w(const uint8_t* b, __m512& lo, __m512& hi) {
        nibbles_z(b + 2, _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7),
                  lo, hi);
    }
};
// IQ4_NL: Q4_0's block (d, 16 bytes of nibbles) with kvalues_iq4nl for table; a token's
// result the same in any batch (no SCALED_PAIRS), passes of up to 4 tokens.
struct ZIQ4_NL : ZQ4_0 {
    static constexpr int PER = 4;
    static constexpr bool SCALED_PAIRS = false;
    EFS_ZI static void w(const uint8_t* b, __m512& lo, __m512& hi) {
        nibbles_z(b + 2, _mm512_setr_ps(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38,
                                        53, 69, 89, 113),
                  lo, hi);
    }
};
struct ZMXFP4 {
    static constexpr int BYTES = 17;
    static constexpr int FAMILY = F_B32, PER = 8;
    static constexpr bool SCALED_PAIRS = true;
    EFS_ZI static float d(const uint8_t* b) { return e8m0h(b[0]); }
    EFS_ZI static void w(const uint8_t* b, __m512& lo, __m512& hi) {
        nibbles_z(b + 1, _mm512_setr_ps(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12),
                  lo, hi);
    }
};
// Q8_0: 32 signed bytes widened to two vectors of 16 dwords and converted.
struct ZQ8_0 {
    static constexpr int BYTES = 34;
    static constexpr int FAMILY = F_B32, PER = 8;
    static constexpr bool SCALED_PAIRS = true;
    EFS_ZI static float d(const uint8_t* b) { return f16_z(b); }
    EFS_ZI static void w(const uint8_t* b, __m512& lo, __m512& hi) {
        lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 2))));
        hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 18))));
    }
};

template <int NT, class Z>
EFS_ZI void block_z(const uint8_t* b, const float* const* xn, int64_t o, __m512* acc) {
    __m512 lo, hi;
    Z::w(b, lo, hi);
    const __m512 d = _mm512_set1_ps(Z::d(b));
    for (int t = 0; t < NT; ++t) {
        const float* x = xn[t] + o;
        const __m512 a = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + 16),
                                         _mm512_mul_ps(lo, _mm512_loadu_ps(x)));
        acc[t] = _mm512_fmadd_ps(a, d, acc[t]);
    }
}

// Rows r.. in groups of R (1 or 2), each row's even blocks into one accumulator and odd into
// the other (block_z); in a group the rows take each pair of blocks in turn, so the second
// reads the activations the first has just brought into the L1 cache. Returns the first row
// not done.
template <int NT, class Z, int R>
EFS_ZI int64_t b32_rows_z(const uint8_t* W, int64_t rb, int64_t r, int64_t r1, int64_t nb,
                          const float* const* xn, float* y, int64_t ys, float alpha,
                          int accumulate) {
    RowCursor<R> rc(W, rb, r);
    for (; r + R <= r1; r += R) {
        rc.at(W, rb, r);
        __m512 acc0[R][NT], acc1[R][NT];
        for (int j = 0; j < R; ++j)
            for (int t = 0; t < NT; ++t) acc0[j][t] = acc1[j][t] = _mm512_setzero_ps();
        int64_t i = 0;
        for (; i + 2 <= nb; i += 2) {
            rc.prefetch(2 * Z::BYTES);
            for (int j = 0; j < R; ++j) {
                block_z<NT, Z>(rc.b[j], xn, 32 * i, acc0[j]);
                block_z<NT, Z>(rc.b[j] + Z::BYTES, xn, 32 * i + 32, acc1[j]);
            }
            rc.step(2 * Z::BYTES);
        }
        if (i < nb)
            for (int j = 0; j < R; ++j) block_z<NT, Z>(rc.b[j], xn, 32 * i, acc0[j]);
        for (int j = 0; j < R; ++j)
            for (int t = 0; t < NT; ++t)
                put_z(y + (int64_t)t * ys + r + j,
                      hsum512(_mm512_add_ps(acc0[j][t], acc1[j][t])), alpha, accumulate);
    }
    return r;
}

// Several tokens (NT >= 4: prefill batches, verify windows) take rows in pairs: each block's
// weights decoded once and scaled by d (w = d * q, as the dequantized matrix holds them), then
// two FMAs per token and row, the activations loaded once for both rows and no per-token scale
// multiply. Fewer tokens (and a last odd row) go row by row with two blocks in flight, the
// scale applied to each block's sum: cheaper than scaling the weights, and more FMAs in flight;
// two such rows in turn where the pass's activations pass 16 KiB (b32_rows_z). The two forms
// round differently, so with SCALED_PAIRS a token's last bits depend on its pass; IQ4_NL, whose
// results must not (as the K-quants'), keeps the row form at every token count, in passes of
// up to 4 tokens (two rows in turn past 16 KiB of them).
template <int NT, class Z>
EFS_Z void ex_b32_z(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                    const XPrep* xs, float* y, int64_t ys, float alpha, int accumulate) {
    const int64_t nb = cols / 32;
    const float* xn[NT];
    for (int t = 0; t < NT; ++t) xn[t] = xs[t].x;
    int64_t r = r0;
    if constexpr (NT >= 4 && Z::SCALED_PAIRS) {
        PfPair pp(rb);
        for (; r + 2 <= r1; r += 2) {
            const uint8_t* b0 = W + r * rb;
            const uint8_t* b1 = b0 + rb;
            __m512 a0[NT], a1[NT];
            for (int t = 0; t < NT; ++t) a0[t] = a1[t] = _mm512_setzero_ps();
            for (int64_t i = 0; i < nb; ++i, b0 += Z::BYTES, b1 += Z::BYTES) {
                pp.next(b0, b1, Z::BYTES);
                __m512 l0, h0, l1, h1;
                Z::w(b0, l0, h0);
                Z::w(b1, l1, h1);
                const __m512 d0 = _mm512_set1_ps(Z::d(b0)), d1 = _mm512_set1_ps(Z::d(b1));
                l0 = _mm512_mul_ps(l0, d0);
                h0 = _mm512_mul_ps(h0, d0);
                l1 = _mm512_mul_ps(l1, d1);
                h1 = _mm512_mul_ps(h1, d1);
                for (int t = 0; t < NT; ++t) {
                    const __m512 xl = _mm512_loadu_ps(xn[t] + 32 * i);
                    const __m512 xh = _mm512_loadu_ps(xn[t] + 32 * i + 16);
                    a0[t] = _mm512_fmadd_ps(h0, xh, _mm512_fmadd_ps(l0, xl, a0[t]));
                    a1[t] = _mm512_fmadd_ps(h1, xh, _mm512_fmadd_ps(l1, xl, a1[t]));
                }
            }
            for (int t = 0; t < NT; ++t) {
                put_z(y + (int64_t)t * ys + r, hsum512(a0[t]), alpha, accumulate);
                put_z(y + (int64_t)t * ys + r + 1, hsum512(a1[t]), alpha, accumulate);
            }
        }
    }
    if ((NT < 4 || !Z::SCALED_PAIRS) && !x_in_l1(NT, cols, 4))
        r = b32_rows_z<NT, Z, 2>(W, rb, r, r1, nb, xn, y, ys, alpha, accumulate);
    b32_rows_z<NT, Z, 1>(W, rb, r, r1, nb, xn, y, ys, alpha, accumulate);
}

// One pass of NT tokens through type Z's kernel family.
template <int NT, class Z>
EFS_Z void pass_z(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                  const XPrep* xs, float* y, int64_t ys, float alpha, int accumulate) {
    if constexpr (Z::FAMILY == F_B32)
        ex_b32_z<NT, Z>(W, rb, r0, r1, cols, xs, y, ys, alpha, accumulate);
    else
        ex_lut_z<NT, Z>(W, rb, r0, r1, cols, xs, y, ys, alpha, accumulate);
}

// Up to Z::PER tokens per pass over the weights: 8 for the blocks of 32 but IQ4_NL (two rows'
// accumulators for 8 tokens fit the 32 registers) and Q3_K (one row), 4 for Q4_K, IQ4_XS,
// Q2_K and IQ4_NL, whose last pass takes 5 rather than leave a pass of one token (a whole
// decode of the weights for it: 1.25x at 5 tokens on Q4_K; 6 spill).
template <class Z>
EFS_Z void rows_z(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                  const XPrep* xs, int nt, float* y, int64_t ys, float alpha, int accumulate) {
    constexpr int per = Z::PER;
    for (int t0 = 0, n; t0 < nt; t0 += n) {
        n = nt - t0 < per ? nt - t0 : (per == 4 && nt - t0 == 5 ? 5 : per);
        float* yt = y + (int64_t)t0 * ys;
        const XPrep* xt = xs + t0;
        switch (n) {
            case 1: pass_z<1, Z>(W, rb, r0, r1, cols, xt, yt, ys, alpha, accumulate); break;
            case 2: pass_z<2, Z>(W, rb, r0, r1, cols, xt, yt, ys, alpha, accumulate); break;
            case 3: pass_z<3, Z>(W, rb, r0, r1, cols, xt, yt, ys, alpha, accumulate); break;
            case 4: pass_z<4, Z>(W, rb, r0, r1, cols, xt, yt, ys, alpha, accumulate); break;
            case 5: pass_z<5, Z>(W, rb, r0, r1, cols, xt, yt, ys, alpha, accumulate); break;
            case 6: pass_z<6, Z>(W, rb, r0, r1, cols, xt, yt, ys, alpha, accumulate); break;
            case 7: pass_z<7, Z>(W, rb, r0, r1, cols, xt, yt, ys, alpha, accumulate); break;
            default: pass_z<8, Z>(W, rb, r0, r1, cols, xt, yt, ys, alpha, accumulate); break;
        }
    }
}

}  // namespace

RowsFn avx512_rows(int type, int mode) {
    if (RowsFn f = avx512_k_rows(type, mode)) return f;   // the K-quants (kern_k_avx512.cpp)
    if (mode != 0) return nullptr;
    switch (type) {
        case T_Q4_K: return rows_z<ZQ4K>;
        case T_IQ4_XS: return rows_z<ZIQ4XS>;
        case T_Q2_K: return rows_z<ZQ2>;
        case T_Q3_K: return rows_z<ZQ3>;
        case T_Q4_0: return rows_z<ZQ4_0>;
        case T_Q8_0: return rows_z<ZQ8_0>;
        case T_MXFP4: return rows_z<ZMXFP4>;
        case T_IQ4_NL: return rows_z<ZIQ4_NL>;
        default: return nullptr;
    }
}

bool avx512_compiled() { return true; }

}  // namespace efs

#else

namespace efs {
RowsFn avx512_rows(int, int) { return nullptr; }
bool avx512_compiled() { return false; }
}  // namespace efs

#endif
