// A 256-weight block of one row as integers, for the panel products that multiply integers
// (qgemm_q8.cpp, q8 mode) or exact small integers in bf16 (qgemm_amx.cpp, exact mode): the
// Q8_K types (Q2_K ... Q6_K, IQ4_XS, the lattice IQ types, TQ1_0, TQ2_0). Included inside an
// anonymous namespace after kern_iq_avx2_types.h and kern_k_avx2.h (EFS_KT set), as they are.
//
// decode_block gives the block's 256 weights as unsigned bytes u (Q2_K's 0..3, Q3_K's 0..7,
// Q4_K/Q5_K's 0..31 and Q6_K's 0..63 as stored, the IQ and ternary types' signed values + 128)
// and the integer multiplier of each group (ls: 8 groups of 32 for Q4_K/Q5_K, else 16 of 16;
// Q3_K's and IQ4_XS's scales less 32), the mins of the types that have them (mn: Q4_K/Q5_K's 8,
// Q2_K's 16; room for 16) and the float scales a (d; the IQ types' d * F) and m (dmin, else 0):
// weight k of group g is a * ls[g] * (u[k] - offset) - m * mn[g], the offset 1 << OFFSET_SHIFT
// (0 for the types with mins), the value ggml's dequantize_row_* gives up to float rounding.
#pragma once

#include <string.h>

namespace efs {
namespace {

// Whether the type has mins (m * mn[g] taken off each weight of group g; Q4_1's and Q5_1's
// block min, w = d q + m, for the panels that take them as blocks of 32).
template <int TYPE>
constexpr bool HAS_MINS = TYPE == T_Q4_K || TYPE == T_Q5_K || TYPE == T_Q2_K ||
                          TYPE == T_Q4_1 || TYPE == T_Q5_1;

// Offset of the stored weights (their 0 is this) as a shift: Q3_K 4 (2), Q6_K 32 (5), the IQ
// and TQ types 128 (7); -1: none (the types with mins, which take the offset's place in the
// block's sum).
template <int TYPE>
constexpr int OFFSET_SHIFT = HAS_MINS<TYPE> ? -1 : TYPE == T_Q3_K ? 2 : TYPE == T_Q6_K ? 5 : 7;

// Weights per group of the multipliers ls (Q4_K/Q5_K 32, else 16).
template <int TYPE>
constexpr int LS_GROUP = TYPE == T_Q4_K || TYPE == T_Q5_K ? 32 : 16;

template <int TYPE>
EFS_TI void decode_block(const uint8_t* b, uint8_t* w, int32_t* ls, int32_t* mn, float* a,
                         float* m) {
    if constexpr (TYPE == T_Q4_K || TYPE == T_Q5_K) {
        constexpr bool FIVE = TYPE == T_Q5_K;
        uint32_t u[4];
        k4_scales(b + 4, u);
        const uint8_t* sc = (const uint8_t*)&u[0];
        const uint8_t* mins = (const uint8_t*)&u[2];
        const uint8_t* q = b + (FIVE ? 48 : 16);
        __m256i hb = FIVE ? loadu256(b + 16) : _mm256_setzero_si256();
        for (int k = 0; k < 4; ++k) {
            __m256i lo, hi;
            q45_planes<FIVE>(loadu256(q + 32 * k), hb, lo, hi);
            _mm256_storeu_si256((__m256i*)(w + 64 * k), lo);
            _mm256_storeu_si256((__m256i*)(w + 64 * k + 32), hi);
        }
        for (int g = 0; g < 8; ++g) {
            ls[g] = sc[g];
            mn[g] = mins[g];
        }
        *a = f16(b);
        *m = f16(b + 2);
    } else if constexpr (TYPE == T_Q2_K) {     // scales[16] (ls | mn << 4), qs[64], d, dmin
        const __m256i m3 = _mm256_set1_epi8(3);
        for (int n = 0; n < 2; ++n) {
            const __m256i Q = loadu256(b + 16 + 32 * n);
            for (int j = 0; j < 4; ++j)
                _mm256_storeu_si256((__m256i*)(w + 128 * n + 32 * j), _mm256_and_si256(
                    _mm256_srl_epi16(Q, _mm_cvtsi32_si128(2 * j)), m3));
        }
        for (int g = 0; g < 16; ++g) {
            ls[g] = b[g] & 15;
            mn[g] = b[g] >> 4;
        }
        *a = f16(b + 80);
        *m = f16(b + 82);
    } else if constexpr (TYPE == T_Q3_K) {     // hmask[32], qs[64], scales[12], d
        const __m256i m3 = _mm256_set1_epi8(3), m04 = _mm256_set1_epi8(4);
        __m256i hb = loadu256(b);
        for (int n = 0; n < 2; ++n) {
            const __m256i Q = loadu256(b + 32 + 32 * n);
            for (int j = 0; j < 4; ++j) {         // the 2 low bits and the hmask bit: 0..7
                _mm256_storeu_si256((__m256i*)(w + 128 * n + 32 * j), _mm256_or_si256(
                    _mm256_and_si256(_mm256_srl_epi16(Q, _mm_cvtsi32_si128(2 * j)), m3),
                    _mm256_and_si256(_mm256_slli_epi16(hb, 2), m04)));
                hb = _mm256_srli_epi16(hb, 1);
            }
        }
        int8_t sc[16];
        q3k_scales(b + 96, sc);
        for (int g = 0; g < 16; ++g) ls[g] = sc[g] - 32;
        *a = f16(b + 108);
        *m = 0.f;
    } else if constexpr (TYPE == T_Q6_K) {
        for (int h = 0; h < 2; ++h) {
            __m256i q[4];
            q6_planes(b, h, q);
            for (int k = 0; k < 4; ++k)
                _mm256_storeu_si256((__m256i*)(w + 128 * h + 32 * k), q[k]);
        }
        const int8_t* sc = (const int8_t*)(b + 192);
        for (int g = 0; g < 16; ++g) ls[g] = sc[g];
        *a = f16(b + 208);
        *m = 0.f;
    } else if constexpr (TYPE == T_IQ4_XS) {
        const __m256i tbl = tbl_iq4nl_s(), k128 = _mm256_set1_epi8((char)0x80);
        for (int ib = 0; ib < 8; ++ib) {
            const __m256i v = _mm256_shuffle_epi8(tbl, nibbles(loadu128(b + 8 + 16 * ib)));
            _mm256_storeu_si256((__m256i*)(w + 32 * ib), _mm256_xor_si256(v, k128));
            ls[2 * ib] = ls[2 * ib + 1] = iq4xs_ls(b, ib) - 32;
        }
        *a = f16(b);
        *m = 0.f;
    } else {
        using D = typename IqOf<TYPE>::D;
        const __m256i k128 = _mm256_set1_epi8((char)0x80);
        for (int ib = 0; ib < 8; ++ib) {
            _mm256_storeu_si256((__m256i*)(w + 32 * ib), _mm256_xor_si256(D::q(b, ib), k128));
            int l0, l1;
            D::ls(b, ib, &l0, &l1);
            ls[2 * ib] = l0;
            ls[2 * ib + 1] = D::PAIR ? l1 : l0;
        }
        *a = D::d(b) * D::F;
        *m = 0.f;
    }
}

// The blocks-of-32 types (Q8_0, Q4_0, IQ4_NL, MXFP4, Q5_0; Q4_1, Q5_1): n blocks (8, fewer at
// the end of a row that is not whole 256-weight panels) from b (the first of them) as 32 n
// bytes u, each weight's value + B32_OFF, the blocks' float scales d and (Q4_1, Q5_1) mins m:
// weight k is d[k / 32] * (u[k] - B32_OFF) + m[k / 32]. The signed types' offset is 128; Q4_1's
// and Q5_1's values are unsigned (0..15, 0..31) and kept as they are, their mins apart.
template <int TYPE>
constexpr int B32_OFF = TYPE == T_Q4_1 || TYPE == T_Q5_1 ? 0 : 128;

template <int TYPE>
constexpr int B32_BYTES = TYPE == T_Q8_0 ? 34 : TYPE == T_MXFP4 ? 17 : TYPE == T_Q5_0 ? 22
                          : TYPE == T_Q4_1 ? 20 : TYPE == T_Q5_1 ? 24 : 18;

// Blocks of 32 in 256-weight panel i of nblk, in rows of cols weights: 8, the last panel of a
// row that is not whole panels fewer.
constexpr int panel_steps(int64_t i, int64_t nblk, int64_t cols) {
    return i + 1 < nblk || cols % 256 == 0 ? 8 : (int)(cols % 256 / 32);
}

// The stored codes of a block of 32 with nibbles (Q4_0, IQ4_NL, Q5_0, Q4_1, Q5_1) at b: 0..15,
// or with qh's fifth bits (Q5_0, Q5_1) 0..31, in element order.
template <int TYPE>
EFS_TI __m256i b32_codes(const uint8_t* b) {
    constexpr bool FIVE = TYPE == T_Q5_0 || TYPE == T_Q5_1;
    constexpr int QS = 2 + (HAS_MINS<TYPE> ? 2 : 0) + (FIVE ? 4 : 0);   // the nibbles' offset
    const __m256i q = nibbles(loadu128(b + QS));
    if constexpr (!FIVE) return q;
    return _mm256_or_si256(q, _mm256_and_si256(bytes_from_bits_32(b + QS - 4),
                                                _mm256_set1_epi8(0x10)));
}

template <int TYPE>
EFS_TI void decode_blocks32(const uint8_t* b, uint8_t* u, float* d, int n = 8,
                            float* m = nullptr) {
    const __m256i k128 = _mm256_set1_epi8((char)0x80);
    for (int k = 0; k < n; ++k, b += B32_BYTES<TYPE>) {
        __m256i w;
        if constexpr (TYPE == T_Q8_0) {
            w = _mm256_xor_si256(loadu256(b + 2), k128);
        } else if constexpr (TYPE == T_Q4_0 || TYPE == T_Q5_0) {   // q - 8 (Q5_0: 16) + 128
            w = _mm256_add_epi8(b32_codes<TYPE>(b), _mm256_set1_epi8(TYPE == T_Q4_0 ? 120 : 112));
        } else if constexpr (TYPE == T_Q4_1 || TYPE == T_Q5_1) {  // q as stored, the min apart
            w = b32_codes<TYPE>(b);
            m[k] = f16(b + 2);
        } else {                                        // IQ4_NL, MXFP4: the table's values
            const __m256i nib = nibbles(loadu128(b + (TYPE == T_MXFP4 ? 1 : 2)));
            w = _mm256_xor_si256(_mm256_shuffle_epi8(
                TYPE == T_IQ4_NL ? tbl_iq4nl_s() : tbl_mxfp4_s(), nib), k128);
        }
        _mm256_storeu_si256((__m256i*)(u + 32 * k), w);
        d[k] = TYPE == T_MXFP4 ? e8m0h(b[0]) : f16(b);
    }
}

}  // namespace
}  // namespace efs
