// The K-quants Q5_K and Q6_K (exact) and Q2_K ... Q6_K (q8) on CPUs with AVX-512 (F, VL, BW;
// ops.cpp checks the tier, avx512_k_rows BW): the AVX2 unit's kernels (kern_k_avx2.h) in wider
// forms that give their results bit for bit, so a model's logits do not depend on the ISA, on
// the batch or on how the tokens are cut into passes. Exact Q2_K, Q3_K, Q4_K, IQ4_XS and
// IQ4_NL take kern_avx512.cpp's table-lookup kernels instead (their last bits their own).
//
//  - exact: passes of up to 8 tokens, Q5_K and Q6_K one row per vector, a row's two AVX2
//    accumulators side by side (ex_q6_k_r, ex_q5_k_r): none of the two-row form's inserts and
//    broadcasts, which cost most where 512-bit operations run on 256-bit units (Zen 4).
//  - q8: a block's scales and values are decoded once for up to 8 tokens (the AVX2 unit: 4);
//    Q4_K, Q5_K and Q6_K one row per vector at a few tokens (q8_q6_k_r, q8_q45_k_r), two rows
//    per vector past them (each activation load serving both rows), Q2_K and Q3_K the shared
//    256-bit kernels (AVX-512VL's 32 registers hold the 8 tokens' sums).
#include "kern.h"

#include <string.h>

#if defined(__x86_64__) || defined(__i386__)

#include "kern_avx512_pair.h"
#define EFS_KT EFS_Z
#include "kern_k_avx2.h"
#include "kern_q45_z.h"

namespace efs {
namespace {

// --- two rows per 512-bit vector (q8 mode's kernels below) --------------------------------
//
// Lanes 0..7 of every vector are row r's AVX2 lanes, lanes 8..15 row r + 1's: the weights of
// the two rows' groups are loaded into the two halves and decoded by the 512-bit forms of the
// AVX2 unit's operations (all of which work within 128-bit lanes, so each half gets what the
// AVX2 unit computes for its row), each activation vector of 8 is loaded once and broadcast to
// both halves, and the scales are the rows' own. Per lane the same products, sums and scales in
// the same order as the AVX2 kernel, and at the end the AVX2 unit's hsum(a0 + a1) (- hsum(am))
// of each half. A last odd row goes to the AVX2 kernel's code.

// q45_planes (kern_k_avx2.h) of each half: v = quant bytes j of the two rows' blocks.
template <bool FIVE>
EFS_ZI void q45_planes2(__m512i v, __m512i& hb, __m512i& lo, __m512i& hi) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m10 = _mm512_set1_epi8(0x10);
    lo = _mm512_and_si512(v, m4);
    hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    if (FIVE) {
        lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_slli_epi16(hb, 4), m10));
        hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_slli_epi16(hb, 3), m10));
        hb = _mm512_srli_epi16(hb, 2);
    }
}

// q6_planes (kern_k_avx2.h) of each half: half h of the two rows' Q6_K blocks.
EFS_ZI void q6_planes2(const uint8_t* b0, const uint8_t* b1, int h, __m512i* q) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    const __m512i A = ld2(b0 + 64 * h, b1 + 64 * h);
    const __m512i B = ld2(b0 + 64 * h + 32, b1 + 64 * h + 32);
    const __m512i QH = ld2(b0 + 128 + 32 * h, b1 + 128 + 32 * h);
    q[0] = _mm512_or_si512(_mm512_and_si512(A, m4),
                           _mm512_and_si512(_mm512_slli_epi16(QH, 4), m30));
    q[1] = _mm512_or_si512(_mm512_and_si512(B, m4),
                           _mm512_and_si512(_mm512_slli_epi16(QH, 2), m30));
    q[2] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(A, 4), m4),
                           _mm512_and_si512(QH, m30));
    q[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(B, 4), m4),
                           _mm512_and_si512(_mm512_srli_epi16(QH, 2), m30));
}

// A Q6_K block half's four groups as two vectors of the one-row kernels: [q[0] | q[1]] and
// [q[2] | q[3]] (q6_planes' values, 0..63), from one load of its 64 nibble bytes and one
// broadcast of its 32 high-bit bytes (per 256-bit half the shift that tells q[0] from q[1],
// q[2] from q[3]).
struct Q6Row {
    static constexpr bool SIGNED = false;
    __m512i m4, m30, shl, shr;
    EFS_ZI Q6Row() {
        const long long s1 = 0x0001000100010001ll;
        m4 = _mm512_set1_epi8(0x0F);
        m30 = _mm512_set1_epi8(0x30);
        shl = _mm512_setr_epi64(4 * s1, 4 * s1, 4 * s1, 4 * s1, 2 * s1, 2 * s1, 2 * s1, 2 * s1);
        shr = _mm512_setr_epi64(0, 0, 0, 0, 2 * s1, 2 * s1, 2 * s1, 2 * s1);
    }
    EFS_ZI void planes(const uint8_t* b, int h, __m512i* q) const {
        const __m512i AB = _mm512_loadu_si512((const void*)(b + 64 * h));
        const __m512i QH = _mm512_broadcast_i64x4(loadu256(b + 128 + 32 * h));
        q[0] = _mm512_or_si512(_mm512_and_si512(AB, m4),
                               _mm512_and_si512(_mm512_sllv_epi16(QH, shl), m30));
        q[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(AB, 4), m4),
                               _mm512_and_si512(_mm512_srlv_epi16(QH, shr), m30));
    }
};

// Q6Row's vectors as signed bytes q - 32, each built by two bit-matrix products (GFNI's
// affine transform: a byte's bits moved, and constant bits flipped, per 64-bit lane): a nibble
// to bits 0..3, the high bits' field f to bit 4 and, flipped, to bits 5..7 (the sign of
// q - 32, whose bit 5 is the field's high bit flipped), then an or: where Q6Row's masks, shifts,
// or and subtraction take eleven operations a block half, this takes six. The same bytes.
struct Q6RowGF {
    static constexpr bool SIGNED = true;
    __m512i lo, hi, f01, f23;
    static constexpr long long nib(int from) {   // out bit k < 4 = in bit from + k
        long long m = 0;
        for (int k = 0; k < 4; ++k) m |= (long long)(1 << (from + k)) << (8 * (7 - k));
        return m;
    }
    static constexpr long long field(int f) {    // out 4 = in 2f; out 5, 6, 7 = in 2f + 1
        long long m = (long long)(1 << (2 * f)) << (8 * 3);
        for (int k = 5; k < 8; ++k) m |= (long long)(1 << (2 * f + 1)) << (8 * (7 - k));
        return m;
    }
    EFS_ZGI Q6RowGF() {
        lo = _mm512_set1_epi64(nib(0));
        hi = _mm512_set1_epi64(nib(4));
        f01 = _mm512_setr_epi64(field(0), field(0), field(0), field(0),
                                field(1), field(1), field(1), field(1));
        f23 = _mm512_setr_epi64(field(2), field(2), field(2), field(2),
                                field(3), field(3), field(3), field(3));
    }
    EFS_ZGI void planes(const uint8_t* b, int h, __m512i* q) const {
        const __m512i AB = _mm512_loadu_si512((const void*)(b + 64 * h));
        const __m512i QH = _mm512_broadcast_i64x4(loadu256(b + 128 + 32 * h));
        q[0] = _mm512_or_si512(_mm512_gf2p8affine_epi64_epi8(AB, lo, 0),
                               _mm512_gf2p8affine_epi64_epi8(QH, f01, 0xE0));
        q[1] = _mm512_or_si512(_mm512_gf2p8affine_epi64_epi8(AB, hi, 0),
                               _mm512_gf2p8affine_epi64_epi8(QH, f23, 0xE0));
    }
};

// The one-row kernels' byte shuffles (u8f's, per 128-bit lane): shuffle k puts byte 4k + j of
// each 16 into byte `place` of dword j, zeroing the others; converted, byte 0 gives q and byte
// 3 (signed) q * 2^24. Tables built at compile time: built per call on the stack, their loads
// waited for the byte stores, a cost at every call of a kernel over few rows (MLA's heads).
struct ByteShuffles {
    alignas(64) int8_t m[4][64];
    constexpr explicit ByteShuffles(int place) : m{} {
        for (int k = 0; k < 4; ++k)
            for (int i = 0; i < 64; ++i)
                m[k][i] = (i & 3) == place ? (int8_t)(4 * k + ((i & 15) >> 2)) : (int8_t)-128;
    }
};
constexpr ByteShuffles BYTE_SHUF0(0), BYTE_SHUF3(3);
EFS_ZI void byte_shuffles(int place, __m512i* mk) {
    const ByteShuffles& t = place == 3 ? BYTE_SHUF3 : BYTE_SHUF0;
    for (int k = 0; k < 4; ++k) mk[k] = _mm512_load_si512((const void*)t.m[k]);
}

// Q6_K as ex_q6_k, one row per vector (R rows at a time, 1 or 2): lanes 0..7 of a row's
// accumulator are the AVX2 kernel's a0, lanes 8..15 its a1, each vector of weights two groups
// of 32 that go to a0 and a1 side by side (Q6Row); the activations come in the matching order
// (xh), so a vector of them is one load, shared by the R rows, and the inserts, broadcasts and
// half scales of the two-row form go.
// Each byte q - 32 is converted as u8f<SIGNED> does, (q - 32) * 2^24 (the block's scales carry
// 2^-24): a byte shuffle and a conversion where the AVX2 kernel's unpack into the mantissa of
// 2^23 takes one and a half shuffles and a subtraction. Per lane the AVX2 kernel's products
// and sums scaled by a power of two, so its bits (a product that would be subnormal unscaled is
// an exact multiple of 2^-149 either way). ex_q6_k_r decodes with Q6Row; ex_q6_k_rg, taken where
// the CPU has GFNI, with Q6RowGF (the bytes q - 32 in six operations a block half, not eleven).
#define EFS_Q6R_NAME ex_q6_k_r
#define EFS_Q6R_ATTR EFS_Z
#define EFS_Q6R_DEC Q6Row
#include "kern_q6_k_r.h"
#undef EFS_Q6R_NAME
#undef EFS_Q6R_ATTR
#undef EFS_Q6R_DEC
#define EFS_Q6R_NAME ex_q6_k_rg
#define EFS_Q6R_ATTR EFS_ZG
#define EFS_Q6R_DEC Q6RowGF
#include "kern_q6_k_r.h"
#undef EFS_Q6R_NAME
#undef EFS_Q6R_ATTR
#undef EFS_Q6R_DEC

// Q5_K as ex_q45_k<NT, true>, one row per vector as ex_q6_k_r: a byte group's 32 quant bytes
// broadcast to both halves, its low nibbles (sub-block 2j, into a0) kept in lanes 0..7 and its
// high ones (2j + 1, a1) in 8..15, the fifth bits shifted per half; converted as the AVX2
// kernel's grp<NT, 0>, the mins as its am. The same bits. (Q4_K keeps kern_avx512.cpp's table
// lookup, faster at one and two tokens than this form without the fifth bits.)
template <int NT, int R>
EFS_Z void ex_q5_k_r(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                      const XPrep* xs, Out out) {
    const int64_t nb = cols / 256;
    const int BYTES = 176;
    const float* xh[NT];
    const float* s32[NT];
    for (int t = 0; t < NT; ++t) { xh[t] = xs[t].xh; s32[t] = xs[t].s32; }
    __m512i mk[4];
    byte_shuffles(0, mk);                            // u8f<0>'s
    const __m512i m4 = _mm512_set1_epi8(0x0F), m10 = _mm512_set1_epi8(0x10);
    const long long s1 = 0x0001000100010001ll;
    const __m512i nib = _mm512_setr_epi64(0, 0, 0, 0, 4 * s1, 4 * s1, 4 * s1, 4 * s1);
    const __m512i fifth = _mm512_setr_epi64(4 * s1, 4 * s1, 4 * s1, 4 * s1, 3 * s1, 3 * s1,
                                            3 * s1, 3 * s1);
    RowCursor<R> rc(W, rb, r0);
    const uint8_t* const* b = rc.b;
    int64_t r = r0;
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
            rc.prefetch(BYTES);
            __m512i hb[R];
            __m512 sv[R];
            for (int j = 0; j < R; ++j) {
                sv[j] = q45_scales_z(b[j]);
                const __m256 mn = lo8(sv[j]);
                for (int t = 0; t < NT; ++t)
                    am[j][t] = _mm256_fmadd_ps(mn, _mm256_loadu_ps(s32[t] + 8 * i), am[j][t]);
                hb[j] = _mm512_broadcast_i64x4(loadu256(b[j] + 16));
            }
            for (int k = 0; k < 4; ++k) {
                __m512 w[R][4], sc[R];
                for (int j = 0; j < R; ++j) {
                    const __m512i qs = _mm512_broadcast_i64x4(loadu256(b[j] + 48 + 32 * k));
                    const __m512i v = _mm512_or_si512(
                        _mm512_and_si512(_mm512_srlv_epi16(qs, nib), m4),
                        _mm512_and_si512(_mm512_sllv_epi16(hb[j], fifth), m10));
                    hb[j] = _mm512_srli_epi16(hb[j], 2);
                    for (int c = 0; c < 4; ++c)
                        w[j][c] = _mm512_cvtepi32_ps(_mm512_shuffle_epi8(v, mk[c]));
                    sc[j] = q45_pair(sv[j], 2 * k, 2 * k + 1);
                }
                for (int t = 0; t < NT; ++t) {
                    const float* x = xh[t] + 256 * i + 64 * k;
                    const __m512 x0 = _mm512_load_ps(x), x1 = _mm512_load_ps(x + 16);
                    const __m512 x2 = _mm512_load_ps(x + 32), x3 = _mm512_load_ps(x + 48);
                    for (int j = 0; j < R; ++j) {
                        __m512 a = _mm512_mul_ps(w[j][0], x0);
                        a = _mm512_fmadd_ps(w[j][1], x1, a);
                        a = _mm512_fmadd_ps(w[j][2], x2, a);
                        a = _mm512_fmadd_ps(w[j][3], x3, a);
                        acc[j][t] = _mm512_fmadd_ps(a, sc[j], acc[j][t]);
                    }
                }
            }
            rc.step(BYTES);
        }
        for (int j = 0; j < R; ++j)
            for (int t = 0; t < NT; ++t)
                out.put(t, r + j, hsum_halves(acc[j][t]) -
                                      hsum(am[j][t]));
    }
    if (R == 2 && r < r1) ex_q5_k_r<NT, 1>(W, rb, r, r1, cols, xs, out);
}

// Q6_K, Q5_K: one row at a time while the pass's activations stay in L1 (x_in_l1), two beyond
// (each activation vector loaded once for both rows): the faster of the two at each size
// (bench/README.md).
template <int NT> EFS_Z void ex_q6_k_z(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1,
                                       int64_t cols, const XPrep* xs, Out o) {
    const bool l1 = x_in_l1(NT, cols, 4);
    if (g_gfni_on) {
        if (l1) ex_q6_k_rg<NT, 1>(W, rb, r0, r1, cols, xs, o);
        else ex_q6_k_rg<NT, 2>(W, rb, r0, r1, cols, xs, o);
    } else {
        if (l1) ex_q6_k_r<NT, 1>(W, rb, r0, r1, cols, xs, o);
        else ex_q6_k_r<NT, 2>(W, rb, r0, r1, cols, xs, o);
    }
}

template <int NT> EFS_Z void ex_q5_k_p(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1,
    int64_t cols, const XPrep* xs, Out o) {
    if (x_in_l1(NT, cols, 4)) ex_q5_k_r<NT, 1>(W, rb, r0, r1, cols, xs, o);
    else ex_q5_k_r<NT, 2>(W, rb, r0, r1, cols, xs, o);
}

// Passes of up to PER (8) tokens, every pass size by the two-row kernels (from one token on they
// beat the AVX2 unit's on this tier).
template <int PER, template <int> class K>
EFS_Z void rows_kz(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                   const XPrep* xs, int nt, float* y, int64_t ys, float alpha, int accumulate) {
    for (int t0 = 0; t0 < nt; t0 += PER) {
        const int n = nt - t0 < PER ? nt - t0 : PER;
        const Out o{y + (int64_t)t0 * ys, ys, alpha, accumulate};
        const XPrep* x = xs + t0;
        switch (n) {
            case 1: K<1>::run(W, rb, r0, r1, cols, x, o); break;
            case 2: K<2>::run(W, rb, r0, r1, cols, x, o); break;
            case 3: K<3>::run(W, rb, r0, r1, cols, x, o); break;
            case 4: K<4>::run(W, rb, r0, r1, cols, x, o); break;
            case 5: K<5>::run(W, rb, r0, r1, cols, x, o); break;
            case 6: K<6>::run(W, rb, r0, r1, cols, x, o); break;
            case 7: K<7>::run(W, rb, r0, r1, cols, x, o); break;
            default: K<8>::run(W, rb, r0, r1, cols, x, o); break;
        }
    }
}

#define EFS_KZ_KERN(name)                                                                      \
    template <int NT> struct K_##name {                                                         \
        EFS_ZI static void run(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1,           \
                               int64_t cols, const XPrep* xs, Out o) {                          \
            name<NT>(W, rb, r0, r1, cols, xs, o);                                              \
        }                                                                                       \
    };
EFS_KZ_KERN(ex_q5_k_p) EFS_KZ_KERN(ex_q6_k_z)

// --- q8 mode: Q2_K ... Q6_K against Q8_K activations ----------------------------------------
//
// Q2_K and Q3_K (and the rows of Q4_K ... Q6_K left after the pairs below) take the shared
// header's q8 kernels (kern_k_avx2.h) in passes of up to 8 tokens.

// --- q8 mode: two rows per 512-bit vector (Q4_K, Q5_K, Q6_K) ------------------------------
//
// As the exact kernels above: lanes 0..7 of every vector are row r's lanes of the 256-bit
// kernels of kern_k_avx2.h, lanes 8..15 row r + 1's; each token's 32 activation bytes are loaded
// once and broadcast to both halves, so a maddubs/madd pair does both rows' products. The
// integer sums of each half are those of the 256-bit kernel, the float steps the same per
// lane, and each half ends in that kernel's hsum(acc) (- accm): its results bit for bit.

EFS_ZI __m512i y2(const int8_t* p) {                       // [32 bytes at p | the same]
    return _mm512_broadcast_i64x4(loadu256((const uint8_t*)p));
}

EFS_ZI __m512i pair16_2(int a, int b, int c, int e) {     // [pair16(a, b) | pair16(c, e)]
    return _mm512_inserti64x4(_mm512_castsi256_si512(pair16(a, b)), pair16(c, e), 1);
}

template <int NT>
EFS_ZI void put_q8_2(Out out, int64_t r, const __m512* acc, const float* m0, const float* m1) {
    for (int t = 0; t < NT; ++t) {
        out.put(t, r, hsum(lo8(acc[t])) - (m0 ? m0[t] : 0.f));
        out.put(t, r + 1, hsum(hi8(acc[t])) - (m1 ? m1[t] : 0.f));
    }
}

template <int NT, bool FIVE>
EFS_Z void q8_q45_k_z2(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                       const XPrep* xs, Out out) {
    const int64_t nb = cols / 256;
    const int BYTES = FIVE ? 176 : 144;
    const Q8K* y[NT];
    for (int t = 0; t < NT; ++t) y[t] = (const Q8K*)xs[t].q;
    PfPair pf(rb);
    int64_t r = r0;
    for (; r + 2 <= r1; r += 2) {
        const uint8_t* b0 = W + r * rb;
        const uint8_t* b1 = b0 + rb;
        __m512 acc[NT];
        float accm0[NT], accm1[NT];
        for (int t = 0; t < NT; ++t) { acc[t] = _mm512_setzero_ps(); accm0[t] = accm1[t] = 0.f; }
        for (int64_t i = 0; i < nb; ++i, b0 += BYTES, b1 += BYTES) {
            pf.next(b0, b1, BYTES);
            uint32_t u0[4], u1[4];
            k4_scales(b0 + 4, u0);
            k4_scales(b1 + 4, u1);
            const uint8_t* sc0 = (const uint8_t*)&u0[0];
            const uint8_t* sc1 = (const uint8_t*)&u1[0];
            const float dmin0 = f16(b0 + 2), d0 = f16(b0), dmin1 = f16(b1 + 2), d1 = f16(b1);
            __m512i sumi[NT];
            for (int t = 0; t < NT; ++t) {
                accm0[t] += y[t][i].d * dmin0 * (float)k4_msum(u0[2], u0[3], y[t][i].bsums);
                accm1[t] += y[t][i].d * dmin1 * (float)k4_msum(u1[2], u1[3], y[t][i].bsums);
                sumi[t] = _mm512_setzero_si512();
            }
            const int qo = FIVE ? 48 : 16;
            __m512i hb = FIVE ? ld2(b0 + 16, b1 + 16) : _mm512_setzero_si512();
            for (int j = 0; j < 4; ++j) {
                __m512i lo, hi;
                q45_planes2<FIVE>(ld2(b0 + qo + 32 * j, b1 + qo + 32 * j), hb, lo, hi);
                const __m512i sl = pair16_2(sc0[2 * j], sc0[2 * j], sc1[2 * j], sc1[2 * j]);
                const __m512i sh = pair16_2(sc0[2 * j + 1], sc0[2 * j + 1], sc1[2 * j + 1],
                                            sc1[2 * j + 1]);
                for (int t = 0; t < NT; ++t) {
                    const int8_t* q8 = y[t][i].qs;
                    const __m512i pl = _mm512_madd_epi16(sl, _mm512_maddubs_epi16(
                        lo, y2(q8 + 64 * j)));
                    const __m512i ph = _mm512_madd_epi16(sh, _mm512_maddubs_epi16(
                        hi, y2(q8 + 64 * j + 32)));
                    sumi[t] = _mm512_add_epi32(sumi[t], _mm512_add_epi32(pl, ph));
                }
            }
            for (int t = 0; t < NT; ++t)
                acc[t] = _mm512_fmadd_ps(ps2(_mm256_set1_ps(y[t][i].d * d0),
                                             _mm256_set1_ps(y[t][i].d * d1)),
                                         _mm512_cvtepi32_ps(sumi[t]), acc[t]);
        }
        put_q8_2<NT>(out, r, acc, accm0, accm1);
    }
    if (r < r1) q8_q45_k<NT, FIVE>(W, rb, r, r1, cols, xs, out);
}

template <int NT>
EFS_Z void q8_q6_k_z2(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                      const XPrep* xs, Out out) {
    const int64_t nb = cols / 256;
    const Q8K* y[NT];
    for (int t = 0; t < NT; ++t) y[t] = (const Q8K*)xs[t].q;
    const __m512i m32 = _mm512_set1_epi8(32);
    PfPair pf(rb);
    int64_t r = r0;
    for (; r + 2 <= r1; r += 2) {
        const uint8_t* b0 = W + r * rb;
        const uint8_t* b1 = b0 + rb;
        __m512 acc[NT];
        for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
        for (int64_t i = 0; i < nb; ++i, b0 += 210, b1 += 210) {
            pf.next(b0, b1, 210);
            const int8_t* sc0 = (const int8_t*)(b0 + 192);
            const int8_t* sc1 = (const int8_t*)(b1 + 192);
            __m512i sumi[NT];
            for (int t = 0; t < NT; ++t) sumi[t] = _mm512_setzero_si512();
            for (int h = 0; h < 2; ++h) {
                __m512i q[4];
                q6_planes2(b0, b1, h, q);
                for (int k = 0; k < 4; ++k) {
                    const int c = 8 * h + 2 * k;
                    const __m512i s = pair16_2(sc0[c], sc0[c + 1], sc1[c], sc1[c + 1]);
                    for (int t = 0; t < NT; ++t) {
                        const __m512i yv = y2(y[t][i].qs + 128 * h + 32 * k);
                        const __m512i p = _mm512_sub_epi16(_mm512_maddubs_epi16(q[k], yv),
                                                           _mm512_maddubs_epi16(m32, yv));
                        sumi[t] = _mm512_add_epi32(sumi[t], _mm512_madd_epi16(s, p));
                    }
                }
            }
            const float d0 = f16(b0 + 208), d1 = f16(b1 + 208);
            for (int t = 0; t < NT; ++t)
                acc[t] = _mm512_fmadd_ps(ps2(_mm256_set1_ps(y[t][i].d * d0),
                                             _mm256_set1_ps(y[t][i].d * d1)),
                                         _mm512_cvtepi32_ps(sumi[t]), acc[t]);
        }
        put_q8_2<NT>(out, r, acc, nullptr, nullptr);
    }
    if (r < r1) q8_q6_k<NT>(W, rb, r, r1, cols, xs, out);
}


// Passes of up to 8 tokens. One token goes to the AVX2 kernel where the kernel has only
// tokens to share (ONE 0), to the kernel itself where it shares its loads between two rows.
// Q4_K / Q5_K against Q8_K one row per vector: the 32 quant bytes of a pair of sub-blocks
// broadcast to both halves, the low nibbles (sub-block 2j) kept in lanes 0..7 of the sums and
// the high ones (2j + 1) in 8..15, against 64 activation bytes in one load; Q5_K's fifth bits
// shifted per half. Per block the halves are added (exact integers) into the AVX2 kernel's 8
// lanes, then its float steps and its mins: its bits.
template <int NT, bool FIVE>
EFS_Z void q8_q45_k_r(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                      const XPrep* xs, Out out) {
    const int64_t nb = cols / 256;
    const int BYTES = FIVE ? 176 : 144;
    const Q8K* y[NT];
    for (int t = 0; t < NT; ++t) y[t] = (const Q8K*)xs[t].q;
    const __m512i m4 = _mm512_set1_epi8(0x0F), m10 = _mm512_set1_epi8(0x10);
    const long long s1 = 0x0001000100010001ll;
    const __m512i nib = _mm512_setr_epi64(0, 0, 0, 0, 4 * s1, 4 * s1, 4 * s1, 4 * s1);
    const __m512i fifth = _mm512_setr_epi64(4 * s1, 4 * s1, 4 * s1, 4 * s1, 3 * s1, 3 * s1,
                                            3 * s1, 3 * s1);
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
            __m512i sumi[NT];
            for (int t = 0; t < NT; ++t) {
                accm[t] += y[t][i].d * dmin * (float)k4_msum(u[2], u[3], y[t][i].bsums);
                sumi[t] = _mm512_setzero_si512();
            }
            __m512i hb = FIVE ? _mm512_broadcast_i64x4(loadu256(b + 16)) : _mm512_setzero_si512();
            for (int k = 0; k < 4; ++k) {
                const __m512i qs = _mm512_broadcast_i64x4(loadu256(b + (FIVE ? 48 : 16) + 32 * k));
                __m512i v = _mm512_and_si512(_mm512_srlv_epi16(qs, nib), m4);
                if (FIVE) {
                    v = _mm512_or_si512(v, _mm512_and_si512(_mm512_sllv_epi16(hb, fifth), m10));
                    hb = _mm512_srli_epi16(hb, 2);
                }
                const __m512i s = _mm512_inserti64x4(_mm512_set1_epi16(sc[2 * k]),
                                                     _mm256_set1_epi16(sc[2 * k + 1]), 1);
                for (int t = 0; t < NT; ++t) {
                    const __m512i yv = _mm512_loadu_si512((const void*)(y[t][i].qs + 64 * k));
                    sumi[t] = _mm512_add_epi32(sumi[t],
                                               _mm512_madd_epi16(s, _mm512_maddubs_epi16(v, yv)));
                }
            }
            for (int t = 0; t < NT; ++t) {
                const __m256i s8 = _mm256_add_epi32(_mm512_castsi512_si256(sumi[t]),
                                                    _mm512_extracti64x4_epi64(sumi[t], 1));
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(y[t][i].d * d), _mm256_cvtepi32_ps(s8),
                                         acc[t]);
            }
        }
        for (int t = 0; t < NT; ++t) out.put(t, r, hsum(acc[t]) - accm[t]);
    }
}

// Q4_K / Q5_K in q8 mode: one or two tokens whose activation bytes fit 16 KiB one row per
// vector, the rest in the two-row form (faster from 4 tokens, and on wider rows: the one-row
// form re-reads the activations for every row). Measured in bench/README.md.
template <int NT, bool FIVE>
EFS_Z void q8_q45_k_z(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                      const XPrep* xs, Out out) {
    if (NT <= 2 && x_in_l1(NT, cols, 1)) q8_q45_k_r<NT, FIVE>(W, rb, r0, r1, cols, xs, out);
    else q8_q45_k_z2<NT, FIVE>(W, rb, r0, r1, cols, xs, out);
}

template <int NT> EFS_Z void q8_q4_k_z(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1,
    int64_t cols, const XPrep* xs, Out o) { q8_q45_k_z<NT, false>(W, rb, r0, r1, cols, xs, o); }
template <int NT> EFS_Z void q8_q5_k_z(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1,
    int64_t cols, const XPrep* xs, Out o) { q8_q45_k_z<NT, true>(W, rb, r0, r1, cols, xs, o); }

// Q6_K against Q8_K one row per vector, as the exact ex_q6_k_r: a block half's two groups
// q[2p], q[2p + 1] side by side (lanes 0..7 of the integer sums are those of q[2p]'s bytes,
// 8..15 of q[2p + 1]'s), each token's 64 activation bytes of them one load, the 16 scales
// widened once per block and each vector's four taken by one permutation. Per block the two
// halves of the sums are added (exact integers) into the AVX2 kernel's 8 lanes, then the same
// float steps: its bits. R rows at a time (1 or 2), each activation vector loaded once for
// all.
template <int NT, int R>
EFS_Z void q8_q6_k_r(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                     const XPrep* xs, Out out) {
    const int64_t nb = cols / 256;
    const Q8K* y[NT];
    for (int t = 0; t < NT; ++t) y[t] = (const Q8K*)xs[t].q;
    const Q6Row dec;
    const __m512i m32 = _mm512_set1_epi8(32);
    const long long s1 = 0x0001000100010001ll;
    // scale of 128-bit lane L of group pair (h, p): 8h + 4p + L
    const __m512i lane = _mm512_setr_epi64(0, 0, s1, s1, 2 * s1, 2 * s1, 3 * s1, 3 * s1);
    RowCursor<R> rc(W, rb, r0);
    const uint8_t* const* b = rc.b;
    int64_t r = r0;
    for (; r + R <= r1; r += R) {
        rc.at(W, rb, r);
        __m256 acc[R][NT];
        for (int j = 0; j < R; ++j)
            for (int t = 0; t < NT; ++t) acc[j][t] = _mm256_setzero_ps();
        for (int64_t i = 0; i < nb; ++i) {
            rc.prefetch(210);
            __m512i sc[R], sumi[R][NT];
            for (int j = 0; j < R; ++j) {
                sc[j] = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(loadu128(b[j] + 192)));
                for (int t = 0; t < NT; ++t) sumi[j][t] = _mm512_setzero_si512();
            }
            for (int h = 0; h < 2; ++h) {
                __m512i q[R][2];
                for (int j = 0; j < R; ++j) dec.planes(b[j], h, q[j]);
                for (int p = 0; p < 2; ++p) {
                    const __m512i idx = _mm512_add_epi16(lane, _mm512_set1_epi16(
                        (short)(8 * h + 4 * p)));
                    __m512i s[R];
                    for (int j = 0; j < R; ++j) s[j] = _mm512_permutexvar_epi16(idx, sc[j]);
                    for (int t = 0; t < NT; ++t) {
                        const __m512i yv = _mm512_loadu_si512(
                            (const void*)(y[t][i].qs + 128 * h + 64 * p));
                        const __m512i my = _mm512_maddubs_epi16(m32, yv);
                        for (int j = 0; j < R; ++j) {
                            const __m512i pq = _mm512_sub_epi16(
                                _mm512_maddubs_epi16(q[j][p], yv), my);
                            sumi[j][t] = _mm512_add_epi32(sumi[j][t],
                                                          _mm512_madd_epi16(s[j], pq));
                        }
                    }
                }
            }
            for (int j = 0; j < R; ++j) {
                const float d = f16(b[j] + 208);
                for (int t = 0; t < NT; ++t) {
                    const __m256i s8 = _mm256_add_epi32(_mm512_castsi512_si256(sumi[j][t]),
                                                        _mm512_extracti64x4_epi64(sumi[j][t], 1));
                    acc[j][t] = _mm256_fmadd_ps(_mm256_set1_ps(y[t][i].d * d),
                                                _mm256_cvtepi32_ps(s8), acc[j][t]);
                }
            }
            rc.step(210);
        }
        for (int j = 0; j < R; ++j)
            for (int t = 0; t < NT; ++t) out.put(t, r + j, hsum(acc[j][t]));
    }
    if (R == 2 && r < r1) q8_q6_k_r<NT, 1>(W, rb, r, r1, cols, xs, out);
}

// Q6_K in q8 mode: up to 4 tokens one row per vector (one row at a time while the pass's
// activation bytes fit 16 KiB, two beyond), more in the two-row form, whose decode of both
// rows serves all 8 tokens' sums at once: each the faster at its size (bench/README.md).
template <int NT>
EFS_Z void q8_q6_k_z(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                     const XPrep* xs, Out out) {
    if (NT > 4) q8_q6_k_z2<NT>(W, rb, r0, r1, cols, xs, out);
    else if (x_in_l1(NT, cols, 1)) q8_q6_k_r<NT, 1>(W, rb, r0, r1, cols, xs, out);
    else q8_q6_k_r<NT, 2>(W, rb, r0, r1, cols, xs, out);
}

#define EFS_KZ_Q8_ROWS(name, TYPE, ONE)                                                          \
    EFS_Z void rows_##name(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols, \
                           const XPrep* xs, int nt, float* y, int64_t ys, float alpha,          \
                           int accumulate) {                                                    \
        static const RowsFn avx2 = avx2_rows(TYPE, 1);                                          \
        for (int t0 = 0; t0 < nt; t0 += 8) {                                                    \
            const int n = nt - t0 < 8 ? nt - t0 : 8;                                            \
            float* yt = y + (int64_t)t0 * ys;                                                   \
            const Out o{yt, ys, alpha, accumulate};                                             \
            switch (n) {                                                                        \
                case 1:                                                                         \
                    if (ONE) { name<1>(W, rb, r0, r1, cols, xs + t0, o); break; }               \
                    avx2(W, rb, r0, r1, cols, xs + t0, n, yt, ys, alpha, accumulate);           \
                    break;                                                                      \
                case 2: name<2>(W, rb, r0, r1, cols, xs + t0, o); break;                        \
                case 3: name<3>(W, rb, r0, r1, cols, xs + t0, o); break;                        \
                case 4: name<4>(W, rb, r0, r1, cols, xs + t0, o); break;                        \
                case 5: name<5>(W, rb, r0, r1, cols, xs + t0, o); break;                        \
                case 6: name<6>(W, rb, r0, r1, cols, xs + t0, o); break;                        \
                case 7: name<7>(W, rb, r0, r1, cols, xs + t0, o); break;                        \
                case 8: name<8>(W, rb, r0, r1, cols, xs + t0, o); break;                        \
                default: break;                                                                 \
            }                                                                                   \
        }                                                                                       \
    }

EFS_KZ_Q8_ROWS(q8_q4_k_z, T_Q4_K, 1) EFS_KZ_Q8_ROWS(q8_q5_k_z, T_Q5_K, 1)
EFS_KZ_Q8_ROWS(q8_q6_k_z, T_Q6_K, 1) EFS_KZ_Q8_ROWS(q8_q2_k, T_Q2_K, 0)
EFS_KZ_Q8_ROWS(q8_q3_k, T_Q3_K, 0)

}  // namespace

RowsFn avx512_k_rows(int type, int mode) {
    static const bool bw = EFS_CPU_HAS_512("avx512bw");
    if (!bw) return nullptr;
    if (mode == 1) {
        switch (type) {
            case T_Q4_K: return rows_q8_q4_k_z;
            case T_Q5_K: return rows_q8_q5_k_z;
            case T_Q6_K: return rows_q8_q6_k_z;
            case T_Q2_K: return rows_q8_q2_k;
            case T_Q3_K: return rows_q8_q3_k;
            default: return nullptr;
        }
    }
    switch (type) {       // exact Q2_K ... Q4_K, IQ4_XS, IQ4_NL: kern_avx512.cpp's lookups
        case T_Q5_K: return rows_kz<8, K_ex_q5_k_p>;
        case T_Q6_K: return rows_kz<8, K_ex_q6_k_z>;
        default: return nullptr;
    }
}

}  // namespace efs

#else  // not x86

namespace efs {
RowsFn avx512_k_rows(int, int) { return nullptr; }
}  // namespace efs

#endif
