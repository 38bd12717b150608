// The exact K-quant kernels of the AVX2 unit (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), shared by
// kern_avx2.cpp and kern_k_avx512.cpp: the includer defines EFS_KT, the kernels' target
// attribute (kern_avx2.cpp: AVX2; kern_k_avx512.cpp: AVX-512VL, whose 32 vector registers
// hold the accumulators of 8 tokens), so both compile the same operations in the same order
// and give the same bits. Included only by those units, after kern_avx2_util.h.
#pragma once

#include "kern_avx2_util.h"

#ifndef EFS_KT
#error "define EFS_KT (the kernels' target attribute) before including kern_k_avx2.h"
#endif

namespace efs {
namespace {

// The 12 scale bytes of a Q4_K/Q5_K block -> bytes 0..7: the 8 6-bit scales, bytes 8..15: the
// 8 6-bit mins (ggml get_scale_min_k4), in vector registers. Reads 16 bytes (the 4 after the
// scales are the block's own).
EFS_TI __m128i k4_scales_v(const uint8_t* s12) {
    const __m128i v = loadu128(s12);
    const __m128i a = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11,
                                                        4, 5, 6, 7, 8, 9, 10, 11));
    const __m128i b = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3,
                                                        -1, -1, -1, -1, 4, 5, 6, 7));
    const __m128i lo = _mm_and_si128(a, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15,
                                                      63, 63, 63, 63, 0, 0, 0, 0));
    const __m128i hi4 = _mm_and_si128(_mm_srli_epi16(a, 4), _mm_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15));
    const __m128i top = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(b, 6), _mm_set1_epi8(3)), 4);
    return _mm_or_si128(_mm_or_si128(lo, hi4), top);
}

EFS_TI __m256 u8x8_ps(const void* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

EFS_TI __m256 i8x8_ps(const void* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

// Half h of a Q6_K block (b: the block) -> its four runs of 32 values (elements 128h + 32k +
// l, k = 0..3), each the 6-bit value before the -32, as bytes.
EFS_TI void q6_planes(const uint8_t* b, int h, __m256i* q) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    const __m256i A = loadu256(b + 64 * h), B = loadu256(b + 64 * h + 32);
    const __m256i QH = loadu256(b + 128 + 32 * h);
    q[0] = _mm256_or_si256(_mm256_and_si256(A, m4),
                           _mm256_and_si256(_mm256_slli_epi16(QH, 4), m30));
    q[1] = _mm256_or_si256(_mm256_and_si256(B, m4),
                           _mm256_and_si256(_mm256_slli_epi16(QH, 2), m30));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(A, 4), m4),
                           _mm256_and_si256(QH, m30));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(B, 4), m4),
                           _mm256_and_si256(_mm256_srli_epi16(QH, 2), m30));
}

// Quant bytes j of a Q4_K/Q5_K block (v = qs[32j .. 32j+31]) -> sub-block 2j's values (lo)
// and 2j+1's (hi) as bytes; Q5_K's fifth bits from hb (bit 2j / 2j+1 of qh[l]), which is
// shifted on for the next j.
template <bool FIVE>
EFS_TI void q45_planes(__m256i v, __m256i& hb, __m256i& lo, __m256i& hi) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m10 = _mm256_set1_epi8(0x10);
    lo = _mm256_and_si256(v, m4);
    hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    if (FIVE) {
        lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(hb, 4), m10));
        hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(hb, 3), m10));
        hb = _mm256_srli_epi16(hb, 2);
    }
}

// A Q4_K/Q5_K block's 8 sub-block scales times d into scs, and its 8 mins times dmin returned.
EFS_TI __m256 q45_scales(const uint8_t* b, float* scs) {
    const __m128i sm = k4_scales_v(b + 4);
    uint32_t dd;
    memcpy(&dd, b, 4);
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dd));       // d, dmin
    _mm256_store_ps(scs, _mm256_mul_ps(_mm256_broadcastss_ps(dm),
                                       _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm))));
    return _mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(dm)),
                         _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8))));
}

// One token, two rows at a time: the same operations per row in the same order as
// ex_q45_k<1> (the same bits), the two rows' dependency chains interleaved. A one-token row
// is a chain of dependent multiply-adds per 32 weights; with one row in flight the core waits
// on their latency, with two it fills the gaps.
template <bool FIVE>
EFS_KT void ex_q45_k_rows2(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                           const XPrep* xs, Out out) {
    const int64_t nb = cols / 256;
    const int BYTES = FIVE ? 176 : 144;
    const float* xp[1] = {xs[0].xp};
    const float* s32 = xs[0].s32;
    alignas(32) float scs[2][8];
    const char* pf = pf_start(W + r0 * rb);
    for (int64_t r = r0; r + 1 < r1; r += 2) {
        const uint8_t* b[2] = {W + r * rb, W + (r + 1) * rb};
        __m256 a0[2], a1[2], am[2];
        for (int k = 0; k < 2; ++k) a0[k] = a1[k] = am[k] = _mm256_setzero_ps();
        for (int64_t i = 0; i < nb; ++i, b[0] += BYTES, b[1] += BYTES) {
            pf_next(pf, b[1] + BYTES);
            __m256i hb[2];
            for (int k = 0; k < 2; ++k) {
                am[k] = _mm256_fmadd_ps(q45_scales(b[k], scs[k]), _mm256_loadu_ps(s32 + 8 * i),
                                        am[k]);
                hb[k] = FIVE ? loadu256(b[k] + 16) : _mm256_setzero_si256();
            }
            for (int j = 0; j < 4; ++j) {
                const int64_t o = 256 * i + 64 * j;
                for (int k = 0; k < 2; ++k) {
                    __m256i lo, hi;
                    q45_planes<FIVE>(loadu256(b[k] + (FIVE ? 48 : 16) + 32 * j), hb[k], lo, hi);
                    grp<1, 0>(lo, xp, o, _mm256_broadcast_ss(scs[k] + 2 * j), a0 + k);
                    grp<1, 0>(hi, xp, o + 32, _mm256_broadcast_ss(scs[k] + 2 * j + 1), a1 + k);
                }
            }
        }
        for (int k = 0; k < 2; ++k)
            out.put(0, r + k, hsum(_mm256_add_ps(a0[k], a1[k])) - hsum(am[k]));
    }
}

template <int NT, bool FIVE>
EFS_KT void ex_q45_k(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                    const XPrep* xs, Out out) {
    if constexpr (NT == 1) {                     // rows in pairs; an odd last row below
        ex_q45_k_rows2<FIVE>(W, rb, r0, r1, cols, xs, out);
        r0 += (r1 - r0) & ~(int64_t)1;
        if (r0 == r1) return;
    }
    const int64_t nb = cols / 256;
    const int BYTES = FIVE ? 176 : 144;
    const float* xp[NT];
    const float* s32[NT];
    for (int t = 0; t < NT; ++t) { xp[t] = xs[t].xp; s32[t] = xs[t].s32; }
    alignas(32) float scs[8];
    const char* pf = pf_start(W + r0 * rb);
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* b = W + r * rb;
        __m256 a0[NT], a1[NT], am[NT];
        for (int t = 0; t < NT; ++t) a0[t] = a1[t] = am[t] = _mm256_setzero_ps();
        for (int64_t i = 0; i < nb; ++i, b += BYTES) {
            pf_next(pf, b + BYTES);
            const __m256 mn = q45_scales(b, scs);
            for (int t = 0; t < NT; ++t)
                am[t] = _mm256_fmadd_ps(mn, _mm256_loadu_ps(s32[t] + 8 * i), am[t]);
            const uint8_t* q = b + (FIVE ? 48 : 16);
            __m256i hb = FIVE ? loadu256(b + 16) : _mm256_setzero_si256();
            for (int j = 0; j < 4; ++j) {
                __m256i lo, hi;
                q45_planes<FIVE>(loadu256(q + 32 * j), hb, lo, hi);
                const int64_t o = 256 * i + 64 * j;
                grp<NT, 0>(lo, xp, o, _mm256_broadcast_ss(scs + 2 * j), a0);
                grp<NT, 0>(hi, xp, o + 32, _mm256_broadcast_ss(scs + 2 * j + 1), a1);
            }
        }
        for (int t = 0; t < NT; ++t)
            out.put(t, r, hsum(_mm256_add_ps(a0[t], a1[t])) - hsum(am[t]));
    }
}

// Q6_K: ql[128], qh[64], scales:i8[16], d. Half h, vector k (elements 128h + 32k + l):
// q = nibble (k>=2) of ql[64h + 32(k&1) + l] | ((qh[32h + l] >> 2k) & 3) << 4, minus 32;
// scale 8h + 2k + (l >= 16).
template <int NT>
EFS_KT void ex_q6_k(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                   const XPrep* xs, Out out) {
    const int64_t nb = cols / 256;
    const float* xp[NT];
    for (int t = 0; t < NT; ++t) xp[t] = xs[t].xp;
    const char* pf = pf_start(W + r0 * rb);
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* b = W + r * rb;
        __m256 a0[NT], a1[NT];
        for (int t = 0; t < NT; ++t) a0[t] = a1[t] = _mm256_setzero_ps();
        for (int64_t i = 0; i < nb; ++i, b += 210) {
            pf_next(pf, b + 210);
            const __m256 d = _mm256_set1_ps(f16(b + 208));
            const __m256 S[2] = {_mm256_mul_ps(d, i8x8_ps(b + 192)),
                                 _mm256_mul_ps(d, i8x8_ps(b + 200))};
            for (int h = 0; h < 2; ++h) {
                __m256i q[4];
                q6_planes(b, h, q);
                const int64_t o = 256 * i + 128 * h;
                grp<NT, 32>(q[0], xp, o, pair_scale(S[h], 0), a0);
                grp<NT, 32>(q[1], xp, o + 32, pair_scale(S[h], 1), a1);
                grp<NT, 32>(q[2], xp, o + 64, pair_scale(S[h], 2), a0);
                grp<NT, 32>(q[3], xp, o + 96, pair_scale(S[h], 3), a1);
            }
        }
        for (int t = 0; t < NT; ++t) out.put(t, r, hsum(_mm256_add_ps(a0[t], a1[t])));
    }
}

// Q2_K: scales[16] (lo nibble scale, hi nibble min), qs[64], d, dmin. Half n, vector j
// (elements 128n + 32j + l): q = (qs[32n + l] >> 2j) & 3; scale/min 8n + 2j + (l >= 16).
template <int NT>
EFS_KT void ex_q2_k(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                   const XPrep* xs, Out out) {
    const int64_t nb = cols / 256;
    const float* xp[NT];
    const float* s16[NT];
    for (int t = 0; t < NT; ++t) { xp[t] = xs[t].xp; s16[t] = xs[t].s16; }
    const __m256i m3 = _mm256_set1_epi8(3);
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const char* pf = pf_start(W + r0 * rb);
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* b = W + r * rb;
        __m256 a0[NT], a1[NT], am[NT];
        for (int t = 0; t < NT; ++t) a0[t] = a1[t] = am[t] = _mm256_setzero_ps();
        for (int64_t i = 0; i < nb; ++i, b += 84) {
            pf_next(pf, b + 84);
            const __m128i sc = loadu128(b);
            alignas(16) uint8_t sl[16], sh[16];
            _mm_store_si128((__m128i*)sl, _mm_and_si128(sc, m4));
            _mm_store_si128((__m128i*)sh, _mm_and_si128(_mm_srli_epi16(sc, 4), m4));
            const __m256 d = _mm256_set1_ps(f16(b + 80)), dm = _mm256_set1_ps(f16(b + 82));
            const __m256 S[2] = {_mm256_mul_ps(d, u8x8_ps(sl)), _mm256_mul_ps(d, u8x8_ps(sl + 8))};
            const __m256 M0 = _mm256_mul_ps(dm, u8x8_ps(sh)), M1 = _mm256_mul_ps(dm, u8x8_ps(sh + 8));
            for (int t = 0; t < NT; ++t) {
                am[t] = _mm256_fmadd_ps(M0, _mm256_loadu_ps(s16[t] + 16 * i), am[t]);
                am[t] = _mm256_fmadd_ps(M1, _mm256_loadu_ps(s16[t] + 16 * i + 8), am[t]);
            }
            for (int n = 0; n < 2; ++n) {
                const __m256i Q = loadu256(b + 16 + 32 * n);
                const int64_t o = 256 * i + 128 * n;
                grp<NT, 0>(_mm256_and_si256(Q, m3), xp, o, pair_scale(S[n], 0), a0);
                grp<NT, 0>(_mm256_and_si256(_mm256_srli_epi16(Q, 2), m3), xp, o + 32,
                        pair_scale(S[n], 1), a1);
                grp<NT, 0>(_mm256_and_si256(_mm256_srli_epi16(Q, 4), m3), xp, o + 64,
                        pair_scale(S[n], 2), a0);
                grp<NT, 0>(_mm256_and_si256(_mm256_srli_epi16(Q, 6), m3), xp, o + 96,
                        pair_scale(S[n], 3), a1);
            }
        }
        for (int t = 0; t < NT; ++t)
            out.put(t, r, hsum(_mm256_add_ps(a0[t], a1[t])) - hsum(am[t]));
    }
}

EFS_TI __m128i q3k_scales_v(const uint8_t* s12) {
    const uint32_t kmask1 = 0x03030303, kmask2 = 0x0f0f0f0f;
    uint32_t aux[3];
    memcpy(aux, s12, 12);
    const uint32_t tmp = aux[2];
    return _mm_setr_epi32((int)((aux[0] & kmask2) | (((tmp >> 0) & kmask1) << 4)),
                          (int)((aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4)),
                          (int)(((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4)),
                          (int)(((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4)));
}

EFS_TI void q3k_scales(const uint8_t* s12, int8_t* out) {
    _mm_storeu_si128((__m128i*)out, q3k_scales_v(s12));
}

// Q3_K: hmask[32], qs[64], scales[12] (6-bit, minus 32), d. Half n, vector j (elements
// 128n + 32j + l): q = ((qs[32n + l] >> 2j) & 3) + 4 * bit(4n + j) of hmask[l] - 4.
template <int NT>
EFS_KT void ex_q3_k(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                   const XPrep* xs, Out out) {
    const int64_t nb = cols / 256;
    const float* xp[NT];
    for (int t = 0; t < NT; ++t) xp[t] = xs[t].xp;
    const __m256i m3 = _mm256_set1_epi8(3), m04 = _mm256_set1_epi8(4);
    const char* pf = pf_start(W + r0 * rb);
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* b = W + r * rb;
        __m256 a0[NT], a1[NT];
        for (int t = 0; t < NT; ++t) a0[t] = a1[t] = _mm256_setzero_ps();
        for (int64_t i = 0; i < nb; ++i, b += 110) {
            pf_next(pf, b + 110);
            alignas(16) int8_t sc[16];
            q3k_scales(b + 96, sc);
            _mm_store_si128((__m128i*)sc, _mm_sub_epi8(_mm_load_si128((const __m128i*)sc),
                                                        _mm_set1_epi8(32)));
            const __m256 d = _mm256_set1_ps(f16(b + 108));
            const __m256 S[2] = {_mm256_mul_ps(d, i8x8_ps(sc)), _mm256_mul_ps(d, i8x8_ps(sc + 8))};
            __m256i hb = loadu256(b);
            for (int n = 0; n < 2; ++n) {
                const __m256i Q = loadu256(b + 32 + 32 * n);
                const int64_t o = 256 * i + 128 * n;
                for (int j = 0; j < 4; ++j) {
                    const __m256i q = _mm256_or_si256(
                        _mm256_and_si256(_mm256_srl_epi16(Q, _mm_cvtsi32_si128(2 * j)), m3),
                        _mm256_and_si256(_mm256_slli_epi16(hb, 2), m04));
                    hb = _mm256_srli_epi16(hb, 1);
                    grp<NT, 4>(q, xp, o + 32 * j, pair_scale(S[n], j), (j & 1) ? a1 : a0);
                }
            }
        }
        for (int t = 0; t < NT; ++t) out.put(t, r, hsum(_mm256_add_ps(a0[t], a1[t])));
    }
}

// --- q8 mode: Q2_K ... Q6_K against Q8_K activations ----------------------------------------
//
// ggml-cpu's integer dot products (ggml_vec_dot_q*_K_q8_K) for NT tokens at once: a block's
// scales and 2- to 6-bit values are decoded once and multiplied by each token's activations;
// per token the same integer sums and the same float operations in the same order as ggml's
// one-token product, so the same bits whatever the pass (the AVX2 unit takes passes of up to 4
// tokens, the AVX-512 unit, with its 32 vector registers, up to 8).

// Q4_K/Q5_K's 12 scale bytes -> u[0..1]: the 8 6-bit scales as bytes, u[2..3]: the 8 mins
// (ggml get_scale_min_k4).
EFS_TI void k4_scales(const uint8_t* s12, uint32_t* u) {
    const uint32_t km1 = 0x3f3f3f3f, km2 = 0x0f0f0f0f, km3 = 0x03030303;
    memcpy(u, s12, 12);
    u[3] = ((u[2] >> 4) & km2) | (((u[1] >> 6) & km3) << 4);
    const uint32_t ua = u[1] & km1;
    u[1] = (u[2] & km2) | (((u[0] >> 6) & km3) << 4);
    u[2] = ua;
    u[0] &= km1;
}

EFS_TI __m256i pair16(int a, int b) {   // 16-bit lanes: a in the low 128, b in the high 128
    return _mm256_set_m128i(_mm_set1_epi16((short)b), _mm_set1_epi16((short)a));
}

// A Q4_K/Q5_K block's mins (k4_scales' u[2], u[3]) against a Q8_K block: sum over the 8
// sub-blocks of min * (the activations' sum over its 32), in integers (ggml's bsums pairs):
// each min twice against its two bsums in one madd, not a scalar loop.
EFS_TI int k4_msum(uint32_t m0, uint32_t m1, const int16_t* bs) {
    const __m128i mn = _mm_setr_epi32((int)m0, (int)m1, 0, 0);
    const __m256i mm = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mn, mn));   // m0 m0 m1 m1 ..
    return hsum_i32(_mm256_madd_epi16(mm, loadu256((const uint8_t*)bs)));
}

template <int NT, bool FIVE>
EFS_KT void q8_q45_k(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                      const XPrep* xs, Out out) {
    const int64_t nb = cols / 256;
    const int BYTES = FIVE ? 176 : 144;
    const Q8K* y[NT];
    for (int t = 0; t < NT; ++t) y[t] = (const Q8K*)xs[t].q;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m10 = _mm256_set1_epi8(0x10);
    const char* pf = pf_start(W + r0 * rb);
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* b = W + r * rb;
        __m256 acc[NT];
        float accm[NT];
        for (int t = 0; t < NT; ++t) { acc[t] = _mm256_setzero_ps(); accm[t] = 0.f; }
        for (int64_t i = 0; i < nb; ++i, b += BYTES) {
            pf_next(pf, b + BYTES);
            uint32_t u[4];
            k4_scales(b + 4, u);
            const uint8_t* sc = (const uint8_t*)&u[0];
            const float dmin = f16(b + 2), d = f16(b);
            __m256i sumi[NT];
            for (int t = 0; t < NT; ++t) {
                accm[t] += y[t][i].d * dmin * (float)k4_msum(u[2], u[3], y[t][i].bsums);
                sumi[t] = _mm256_setzero_si256();
            }
            const uint8_t* q = b + (FIVE ? 48 : 16);
            __m256i hb = FIVE ? loadu256(b + 16) : _mm256_setzero_si256();
            for (int j = 0; j < 4; ++j) {
                const __m256i v = loadu256(q + 32 * j);
                __m256i lo = _mm256_and_si256(v, m4);
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                if (FIVE) {
                    lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(hb, 4), m10));
                    hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(hb, 3), m10));
                    hb = _mm256_srli_epi16(hb, 2);
                }
                const __m256i sl = _mm256_set1_epi16(sc[2 * j]);
                const __m256i sh = _mm256_set1_epi16(sc[2 * j + 1]);
                for (int t = 0; t < NT; ++t) {
                    const int8_t* q8 = y[t][i].qs;
                    const __m256i pl = _mm256_madd_epi16(sl, _mm256_maddubs_epi16(
                        lo, loadu256((const uint8_t*)(q8 + 64 * j))));
                    const __m256i ph = _mm256_madd_epi16(sh, _mm256_maddubs_epi16(
                        hi, loadu256((const uint8_t*)(q8 + 64 * j + 32))));
                    sumi[t] = _mm256_add_epi32(sumi[t], _mm256_add_epi32(pl, ph));
                }
            }
            for (int t = 0; t < NT; ++t)
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(y[t][i].d * d),
                                         _mm256_cvtepi32_ps(sumi[t]), acc[t]);
        }
        for (int t = 0; t < NT; ++t) out.put(t, r, hsum(acc[t]) - accm[t]);
    }
}

template <int NT>
EFS_KT void q8_q6_k(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                     const XPrep* xs, Out out) {
    const int64_t nb = cols / 256;
    const Q8K* y[NT];
    for (int t = 0; t < NT; ++t) y[t] = (const Q8K*)xs[t].q;
    const __m256i m32 = _mm256_set1_epi8(32);
    const char* pf = pf_start(W + r0 * rb);
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* b = W + r * rb;
        __m256 acc[NT];
        for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
        for (int64_t i = 0; i < nb; ++i, b += 210) {
            pf_next(pf, b + 210);
            const int8_t* sc = (const int8_t*)(b + 192);
            __m256i sumi[NT];
            for (int t = 0; t < NT; ++t) sumi[t] = _mm256_setzero_si256();
            for (int h = 0; h < 2; ++h) {
                __m256i q[4];
                q6_planes(b, h, q);
                for (int k = 0; k < 4; ++k) {
                    const __m256i s = pair16(sc[8 * h + 2 * k], sc[8 * h + 2 * k + 1]);
                    for (int t = 0; t < NT; ++t) {
                        const __m256i yv8 = loadu256((const uint8_t*)(y[t][i].qs + 128 * h +
                                                                      32 * k));
                        const __m256i p = _mm256_sub_epi16(_mm256_maddubs_epi16(q[k], yv8),
                                                           _mm256_maddubs_epi16(m32, yv8));
                        sumi[t] = _mm256_add_epi32(sumi[t], _mm256_madd_epi16(s, p));
                    }
                }
            }
            const float d = f16(b + 208);
            for (int t = 0; t < NT; ++t)
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(y[t][i].d * d),
                                         _mm256_cvtepi32_ps(sumi[t]), acc[t]);
        }
        for (int t = 0; t < NT; ++t) out.put(t, r, hsum(acc[t]));
    }
}

// A block's 16 scales as 16-bit values, each 128-bit half in both lanes: [0] scales 0..7,
// [1] 8..15. pick16w(2j) of half n is then pair16(s[8n + 2j], s[8n + 2j + 1]), one byte
// shuffle where building it from extracted scalars took most of a q8 block's time.
EFS_TI void halves16(__m256i s16, __m256i* h) {
    h[0] = _mm256_permute2x128_si256(s16, s16, 0x00);
    h[1] = _mm256_permute2x128_si256(s16, s16, 0x11);
}

// pair16(h[a], h[a + 1]) of 8 16-bit values h in each lane.
EFS_TI __m256i pick16w(int a) {
    return _mm256_set_m128i(_mm_set1_epi16((short)(((2 * a + 3) << 8) | (2 * a + 2))),
                            _mm_set1_epi16((short)(((2 * a + 1) << 8) | (2 * a))));
}

// Q2_K against Q8_K: per 16 weights the 2-bit values times the scale's low nibble, the mins
// (high nibbles) as dy * dmin * sum(min * bsums) in float: one madd of the 16 mins against
// bsums, the scale pairs by halves16 and pick16w. The same integers, so the same bits.

template <int NT>
EFS_KT void q8_q2_k(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                     const XPrep* xs, Out out) {
    const int64_t nb = cols / 256;
    const Q8K* y[NT];
    for (int t = 0; t < NT; ++t) y[t] = (const Q8K*)xs[t].q;
    const __m256i m3 = _mm256_set1_epi8(3);
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const char* pf = pf_start(W + r0 * rb);
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* b = W + r * rb;
        __m256 acc[NT];
        float accm[NT];
        for (int t = 0; t < NT; ++t) { acc[t] = _mm256_setzero_ps(); accm[t] = 0.f; }
        for (int64_t i = 0; i < nb; ++i, b += 84) {
            pf_next(pf, b + 84);
            const __m128i sc = loadu128(b);
            __m256i S16[2];
            halves16(_mm256_cvtepu8_epi16(_mm_and_si128(sc, m4)), S16);
            const __m256i mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sc, 4), m4));
            const float dmin = f16(b + 82), d = f16(b + 80);
            __m256i sumi[NT];
            for (int t = 0; t < NT; ++t) {
                const int summs = hsum_i32(
                    _mm256_madd_epi16(mins, loadu256((const uint8_t*)y[t][i].bsums)));
                accm[t] += y[t][i].d * dmin * (float)summs;
                sumi[t] = _mm256_setzero_si256();
            }
            for (int n = 0; n < 2; ++n) {
                const __m256i Q = loadu256(b + 16 + 32 * n);
                for (int j = 0; j < 4; ++j) {
                    const __m256i v = _mm256_and_si256(
                        _mm256_srl_epi16(Q, _mm_cvtsi32_si128(2 * j)), m3);
                    const __m256i s = _mm256_shuffle_epi8(S16[n], pick16w(2 * j));
                    for (int t = 0; t < NT; ++t) {
                        const __m256i p = _mm256_maddubs_epi16(
                            v, loadu256((const uint8_t*)(y[t][i].qs + 128 * n + 32 * j)));
                        sumi[t] = _mm256_add_epi32(sumi[t], _mm256_madd_epi16(s, p));
                    }
                }
            }
            for (int t = 0; t < NT; ++t)
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(y[t][i].d * d),
                                         _mm256_cvtepi32_ps(sumi[t]), acc[t]);
        }
        for (int t = 0; t < NT; ++t) out.put(t, r, hsum(acc[t]) - accm[t]);
    }
}

// Q3_K against Q8_K: the 3-bit values (2 low bits and the hmask bit, 0..7) less 4 times
// the activations, per 16 weights times the signed 6-bit scale (its pairs as q8_q2_k's).
template <int NT>
EFS_KT void q8_q3_k(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                     const XPrep* xs, Out out) {
    const int64_t nb = cols / 256;
    const Q8K* y[NT];
    for (int t = 0; t < NT; ++t) y[t] = (const Q8K*)xs[t].q;
    const __m256i m3 = _mm256_set1_epi8(3), m04 = _mm256_set1_epi8(4);
    const char* pf = pf_start(W + r0 * rb);
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* b = W + r * rb;
        __m256 acc[NT];
        for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
        for (int64_t i = 0; i < nb; ++i, b += 110) {
            pf_next(pf, b + 110);
            __m256i S16[2];
            halves16(_mm256_cvtepi8_epi16(_mm_sub_epi8(q3k_scales_v(b + 96), _mm_set1_epi8(32))),
                     S16);
            __m256i hb = loadu256(b);
            __m256i sumi[NT];
            for (int t = 0; t < NT; ++t) sumi[t] = _mm256_setzero_si256();
            for (int n = 0; n < 2; ++n) {
                const __m256i Q = loadu256(b + 32 + 32 * n);
                for (int j = 0; j < 4; ++j) {
                    const __m256i q = _mm256_or_si256(
                        _mm256_and_si256(_mm256_srl_epi16(Q, _mm_cvtsi32_si128(2 * j)), m3),
                        _mm256_and_si256(_mm256_slli_epi16(hb, 2), m04));
                    hb = _mm256_srli_epi16(hb, 1);
                    const __m256i s = _mm256_shuffle_epi8(S16[n], pick16w(2 * j));
                    for (int t = 0; t < NT; ++t) {
                        const __m256i yv8 = loadu256((const uint8_t*)(y[t][i].qs + 128 * n +
                                                                      32 * j));
                        const __m256i p = _mm256_sub_epi16(_mm256_maddubs_epi16(q, yv8),
                                                           _mm256_maddubs_epi16(m04, yv8));
                        sumi[t] = _mm256_add_epi32(sumi[t], _mm256_madd_epi16(s, p));
                    }
                }
            }
            const float d = f16(b + 108);
            for (int t = 0; t < NT; ++t)
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(y[t][i].d * d),
                                         _mm256_cvtepi32_ps(sumi[t]), acc[t]);
        }
        for (int t = 0; t < NT; ++t) out.put(t, r, hsum(acc[t]));
    }
}

}  // namespace
}  // namespace efs
