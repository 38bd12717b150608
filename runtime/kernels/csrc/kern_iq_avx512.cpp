// AVX-512 (F, VL, BW) kernels of the lattice IQ types, TQ1_0 / TQ2_0 and (q8 mode) IQ4_NL,
// used where the CPU has them (ops.cpp checks) and where they beat the AVX2 units
// (kern_iq_avx2.cpp, kern_avx2.cpp); every other type, path and token count keeps its AVX2
// kernel (rows_exz, rows_q8z, avx512_iq_rows say which). Same rules as kern_avx512.cpp: target
// attributes on every function, only <immintrin.h> and C headers. The group decoders are the
// AVX2 unit's (kern_iq_avx2_types.h), inlined here.
//
// The results are the AVX2 kernels' bit for bit, so a model's logits do not depend on the ISA.
//
//  - exact: two rows per vector (kern_avx512_pair.h, as the K-quants' kernels): each row's
//    group decoded by the AVX2 decoder into its half, each activation vector loaded once for
//    both rows, passes of up to 8 tokens (the AVX2 exact kernels take 4), and per half the AVX2
//    kernel's products, scales and sums in its order. Against the AVX2 kernels and the earlier
//    one-row 16-lane form: 0.96-1.12x at one token, 0.98-1.62x at 4-8 (bench/README.md).
//  - q8: two groups (IQ4_NL: two blocks) per vector, integer dot products with the activations
//    (the same int16 pairs as the AVX2 maddubs, so the same saturation, which these weights
//    never reach), times ls by one madd, folded to the AVX2 unit's 8 int32 lanes per block
//    before the same float combination.
#include "kern.h"

#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include "kern_avx512_pair.h"
#include "kern_iq_avx2_types.h"

namespace efs {
namespace {

// --- exact mode ------------------------------------------------------------------------------

// The lattice types whose decoders convert an int8 grid entry per 8 weights (IQ1_S, IQ1_M,
// IQ2_S), by float table instead (kern.h's f_iq1: 8 g + delta; f_iq2s, its signs applied by
// mask): a block's 32 entries' offsets computed in one vector, then each 8 weights of a row one
// load (IQ2_S: the two rows' sign bytes as a 16-lane mask, the negative lanes 0 - g, where
// loading f_bits' sign masks for both rows took an insert and a xor), where the AVX2 decoder
// widens, converts and (IQ1) multiply-adds: the bulk of the exact kernels' time at one token and
// at a prompt's few tokens an expert. The same floats (no grid value is 0, so 0 - g is -g, as
// the sign flip gives), so the same bits. An offset is 4 x the entry, so 8 x it is the entry's
// byte offset (the largest, 16380, fits 16 bits). Tab1<D>: offsets(b, o) a block's, SIGNS:
// signs2(b0, b1, o0) the pair's sign masks after row 0's offsets (one mask load a group, where
// combining the rows' sign bytes took four more instructions), pair(o0, o1, ib, w) group ib's
// 4 x 8 weights of both rows; I8: its first 32 offsets are also those of i8()'s entries (q8
// mode's int8 weights, 8 bytes an entry: twice the offset; IQ1: i_iq1, IQ2_S: its int8 grid of
// magnitudes, MAGS, whose signs neg8 gives as a 64-lane mask straight from the sign bytes).
EFS_ZI __m512i u16_table(const uint16_t (&v)[32]) { return _mm512_loadu_si512(v); }

// lane 4 ib + l of a block's 32 groups of 8: ib = lane / 4, l = lane % 4
alignas(64) const uint16_t GRP4[32] = {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3,
                                       4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7};

EFS_ZI __m512 tab_entry2(const char* t, const uint16_t* o0, const uint16_t* o1, int j) {
    return ps2(_mm256_load_ps((const float*)(t + 8 * (size_t)o0[j])),
               _mm256_load_ps((const float*)(t + 8 * (size_t)o1[j])));
}

template <class D> struct Tab1 {
    static constexpr bool ON = false, I8 = false, SIGNS = false, MAGS = false;
};
template <> struct Tab1<IQ1S> {                  // lane 4 ib + l: qs[4 ib + l], qh[ib]
    static constexpr bool ON = true, I8 = true, SIGNS = false, MAGS = false;
    EFS_ZI static const long long* i8() { return (const long long*)g_iq.i_iq1; }
    EFS_ZI static void offsets(const uint8_t* b, uint16_t* o) {
        static const uint16_t sh[32] = {0, 3, 6, 9, 0, 3, 6, 9, 0, 3, 6, 9, 0, 3, 6, 9,
                                        0, 3, 6, 9, 0, 3, 6, 9, 0, 3, 6, 9, 0, 3, 6, 9};
        const __m512i qs = _mm512_cvtepu8_epi16(loadu256(b + 2));
        const __m512i qh = _mm512_permutexvar_epi16(
            u16_table(GRP4), _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)(b + 34))));
        const __m512i hi = _mm512_and_si512(_mm512_srlv_epi16(qh, u16_table(sh)),
                                            _mm512_set1_epi16(7));        // index bits 8..10
        const __m512i neg = _mm512_srli_epi16(qh, 15);                    // delta's sign
        const __m512i idx = _mm512_or_si512(
            qs, _mm512_or_si512(_mm512_slli_epi16(hi, 8), _mm512_slli_epi16(neg, 11)));
        _mm512_storeu_si512(o, _mm512_slli_epi16(idx, 2));
    }
    EFS_ZI static void pair(const uint16_t* o0, const uint16_t* o1, int ib, __m512* w) {
        const char* t = (const char*)g_iq.f_iq1;
        for (int l = 0; l < 4; ++l) w[l] = tab_entry2(t, o0, o1, 4 * ib + l);
    }
};
template <> struct Tab1<IQ1M> : Tab1<IQ1S> {     // lane j: qs[j], nibble j % 2 of qh[j / 2]
    EFS_ZI static void offsets(const uint8_t* b, uint16_t* o) {
        static const uint16_t half[32] = {0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7,
                                          8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14,
                                          15, 15};
        static const uint16_t sh[32] = {0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4,
                                        0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4};
        const __m512i qs = _mm512_cvtepu8_epi16(loadu256(b));
        const __m512i qh = _mm512_permutexvar_epi16(
            u16_table(half), _mm512_castsi256_si512(_mm256_cvtepu8_epi16(
                                 _mm_loadu_si128((const __m128i*)(b + 32)))));
        // the nibble's bits 0..2 are the index's 8..10 and its bit 3 the delta's sign: bit 11
        const __m512i nib = _mm512_and_si512(_mm512_srlv_epi16(qh, u16_table(sh)),
                                             _mm512_set1_epi16(15));
        _mm512_storeu_si512(o, _mm512_slli_epi16(_mm512_or_si512(qs, _mm512_slli_epi16(nib, 8)),
                                                 2));
    }
};
template <> struct Tab1<IQ2S> {                  // grid: qs[4 ib + l] | bits 2l of qh[ib];
    static constexpr bool ON = true, I8 = true, SIGNS = true;   // signs: byte 4 ib + l
    static constexpr bool MAGS = true;           // q8: the grid's magnitudes, the sign bits
    EFS_ZI static const long long* i8() { return (const long long*)g_iq.iq2s; }
    EFS_ZI static __mmask64 neg8(const uint8_t* b, int ib) {     // groups ib, ib + 1's
        uint64_t m;
        memcpy(&m, b + 34 + 4 * ib, 8);
        return (__mmask64)m;
    }
    // the block's 32 grid offsets
    EFS_ZI static void offsets(const uint8_t* b, uint16_t* o) {
        static const uint16_t sh[32] = {0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6,
                                        0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6};
        const __m512i qs = _mm512_cvtepu8_epi16(loadu256(b + 2));
        const __m512i qh = _mm512_permutexvar_epi16(
            u16_table(GRP4), _mm512_castsi256_si512(_mm256_cvtepu8_epi16(
                                 _mm_loadl_epi64((const __m128i*)(b + 66)))));
        const __m512i hi = _mm512_and_si512(_mm512_srlv_epi16(qh, u16_table(sh)),
                                            _mm512_set1_epi16(3));        // index bits 8..9
        _mm512_storeu_si512(o, _mm512_slli_epi16(_mm512_or_si512(qs, _mm512_slli_epi16(hi, 8)),
                                                 2));
    }
    // the two rows' 32 sign masks (byte j of each row's signs), after row 0's offsets
    EFS_ZI static void signs2(const uint8_t* b0, const uint8_t* b1, uint16_t* o0) {
        _mm512_storeu_si512(o0 + 32, _mm512_or_si512(
            _mm512_cvtepu8_epi16(loadu256(b0 + 34)),
            _mm512_slli_epi16(_mm512_cvtepu8_epi16(loadu256(b1 + 34)), 8)));
    }
    EFS_ZI static void pair(const uint16_t* o0, const uint16_t* o1, int ib, __m512* w) {
        const char* g = (const char*)g_iq.f_iq2s;
        for (int l = 0; l < 4; ++l) {
            const __mmask16 neg = (__mmask16)o0[32 + 4 * ib + l];   // signs2's
            const __m512 e = tab_entry2(g, o0, o1, 4 * ib + l);
            w[l] = _mm512_mask_sub_ps(e, neg, _mm512_setzero_ps(), e);
        }
    }
};

// A block's scales df * ls as floats (slot 2 ib, and 2 ib + 1 for PAIR's second half),
// converted and multiplied in one vector where the AVX2 kernel takes each group's in turn: each
// group's scale vector is then two broadcasts (halves) for the pair, not two extractions,
// conversions, products and broadcasts. The same float products, so the same bits. Types
// without one keep the per-group form.
template <class D> struct Sc { static constexpr bool ON = false; };
EFS_ZI __m512i nibbles2(const uint8_t* p) {       // 8 bytes' low, high nibbles in turn
    const __m128i v = _mm_loadl_epi64((const __m128i*)p);
    const __m512i s = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(v, v));
    return _mm512_and_si512(_mm512_srlv_epi32(s, _mm512_set4_epi32(4, 0, 4, 0)),
                            _mm512_set1_epi32(15));
}
template <> struct Sc<IQ2S> {                    // scale byte ib at 74: its low, high nibble
    static constexpr bool ON = true;
    EFS_ZI static __m512i ls(const uint8_t* b) { return nibbles2(b + 74); }
};
template <> struct Sc<IQ2XS> {                   // the same at 66
    static constexpr bool ON = true;
    EFS_ZI static __m512i ls(const uint8_t* b) { return nibbles2(b + 66); }
};
template <> struct Sc<IQ3S> {                    // nibble ib % 2 of byte 106 + ib / 2, twice
    static constexpr bool ON = true;
    EFS_ZI static __m512i ls(const uint8_t* b) {
        const __m128i v = _mm_shuffle_epi8(_mm_cvtsi32_si128((int)u32_(b + 106)),
                                           _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2,
                                                         3, 3, 3, 3));
        return _mm512_and_si512(_mm512_srlv_epi32(_mm512_cvtepu8_epi32(v),
                                                  _mm512_set4_epi32(4, 4, 0, 0)),
                                _mm512_set1_epi32(15));
    }
};
template <> struct Sc<IQ1S> {                    // bits 12..14 of word ib at 34, twice
    static constexpr bool ON = true;
    EFS_ZI static __m512i ls(const uint8_t* b) {
        const __m512i w = _mm512_castsi256_si512(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(b + 34))));
        return _mm512_and_si512(_mm512_srli_epi32(_mm512_permutexvar_epi32(
            _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7), w), 12),
                                _mm512_set1_epi32(7));
    }
};
template <> struct Sc<IQ1M> {                    // word ib / 2 at 48, bits 6 (ib % 2) + 0, 3
    static constexpr bool ON = true;
    EFS_ZI static __m512i ls(const uint8_t* b) {
        const __m512i w = _mm512_castsi128_si512(
            _mm_cvtepu16_epi32(_mm_loadl_epi64((const __m128i*)(b + 48))));
        return _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(
            _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3), w),
                                                  _mm512_set4_epi32(9, 6, 3, 0)),
                                _mm512_set1_epi32(7));
    }
};
template <> struct Sc<IQ2XXS> {                  // the top 4 bits of group ib's second dword
    static constexpr bool ON = true;
    EFS_ZI static __m512i ls(const uint8_t* b) {
        const __m512i s = _mm512_srli_epi32(_mm512_loadu_si512((const void*)(b + 2)), 28);
        return _mm512_permutexvar_epi32(
            _mm512_setr_epi32(1, 1, 3, 3, 5, 5, 7, 7, 9, 9, 11, 11, 13, 13, 15, 15), s);
    }
};
template <> struct Sc<IQ3XXS> {                  // the top 4 bits of the dword at 66 + 4 ib
    static constexpr bool ON = true;
    EFS_ZI static __m512i ls(const uint8_t* b) {
        const __m512i s = _mm512_castsi256_si512(
            _mm256_srli_epi32(loadu256(b + 66), 28));
        return _mm512_permutexvar_epi32(
            _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7), s);
    }
};
template <class D>
EFS_ZI void block_scales(const uint8_t* b, float df, float* s) {      // 2 x nibble + 1, x df
    const __m512i l = _mm512_add_epi32(_mm512_slli_epi32(Sc<D>::ls(b), 1),
                                       _mm512_set1_epi32(1));
    _mm512_store_ps(s, _mm512_mul_ps(_mm512_set1_ps(df), _mm512_cvtepi32_ps(l)));
}

// A pair's block: Tab1's offsets (and sign masks) into o[0], o[1], Sc's scales into s[0], s[1].
template <class D>
EFS_ZI void prep2(const uint8_t* b0, const uint8_t* b1, uint16_t (*o)[64], float (*s)[16]) {
    if constexpr (Tab1<D>::ON) {
        Tab1<D>::offsets(b0, o[0]);
        Tab1<D>::offsets(b1, o[1]);
        if constexpr (Tab1<D>::SIGNS) Tab1<D>::signs2(b0, b1, o[0]);
    }
    if constexpr (Sc<D>::ON) {
        block_scales<D>(b0, D::d(b0) * D::F, s[0]);
        block_scales<D>(b1, D::d(b1) * D::F, s[1]);
    }
}

// One row per vector, two rows a pass: row r's group ib as [w0 | w2] and [w1 | w3] (its four
// groups of 8), against activations in perm_g32's order (each 32 as x[0..7], x[16..23],
// x[8..15], x[24..31]), so that lanes 0..7 compute the AVX2 kernel's h0 = w0 x0 + w1 x1 and
// lanes 8..15 its h1 = w2 x2 + w3 x3, times [s0 | s1] into one sum whose halves are its a0
// and a1: the AVX2 kernel's products, sums and scales lane for lane, so its bits. Where the
// two-row form loads each activation group of 8 as a broadcast to both rows' halves, this
// one loads 16 activations a plain load for both rows: faster than the two-row form from 4
// tokens on IQ2_XXS, IQ3_XXS and IQ3_S, slower at 1-2 (bench/README.md), so passes of
// XG_FROM_TOKENS or more of the types whose tokens come with perm_g32's copy (exact_layouts'
// X_XG) take it (ex_iq_z2's ONE); IQ1_S and IQ1_M gained nothing. R1: the decoders it can take
// (each row's weights from D::w, one scale a group of 32).
template <class D> constexpr bool R1 = Sc<D>::ON && !D::PAIR && !Tab1<D>::ON;

template <class D>
EFS_ZI void row_w(const uint8_t* b, int ib, __m512* v) {
    __m256 u[4];
    D::w(b, ib, u);
    v[0] = ps2(u[0], u[2]);
    v[1] = ps2(u[1], u[3]);
}

// One token or a few: two rows per vector (kern_avx512_pair.h), or (ONE: R1's types) one row
// per vector as above, two rows a pass. Two rows per vector: each row's group decoded by the
// AVX2 decoder (D::w) into its half, the activations loaded once for both rows, then per half
// the AVX2 kernel's products, scales and sums in its order, so its bits. Rows in pairs only: a
// last odd row is left to the caller (rows_exz gives it to the AVX2 kernel).
template <int NT, class D, bool ONE = false>
EFS_Z void ex_iq_z2(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                    const XPrep* xs, Out out) {
    static_assert(!ONE || R1<D>, "one row: R1's types");
    const int64_t nb = cols / 256;
    const float* xv[NT];
    for (int t = 0; t < NT; ++t) xv[t] = ONE ? xs[t].xg : xs[t].x;
    PfPair pf(rb);
    // Tab1's offsets and Sc's scales of the pair's blocks, built one block ahead (a buffer
    // each): read right after their vector stores, their loads would wait for the stores
    alignas(64) uint16_t ob[2][2][64];
    alignas(64) float sb[2][2][16];
    for (int64_t r = r0; r + 2 <= r1; r += 2) {
        const uint8_t* b0 = W + r * rb;
        const uint8_t* b1 = b0 + rb;
        __m512 a0[NT], a1[NT];
        for (int t = 0; t < NT; ++t) a0[t] = a1[t] = _mm512_setzero_ps();
        prep2<D>(b0, b1, ob[0], sb[0]);
        for (int64_t i = 0; i < nb; ++i, b0 += D::BYTES, b1 += D::BYTES) {
            pf.next(b0, b1, D::BYTES);
            const int cur = (int)(i & 1);
            if (i + 1 < nb) prep2<D>(b0 + D::BYTES, b1 + D::BYTES, ob[cur ^ 1], sb[cur ^ 1]);
            const uint16_t *o0 = ob[cur][0], *o1 = ob[cur][1];
            const float *sc0 = sb[cur][0], *sc1 = sb[cur][1];
            // the per-group form's (types without Sc)
            const float df0 = Sc<D>::ON ? 0.f : D::d(b0) * D::F;
            const float df1 = Sc<D>::ON ? 0.f : D::d(b1) * D::F;
            for (int ib = 0; ib < 8; ++ib) {
                __m512 s0, s1;
                if constexpr (ONE) {                  // one scale a group, a row a vector
                    s0 = _mm512_set1_ps(sc0[2 * ib]);
                    s1 = _mm512_set1_ps(sc1[2 * ib]);
                } else if constexpr (Sc<D>::ON) {
                    s0 = halves(sc0 + 2 * ib, sc1 + 2 * ib);
                    s1 = D::PAIR ? halves(sc0 + 2 * ib + 1, sc1 + 2 * ib + 1) : s0;
                } else {
                    int l00, l01, l10, l11;
                    D::ls(b0, ib, &l00, &l01);
                    D::ls(b1, ib, &l10, &l11);
                    s0 = ps2(_mm256_set1_ps(df0 * (float)l00), _mm256_set1_ps(df1 * (float)l10));
                    s1 = D::PAIR ? ps2(_mm256_set1_ps(df0 * (float)l01),
                                       _mm256_set1_ps(df1 * (float)l11))
                                 : s0;
                }
                __m512 w[4];
                if constexpr (ONE) {                  // [w0 | w2], [w1 | w3] of each row
                    row_w<D>(b0, ib, w);
                    row_w<D>(b1, ib, w + 2);
                } else if constexpr (Tab1<D>::ON) {
                    Tab1<D>::pair(o0, o1, ib, w);
                } else {
                    __m256 u[4], v[4];
                    D::w(b0, ib, u);
                    D::w(b1, ib, v);
                    for (int l = 0; l < 4; ++l) w[l] = ps2(u[l], v[l]);
                }
                for (int t = 0; t < NT; ++t) {
                    const float* x = xv[t] + 256 * i + 32 * ib;
                    __m512 h0, h1;
                    if constexpr (ONE) {              // rows r and r + 1, two plain loads
                        const __m512 xa = _mm512_loadu_ps(x), xb = _mm512_loadu_ps(x + 16);
                        h0 = _mm512_fmadd_ps(w[1], xb, _mm512_mul_ps(w[0], xa));
                        h1 = _mm512_fmadd_ps(w[3], xb, _mm512_mul_ps(w[2], xa));
                    } else {                          // halves h0 and h1 of both rows
                        h0 = _mm512_mul_ps(w[0], bc8(x));
                        h1 = _mm512_mul_ps(w[2], bc8(x + 16));
                        h0 = _mm512_fmadd_ps(w[1], bc8(x + 8), h0);
                        h1 = _mm512_fmadd_ps(w[3], bc8(x + 24), h1);
                    }
                    a0[t] = _mm512_fmadd_ps(h0, s0, a0[t]);
                    a1[t] = _mm512_fmadd_ps(h1, s1, a1[t]);
                }
            }
        }
        if constexpr (ONE) {                          // each sum's halves: a row's a0, a1
            for (int t = 0; t < NT; ++t) {
                out.put(t, r, hsum_halves(a0[t]));
                out.put(t, r + 1, hsum_halves(a1[t]));
            }
        } else {
            put2<NT, false>(out, r, a0, a1, a0);
        }
    }
}

// The smallest pass of tokens that takes the two-row kernel; smaller ones keep the AVX2 kernel,
// as fast or faster there (measured: TQ2_0's cheap decoder gains nothing from the wider
// products at one or two tokens, and loses the insert of each row's half). IQ2_XXS, which was
// in the same case, takes the two-row kernel from one token since its scales are converted a
// block at a time (Sc): measured on Zen 4 (split 512-bit units).
template <class D> constexpr int Z2_FROM = 1;
template <> constexpr int Z2_FROM<TQ2> = 3;

// One pass of n (1-8) tokens through ex_iq_z2.
template <class D, bool ONE>
EFS_ZI void z2_pass(int n, const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                    const XPrep* x, Out o) {
    switch (n) {
        case 1: ex_iq_z2<1, D, ONE>(W, rb, r0, r1, cols, x, o); break;
        case 2: ex_iq_z2<2, D, ONE>(W, rb, r0, r1, cols, x, o); break;
        case 3: ex_iq_z2<3, D, ONE>(W, rb, r0, r1, cols, x, o); break;
        case 4: ex_iq_z2<4, D, ONE>(W, rb, r0, r1, cols, x, o); break;
        case 5: ex_iq_z2<5, D, ONE>(W, rb, r0, r1, cols, x, o); break;
        case 6: ex_iq_z2<6, D, ONE>(W, rb, r0, r1, cols, x, o); break;
        case 7: ex_iq_z2<7, D, ONE>(W, rb, r0, r1, cols, x, o); break;
        default: ex_iq_z2<8, D, ONE>(W, rb, r0, r1, cols, x, o); break;
    }
}

// Passes of up to 8 tokens; a pass below Z2_FROM goes to the AVX2 kernel.
template <class D, int TYPE>
EFS_Z void rows_exz(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                    const XPrep* xs, int nt, float* y, int64_t ys, float alpha, int accumulate) {
    static const RowsFn avx2 = avx2_rows(TYPE, 0);
    for (int t0 = 0; t0 < nt; t0 += 8) {
        const int n = nt - t0 < 8 ? nt - t0 : 8;
        float* yt = y + (int64_t)t0 * ys;
        const XPrep* x = xs + t0;
        if (n < Z2_FROM<D>) {
            avx2(W, rb, r0, r1, cols, x, n, yt, ys, alpha, accumulate);
            continue;
        }
        const Out o{yt, ys, alpha, accumulate};
        if constexpr (R1<D>) {              // xg: prepared where exact_layouts gives X_XG
            if (n >= XG_FROM_TOKENS && x[0].xg)
                z2_pass<D, true>(n, W, rb, r0, r1, cols, x, o);
            else
                z2_pass<D, false>(n, W, rb, r0, r1, cols, x, o);
        } else {
            z2_pass<D, false>(n, W, rb, r0, r1, cols, x, o);
        }
        if ((r1 - r0) & 1)                                              // a last odd row
            avx2(W, rb, r1 - 1, r1, cols, x, n, yt, ys, alpha, accumulate);
    }
}

// --- q8 mode ---------------------------------------------------------------------------------

// int16 lanes: l0 in the first 128 bits, l1, l2, l3 in the next (the bytes of ls4).
EFS_ZI __m512i ls_lanes(uint32_t ls4) {
    const __m512i ctl = _mm512_set_epi32(
        (int)0x80038003, (int)0x80038003, (int)0x80038003, (int)0x80038003,
        (int)0x80028002, (int)0x80028002, (int)0x80028002, (int)0x80028002,
        (int)0x80018001, (int)0x80018001, (int)0x80018001, (int)0x80018001,
        (int)0x80008000, (int)0x80008000, (int)0x80008000, (int)0x80008000);
    return _mm512_shuffle_epi8(_mm512_set1_epi32((int)ls4), ctl);
}

template <int NT, class D>
EFS_Z void q8_iq_z(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                   const XPrep* xs, Out out) {
    const int64_t nb = cols / 256;
    const Q8K* y[NT];
    for (int t = 0; t < NT; ++t) y[t] = (const Q8K*)xs[t].q;
    const char* pf = pf_start(W + r0 * rb);
    const __m512i zero = _mm512_setzero_si512();
    // Tab1<D>::I8: the block's offsets, built one block ahead (as ex_iq_z2's prep2)
    alignas(64) uint16_t ob[2][64];
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* b = W + r * rb;
        __m256 acc[NT];
        for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
        if constexpr (Tab1<D>::I8) Tab1<D>::offsets(b, ob[0]);
        for (int64_t i = 0; i < nb; ++i, b += D::BYTES) {
            pf_next(pf, b + D::BYTES);
            [[maybe_unused]] const uint16_t* o = ob[i & 1];
            if constexpr (Tab1<D>::I8)
                if (i + 1 < nb) Tab1<D>::offsets(b + D::BYTES, ob[(i + 1) & 1]);
            __m512i sumi[NT];
            for (int t = 0; t < NT; ++t) sumi[t] = _mm512_setzero_si512();
            for (int ib = 0; ib < 8; ib += 2) {
                int l0, l1, l2, l3;
                D::ls(b, ib, &l0, &l1);
                D::ls(b, ib + 1, &l2, &l3);
                if (!D::PAIR) { l1 = l0; l3 = l2; }
                const __m512i ls = ls_lanes((uint32_t)l0 | (uint32_t)l1 << 8 |
                                            (uint32_t)l2 << 16 | (uint32_t)l3 << 24);
                __m512i q;
                if constexpr (Tab1<D>::I8)      // groups ib, ib + 1: 8 int8 entries, gathered
                    q = _mm512_i64gather_epi64(_mm512_cvtepu16_epi64(_mm_load_si128(
                        (const __m128i*)(o + 4 * ib))), Tab1<D>::i8(), 2);
                else
                    q = _mm512_inserti64x4(_mm512_castsi256_si512(D::q(b, ib)), D::q(b, ib + 1),
                                           1);
                __m512i aq;                     // |q|, and q's signs for the activations
                __mmask64 neg;
                if constexpr (Tab1<D>::MAGS) {
                    aq = q;
                    neg = Tab1<D>::neg8(b, ib);
                } else {
                    aq = _mm512_abs_epi8(q);
                    neg = _mm512_movepi8_mask(q);
                }
                for (int t = 0; t < NT; ++t) {
                    const __m512i qy = _mm512_loadu_si512((const void*)(y[t][i].qs + 32 * ib));
                    const __m512i p = _mm512_maddubs_epi16(aq, _mm512_mask_sub_epi8(qy, neg, zero,
                                                                                    qy));
                    sumi[t] = _mm512_add_epi32(sumi[t], _mm512_madd_epi16(p, ls));
                }
            }
            const float d = D::d(b);
            for (int t = 0; t < NT; ++t) {
                const __m256i s8 = _mm256_add_epi32(_mm512_castsi512_si256(sumi[t]),
                                                    _mm512_extracti64x4_epi64(sumi[t], 1));
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(y[t][i].d * d * D::F),
                                         _mm256_cvtepi32_ps(s8), acc[t]);
            }
        }
        for (int t = 0; t < NT; ++t) out.put(t, r, hsum(acc[t]));
    }
}

// IQ4_NL (blocks of 32: d, qs[16]) against Q8_0 activations, as the AVX2 unit's vd_b32: per
// block acc += (d * dy) * float(8 int32 sums), then hsum(acc) + 0.
template <int NT>
EFS_Z void q8_iq4nl_z(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                      const XPrep* xs, Out out) {
    const int64_t nb = cols / 32;
    const QX8* y[NT];
    for (int t = 0; t < NT; ++t) y[t] = (const QX8*)xs[t].q;
    const __m512i tbl = _mm512_broadcast_i32x4(_mm_setr_epi8(
        -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113));
    const __m512i zero = _mm512_setzero_si512(), ones = _mm512_set1_epi16(1);
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i dup = _mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3);
    const __m512i sh = _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4);
    const char* pf = pf_start(W + r0 * rb);
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* b = W + r * rb;
        __m256 acc[NT];
        for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 2 <= nb; i += 2, b += 36) {
            pf_next(pf, b + 36);
            // [lo nibbles | hi nibbles] of block i, then of block i + 1, as kvalues
            const __m512i v = _mm512_castsi256_si512(_mm256_set_m128i(loadu128(b + 20),
                                                                      loadu128(b + 2)));
            const __m512i q = _mm512_shuffle_epi8(tbl, _mm512_and_si512(
                _mm512_srlv_epi64(_mm512_permutexvar_epi64(dup, v), sh), m4));
            const __m512i aq = _mm512_abs_epi8(q);
            const __mmask64 neg = _mm512_movepi8_mask(q);
            const float d0 = f16(b), d1 = f16(b + 18);
            for (int t = 0; t < NT; ++t) {
                const QX8* yi = y[t] + i;
                const __m512i qy = _mm512_inserti64x4(
                    _mm512_castsi256_si512(loadu256((const uint8_t*)yi[0].qs)),
                    loadu256((const uint8_t*)yi[1].qs), 1);
                const __m512 p = _mm512_cvtepi32_ps(_mm512_madd_epi16(
                    _mm512_maddubs_epi16(aq, _mm512_mask_sub_epi8(qy, neg, zero, qy)), ones));
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d0 * yi[0].d), _mm512_castps512_ps256(p),
                                         acc[t]);
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d1 * yi[1].d), _mm256_castpd_ps(
                    _mm512_extractf64x4_pd(_mm512_castps_pd(p), 1)), acc[t]);
            }
        }
        if (i < nb) {
            const __m256i q = _mm256_shuffle_epi8(_mm512_castsi512_si256(tbl),
                                                  nibbles(loadu128(b + 2)));
            const __m256i aq = _mm256_sign_epi8(q, q);
            const float d0 = f16(b);
            for (int t = 0; t < NT; ++t) {
                const __m256i qy = loadu256((const uint8_t*)y[t][i].qs);
                const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aq,
                    _mm256_sign_epi8(qy, q)), _mm256_set1_epi16(1));
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d0 * y[t][i].d), _mm256_cvtepi32_ps(p),
                                         acc[t]);
            }
        }
        for (int t = 0; t < NT; ++t) out.put(t, r, hsum(acc[t]) + 0.f);
    }
}

template <class D>
struct Q8Kern {
    template <int NT>
    EFS_ZI static void run(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                           const XPrep* xs, Out o) {
        q8_iq_z<NT, D>(W, rb, r0, r1, cols, xs, o);
    }
};
struct IQ4NL {};
template <>
struct Q8Kern<IQ4NL> {
    template <int NT>
    EFS_ZI static void run(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                           const XPrep* xs, Out o) {
        q8_iq4nl_z<NT>(W, rb, r0, r1, cols, xs, o);
    }
};

// Passes of up to 8 tokens; a pass of one token goes to the AVX2 kernel (measured no faster
// here: no decode is shared then, and 512-bit operations split in two halves cost what two
// 256-bit ones do), but where the gathered table gives the weights (Tab1<D>::I8).
template <class D, int TYPE>
EFS_Z void rows_q8z(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                    const XPrep* xs, int nt, float* y, int64_t ys, float alpha, int accumulate) {
    static const RowsFn avx2 = avx2_rows(TYPE, 1);
    for (int t0 = 0; t0 < nt; t0 += 8) {
        const int n = nt - t0 < 8 ? nt - t0 : 8;
        float* yt = y + (int64_t)t0 * ys;
        const XPrep* x = xs + t0;
        const Out o{yt, ys, alpha, accumulate};
        switch (n) {
            case 1:
                if constexpr (Tab1<D>::I8)
                    Q8Kern<D>::template run<1>(W, rb, r0, r1, cols, x, o);
                else
                    avx2(W, rb, r0, r1, cols, x, 1, yt, ys, alpha, accumulate);
                break;
            case 2: Q8Kern<D>::template run<2>(W, rb, r0, r1, cols, x, o); break;
            case 3: Q8Kern<D>::template run<3>(W, rb, r0, r1, cols, x, o); break;
            case 4: Q8Kern<D>::template run<4>(W, rb, r0, r1, cols, x, o); break;
            case 5: Q8Kern<D>::template run<5>(W, rb, r0, r1, cols, x, o); break;
            case 6: Q8Kern<D>::template run<6>(W, rb, r0, r1, cols, x, o); break;
            case 7: Q8Kern<D>::template run<7>(W, rb, r0, r1, cols, x, o); break;
            default: Q8Kern<D>::template run<8>(W, rb, r0, r1, cols, x, o); break;
        }
    }
}


}  // namespace

RowsFn avx512_iq_rows(int type, int mode) {
    // (IQ4_NL's exact kernel is with the K-quants', kern_k_avx512.cpp)
#define EFS_CASE(T, D) case T: return mode == 1 ? rows_q8z<D, T> : rows_exz<D, T>;
    switch (type) {
        EFS_IQ_DECODERS(EFS_CASE)
        case T_IQ4_NL: return mode == 1 ? rows_q8z<IQ4NL, T_IQ4_NL> : nullptr;
        default: return nullptr;
    }
#undef EFS_CASE
}

}  // namespace efs

#else  // not x86

namespace efs {
RowsFn avx512_iq_rows(int, int) { return nullptr; }
}  // namespace efs

#endif
