// The lattice IQ types' and TQ1_0 / TQ2_0's AVX2 decoders (kern_iq_avx2.cpp describes them),
// shared by the AVX2 unit and the AVX-512 unit (kern_iq_avx512.cpp, whose functions inline them:
// their AVX2 target is a subset of its own). Included only by those units, inside an anonymous
// namespace, as kern_avx2_util.h, so no inline symbol compiled for AVX2 is shared with the
// portable units. Per type D: BYTES, PAIR (a multiplier per 16 weights rather than per 32), F,
// d(b) the block scale, q(b, ib) group ib's 32 signed integer weights, w(b, ib, v) the same as
// 4 x 8 exact floats, ls(b, ib, &l0, &l1) the integer multipliers of its two halves. MAG: the
// type's grid values are unsigned with separate sign bits (IQ2, IQ3), and it also gives
// mag(b, ib), the grid bytes, and sgn(b, ib), their signs as a sign_epi8 vector:
// q = sign_epi8(mag, sgn).
#pragma once

#include "kern_avx2_util.h"

namespace efs {
namespace {

EFS_TI uint16_t u16_(const uint8_t* p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

EFS_TI uint32_t u32_(const uint8_t* p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

EFS_TI __m256i set4x64(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {   // a = lowest
    return _mm256_set_epi64x((long long)d, (long long)c, (long long)b, (long long)a);
}

// 32 explicit sign bits (bit i: element i negative) -> a sign_epi8 vector (0xFF / 0x01).
EFS_TI __m256i sign_bits(const uint8_t* p) {
    return _mm256_or_si256(bytes_from_bits_32(p), _mm256_set1_epi8(1));
}

EFS_TI __m256i ksign4(uint32_t aux) {   // the four 7-bit ksigns indices of a word
    const uint64_t* km = g_iq.ksigns_mask;
    return set4x64(km[aux & 127], km[(aux >> 7) & 127], km[(aux >> 14) & 127],
                   km[(aux >> 21) & 127]);
}

// Exact-mode weights as floats straight from the f_* tables (kern.h): 8 grid floats (or two
// IQ3 entries of 4) with their sign bits flipped by a mask loaded from f_ksigns / f_bits.
EFS_TI __m256 fgrid8(const float* g, int idx, const uint32_t* sg, int s) {
    return _mm256_xor_ps(_mm256_load_ps(g + 8 * idx), _mm256_load_ps((const float*)sg + 8 * s));
}

// The same from the int8 grid (8 bytes an entry, a quarter of the float table's cache
// footprint: IQ2_S's).
EFS_TI __m256 igrid8(const uint64_t* g, int idx) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(g + idx))));
}

EFS_TI __m256 fgrid4x2(const float* g, int i0, int i1, const uint32_t* sg, int s) {
    return _mm256_xor_ps(_mm256_loadu2_m128(g + 4 * i1, g + 4 * i0),
                         _mm256_load_ps((const float*)sg + 8 * s));
}

struct IQ2XXS {
    static constexpr int BYTES = 66;
    static constexpr bool PAIR = false;
    static constexpr bool MAG = true;
    static constexpr float F = 0.125f;
    EFS_TI static float d(const uint8_t* b) { return f16(b); }
    EFS_TI static __m256i mag(const uint8_t* b, int ib) {
        const uint8_t* p = b + 2 + 8 * ib;
        const uint64_t* g = g_iq.iq2xxs;
        return set4x64(g[p[0]], g[p[1]], g[p[2]], g[p[3]]);
    }
    EFS_TI static __m256i sgn(const uint8_t* b, int ib) { return ksign4(u32_(b + 2 + 8 * ib + 4)); }
    EFS_TI static __m256i q(const uint8_t* b, int ib) { return _mm256_sign_epi8(mag(b, ib), sgn(b, ib)); }
    EFS_TI static void w(const uint8_t* b, int ib, __m256* v) {
        const uint8_t* p = b + 2 + 8 * ib;
        const uint32_t aux = u32_(p + 4);
        for (int l = 0; l < 4; ++l)
            v[l] = fgrid8(g_iq.f_iq2xxs, p[l], g_iq.f_ksigns, (aux >> (7 * l)) & 127);
    }
    EFS_TI static void ls(const uint8_t* b, int ib, int* l0, int* l1) {
        *l0 = *l1 = 2 * (int)(u32_(b + 2 + 8 * ib + 4) >> 28) + 1;
    }
};

struct IQ2XS {
    static constexpr int BYTES = 74;
    static constexpr bool PAIR = true;
    static constexpr bool MAG = true;
    static constexpr float F = 0.125f;
    EFS_TI static float d(const uint8_t* b) { return f16(b); }
    EFS_TI static __m256i mag(const uint8_t* b, int ib) {
        const uint8_t* p = b + 2 + 8 * ib;
        const uint64_t* g = g_iq.iq2xs;
        return set4x64(g[u16_(p) & 511], g[u16_(p + 2) & 511], g[u16_(p + 4) & 511],
                       g[u16_(p + 6) & 511]);
    }
    EFS_TI static __m256i sgn(const uint8_t* b, int ib) {
        const uint8_t* p = b + 2 + 8 * ib;
        const uint64_t* km = g_iq.ksigns_mask;
        return set4x64(km[u16_(p) >> 9], km[u16_(p + 2) >> 9], km[u16_(p + 4) >> 9],
                       km[u16_(p + 6) >> 9]);
    }
    EFS_TI static __m256i q(const uint8_t* b, int ib) { return _mm256_sign_epi8(mag(b, ib), sgn(b, ib)); }
    EFS_TI static void w(const uint8_t* b, int ib, __m256* v) {
        const uint8_t* p = b + 2 + 8 * ib;
        for (int l = 0; l < 4; ++l) {
            const int wd = u16_(p + 2 * l);
            v[l] = fgrid8(g_iq.f_iq2xs, wd & 511, g_iq.f_ksigns, wd >> 9);
        }
    }
    EFS_TI static void ls(const uint8_t* b, int ib, int* l0, int* l1) {
        *l0 = 2 * (b[66 + ib] & 0xf) + 1;
        *l1 = 2 * (b[66 + ib] >> 4) + 1;
    }
};

struct IQ2S {
    static constexpr int BYTES = 82;
    static constexpr bool PAIR = true;
    static constexpr bool MAG = true;
    static constexpr float F = 0.125f;
    EFS_TI static float d(const uint8_t* b) { return f16(b); }
    EFS_TI static __m256i mag(const uint8_t* b, int ib) {
        const uint8_t* p = b + 2 + 4 * ib;
        const int h = b[66 + ib];
        const uint64_t* g = g_iq.iq2s;
        return set4x64(g[p[0] | ((h << 8) & 0x300)], g[p[1] | ((h << 6) & 0x300)],
                       g[p[2] | ((h << 4) & 0x300)], g[p[3] | ((h << 2) & 0x300)]);
    }
    EFS_TI static __m256i sgn(const uint8_t* b, int ib) { return sign_bits(b + 34 + 4 * ib); }
    EFS_TI static __m256i q(const uint8_t* b, int ib) { return _mm256_sign_epi8(mag(b, ib), sgn(b, ib)); }
    EFS_TI static void w(const uint8_t* b, int ib, __m256* v) {
        const uint8_t* p = b + 2 + 4 * ib;
        const int h = b[66 + ib];
        for (int l = 0; l < 4; ++l)
            v[l] = _mm256_xor_ps(igrid8(g_iq.iq2s, p[l] | ((h << (8 - 2 * l)) & 0x300)),
                                 _mm256_load_ps((const float*)g_iq.f_bits + 8 * b[34 + 4 * ib + l]));
    }
    EFS_TI static void ls(const uint8_t* b, int ib, int* l0, int* l1) {
        *l0 = 2 * (b[74 + ib] & 0xf) + 1;
        *l1 = 2 * (b[74 + ib] >> 4) + 1;
    }
};

struct IQ3XXS {
    static constexpr int BYTES = 98;
    static constexpr bool PAIR = false;
    static constexpr bool MAG = true;
    static constexpr float F = 0.25f;
    EFS_TI static float d(const uint8_t* b) { return f16(b); }
    EFS_TI static __m256i mag(const uint8_t* b, int ib) {
        const uint8_t* p = b + 2 + 8 * ib;
        const uint32_t* g = g_iq.iq3xxs;
        return _mm256_setr_epi32((int)g[p[0]], (int)g[p[1]], (int)g[p[2]], (int)g[p[3]],
                                 (int)g[p[4]], (int)g[p[5]], (int)g[p[6]], (int)g[p[7]]);
    }
    EFS_TI static __m256i sgn(const uint8_t* b, int ib) { return ksign4(u32_(b + 66 + 4 * ib)); }
    EFS_TI static __m256i q(const uint8_t* b, int ib) { return _mm256_sign_epi8(mag(b, ib), sgn(b, ib)); }
    EFS_TI static void w(const uint8_t* b, int ib, __m256* v) {
        const uint8_t* p = b + 2 + 8 * ib;
        const uint32_t aux = u32_(b + 66 + 4 * ib);
        for (int l = 0; l < 4; ++l)
            v[l] = fgrid4x2(g_iq.f_iq3xxs, p[2 * l], p[2 * l + 1], g_iq.f_ksigns,
                            (aux >> (7 * l)) & 127);
    }
    EFS_TI static void ls(const uint8_t* b, int ib, int* l0, int* l1) {
        *l0 = *l1 = 2 * (int)(u32_(b + 66 + 4 * ib) >> 28) + 1;
    }
};

struct IQ3S {
    static constexpr int BYTES = 110;
    static constexpr bool PAIR = false;
    static constexpr bool MAG = true;
    static constexpr float F = 1.f;
    EFS_TI static float d(const uint8_t* b) { return f16(b); }
    EFS_TI static __m256i mag(const uint8_t* b, int ib) {
        const uint8_t* p = b + 2 + 8 * ib;
        const int h = b[66 + ib];
        const uint32_t* g = g_iq.iq3s;
        return _mm256_setr_epi32(
            (int)g[p[0] | ((h << 8) & 256)], (int)g[p[1] | ((h << 7) & 256)],
            (int)g[p[2] | ((h << 6) & 256)], (int)g[p[3] | ((h << 5) & 256)],
            (int)g[p[4] | ((h << 4) & 256)], (int)g[p[5] | ((h << 3) & 256)],
            (int)g[p[6] | ((h << 2) & 256)], (int)g[p[7] | ((h << 1) & 256)]);
    }
    EFS_TI static __m256i sgn(const uint8_t* b, int ib) { return sign_bits(b + 74 + 4 * ib); }
    EFS_TI static __m256i q(const uint8_t* b, int ib) { return _mm256_sign_epi8(mag(b, ib), sgn(b, ib)); }
    EFS_TI static void w(const uint8_t* b, int ib, __m256* v) {
        const uint8_t* p = b + 2 + 8 * ib;
        const int h = b[66 + ib];
        for (int l = 0; l < 4; ++l)
            v[l] = fgrid4x2(g_iq.f_iq3s, p[2 * l] | ((h << (8 - 2 * l)) & 256),
                            p[2 * l + 1] | ((h << (7 - 2 * l)) & 256), g_iq.f_bits,
                            b[74 + 4 * ib + l]);
    }
    EFS_TI static void ls(const uint8_t* b, int ib, int* l0, int* l1) {
        *l0 = *l1 = 1 + 2 * ((b[106 + ib / 2] >> (4 * (ib % 2))) & 0xf);
    }
};

struct IQ1S {
    static constexpr int BYTES = 50;
    static constexpr bool PAIR = false;
    static constexpr bool MAG = false;
    static constexpr float F = 0.125f;
    EFS_TI static float d(const uint8_t* b) { return f16(b); }
    EFS_TI static __m256i q(const uint8_t* b, int ib) {          // 8 g + delta (i_iq1)
        const uint8_t* p = b + 2 + 4 * ib;
        const int qh = u16_(b + 34 + 2 * ib);
        const uint64_t* g = g_iq.i_iq1 + (qh & 0x8000 ? 2048 : 0);
        return set4x64(g[p[0] | ((qh << 8) & 0x700)], g[p[1] | ((qh << 5) & 0x700)],
                       g[p[2] | ((qh << 2) & 0x700)], g[p[3] | ((qh >> 1) & 0x700)]);
    }
    EFS_TI static void w(const uint8_t* b, int ib, __m256* v) {   // 8 g + delta (f_iq1)
        const uint8_t* p = b + 2 + 4 * ib;
        const int qh = u16_(b + 34 + 2 * ib);
        const float* t = g_iq.f_iq1 + (qh & 0x8000 ? 2048 * 8 : 0);
        for (int l = 0; l < 4; ++l)
            v[l] = _mm256_load_ps(t + 8 * (p[l] | (((qh >> (3 * l)) & 7) << 8)));
    }
    EFS_TI static void ls(const uint8_t* b, int ib, int* l0, int* l1) {
        *l0 = *l1 = 2 * ((u16_(b + 34 + 2 * ib) >> 12) & 7) + 1;
    }
};

struct IQ1M {
    static constexpr int BYTES = 56;
    static constexpr bool PAIR = true;
    static constexpr bool MAG = false;
    static constexpr float F = 0.125f;
    EFS_TI static float d(const uint8_t* b) {
        const uint16_t s0 = u16_(b + 48), s1 = u16_(b + 50), s2 = u16_(b + 52), s3 = u16_(b + 54);
        const uint16_t h = (uint16_t)((s0 >> 12) | ((s1 >> 8) & 0x00f0) | ((s2 >> 4) & 0x0f00) |
                                      (s3 & 0xf000));
        return _cvtsh_ss(h);
    }
    EFS_TI static __m256i q(const uint8_t* b, int ib) {          // 8 g + delta (i_iq1): a
        const uint8_t* p = b + 4 * ib;                            // nibble's bit 3 is the
        const int h0 = b[32 + 2 * ib], h1 = b[33 + 2 * ib];       // delta's sign, entry bit 11
        const uint64_t* g = g_iq.i_iq1;
        return set4x64(g[p[0] | ((h0 & 15) << 8)], g[p[1] | ((h0 >> 4) << 8)],
                       g[p[2] | ((h1 & 15) << 8)], g[p[3] | ((h1 >> 4) << 8)]);
    }
    EFS_TI static void w(const uint8_t* b, int ib, __m256* v) {   // 8 g + delta (f_iq1)
        const uint8_t* p = b + 4 * ib;
        for (int l = 0; l < 4; ++l) {      // the nibble's bit 3 (delta's sign) is f_iq1's 11
            const int h = b[32 + 2 * ib + l / 2] >> (4 * (l % 2));
            v[l] = _mm256_load_ps(g_iq.f_iq1 + 8 * (p[l] | ((h & 15) << 8)));
        }
    }
    EFS_TI static void ls(const uint8_t* b, int ib, int* l0, int* l1) {
        const int sc = u16_(b + 48 + 2 * (ib / 2)) >> (6 * (ib % 2));
        *l0 = 2 * (sc & 7) + 1;
        *l1 = 2 * ((sc >> 3) & 7) + 1;
    }
};

// 32 int8 -> 4 x 8 floats in element order.
EFS_TI void ints_to_floats(__m256i q, __m256* v) {
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    v[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    v[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    v[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    v[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}

// The ternary types: integer weights t - 1 in {-1, 0, 1} (TQ2_0 also 2), one scale per block
// (ls = 1, F = 1), so exact and q8 mode take the lattice types' loops unchanged.
struct TQ2 {
    static constexpr int BYTES = 66;
    static constexpr bool PAIR = false;
    static constexpr bool MAG = false;
    static constexpr float F = 1.f;
    EFS_TI static float d(const uint8_t* b) { return f16(b + 64); }
    EFS_TI static __m256i q(const uint8_t* b, int ib) {
        const __m256i v = _mm256_srl_epi16(loadu256(b + 32 * (ib >> 2)),
                                           _mm_cvtsi32_si128(2 * (ib & 3)));
        return _mm256_sub_epi8(_mm256_and_si256(v, _mm256_set1_epi8(3)), _mm256_set1_epi8(1));
    }
    EFS_TI static void ls(const uint8_t*, int, int* l0, int* l1) { *l0 = *l1 = 1; }
    EFS_TI static void w(const uint8_t* b, int ib, __m256* v) { ints_to_floats(q(b, ib), v); }
};

EFS_TI __m256i mul_u8(__m256i a, __m256i m) {     // a * m mod 256 per byte
    const __m256i lo = _mm256_and_si256(_mm256_mullo_epi16(a, m), _mm256_set1_epi16(0x00FF));
    const __m256i hi = _mm256_slli_epi16(
        _mm256_mullo_epi16(_mm256_srli_epi16(a, 8), _mm256_srli_epi16(m, 8)), 8);
    return _mm256_or_si256(lo, hi);
}

struct TQ1 {
    static constexpr int BYTES = 54;
    static constexpr bool PAIR = false;
    static constexpr bool MAG = false;
    static constexpr float F = 1.f;
    EFS_TI static float d(const uint8_t* b) { return f16(b + 52); }
    // Group ib's 32 bytes to take base-3 digits of and the power of 3 for each.
    EFS_TI static __m256i q(const uint8_t* b, int ib) {
        __m256i src, m;
        if (ib < 5) {
            static const uint8_t pow3[5] = {1, 3, 9, 27, 81};
            src = loadu256(b);
            m = _mm256_set1_epi8((char)pow3[ib]);
        } else {
            const __m128i q1 = loadu128(b + 32);
            if (ib < 7) {
                src = _mm256_set_m128i(q1, q1);
                m = ib == 5 ? _mm256_set_m128i(_mm_set1_epi8(3), _mm_set1_epi8(1))
                            : _mm256_set_m128i(_mm_set1_epi8(27), _mm_set1_epi8(9));
            } else {
                src = _mm256_set_m128i(_mm_set1_epi32((int)u32_(b + 48)), q1);
                m = _mm256_set_m128i(_mm_setr_epi32(0x01010101, 0x03030303, 0x09090909,
                                                    0x1B1B1B1B),
                                     _mm_set1_epi8(81));
            }
        }
        // digit = ((q * 3) >> 8) of the byte q = src * 3^n mod 256: 0 up to 85, 1 up to 170, 2
        const __m256i flip = _mm256_set1_epi8((char)0x80);
        const __m256i s = _mm256_xor_si256(mul_u8(src, m), flip);
        const __m256i c1 = _mm256_cmpgt_epi8(s, _mm256_set1_epi8((char)(85 ^ 0x80)));
        const __m256i c2 = _mm256_cmpgt_epi8(s, _mm256_set1_epi8((char)(170 ^ 0x80)));
        return _mm256_sub_epi8(_mm256_sub_epi8(_mm256_set1_epi8(-1), c1), c2);
    }
    EFS_TI static void ls(const uint8_t*, int, int* l0, int* l1) { *l0 = *l1 = 1; }
    EFS_TI static void w(const uint8_t* b, int ib, __m256* v) { ints_to_floats(q(b, ib), v); }
};

// Every type these decoders cover, as X(type id, decoder): the units' dispatch switches.
#define EFS_IQ_DECODERS(X)                                                                    \
    X(T_IQ2_XXS, IQ2XXS) X(T_IQ2_XS, IQ2XS) X(T_IQ2_S, IQ2S) X(T_IQ3_XXS, IQ3XXS)             \
    X(T_IQ3_S, IQ3S) X(T_IQ1_S, IQ1S) X(T_IQ1_M, IQ1M) X(T_TQ1_0, TQ1) X(T_TQ2_0, TQ2)

// A type id's decoder: IqOf<T_IQ2_XXS>::D is IQ2XXS.
template <int TYPE> struct IqOf;
#define EFS_IQ_OF(T, DEC) template <> struct IqOf<T> { using D = DEC; };
EFS_IQ_DECODERS(EFS_IQ_OF)
#undef EFS_IQ_OF

}  // namespace
}  // namespace efs
