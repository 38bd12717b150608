// AVX2 kernels of the lattice IQ types (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M;
// layouts in kern_iq.cpp). Same rules as kern_avx2.cpp: target attributes on every function,
// only <immintrin.h> and C headers, called only after ops.cpp has checked the CPU.
//
// Every type is written as a decoder of 32 signed integer weights q per group ib (the grid
// entries gathered from the gguf-py tables in g_iq, their signs applied with sign_epi8) and an
// integer multiplier ls per 16 of them, with w = d * F * ls * q for a per-type constant F
// (a power of two). IQ1's grid values g in {-1, 0, 1} plus their delta of +-1/8 enter as the
// odd integers 8 g +- 1 with F = 1/8, so its delta costs nothing extra.
//
// Exact mode: the 32 integers become exact floats (the unpack of kern_avx2.cpp, offset 128)
// and meet the permuted float activations; per group scale * sum(q * x). q8 mode: integer
// dot products with the Q8_K activations (ggml-cpu's ggml_vec_dot_iq*_q8_K numerics: integer
// sums per sub-block times ls, combined in float per block).
#include "kern.h"

#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
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

struct IQ2XXS {
    static constexpr int BYTES = 66;
    static constexpr bool PAIR = false;
    static constexpr float F = 0.125f;
    EFS_TI static float d(const uint8_t* b) { return f16(b); }
    EFS_TI static __m256i q(const uint8_t* b, int ib) {
        const uint8_t* p = b + 2 + 8 * ib;
        const uint64_t* g = g_iq.iq2xxs;
        return _mm256_sign_epi8(set4x64(g[p[0]], g[p[1]], g[p[2]], g[p[3]]), ksign4(u32_(p + 4)));
    }
    EFS_TI static void ls(const uint8_t* b, int ib, int* l0, int* l1) {
        *l0 = *l1 = 2 * (int)(u32_(b + 2 + 8 * ib + 4) >> 28) + 1;
    }
};

struct IQ2XS {
    static constexpr int BYTES = 74;
    static constexpr bool PAIR = true;
    static constexpr float F = 0.125f;
    EFS_TI static float d(const uint8_t* b) { return f16(b); }
    EFS_TI static __m256i q(const uint8_t* b, int ib) {
        const uint8_t* p = b + 2 + 8 * ib;
        const uint16_t w0 = u16_(p), w1 = u16_(p + 2), w2 = u16_(p + 4), w3 = u16_(p + 6);
        const uint64_t* g = g_iq.iq2xs;
        const uint64_t* km = g_iq.ksigns_mask;
        return _mm256_sign_epi8(set4x64(g[w0 & 511], g[w1 & 511], g[w2 & 511], g[w3 & 511]),
                                set4x64(km[w0 >> 9], km[w1 >> 9], km[w2 >> 9], km[w3 >> 9]));
    }
    EFS_TI static void ls(const uint8_t* b, int ib, int* l0, int* l1) {
        *l0 = 2 * (b[66 + ib] & 0xf) + 1;
        *l1 = 2 * (b[66 + ib] >> 4) + 1;
    }
};

struct IQ2S {
    static constexpr int BYTES = 82;
    static constexpr bool PAIR = true;
    static constexpr float F = 0.125f;
    EFS_TI static float d(const uint8_t* b) { return f16(b); }
    EFS_TI static __m256i q(const uint8_t* b, int ib) {
        const uint8_t* p = b + 2 + 4 * ib;
        const int h = b[66 + ib];
        const uint64_t* g = g_iq.iq2s;
        return _mm256_sign_epi8(set4x64(g[p[0] | ((h << 8) & 0x300)], g[p[1] | ((h << 6) & 0x300)],
                                        g[p[2] | ((h << 4) & 0x300)], g[p[3] | ((h << 2) & 0x300)]),
                                sign_bits(b + 34 + 4 * ib));
    }
    EFS_TI static void ls(const uint8_t* b, int ib, int* l0, int* l1) {
        *l0 = 2 * (b[74 + ib] & 0xf) + 1;
        *l1 = 2 * (b[74 + ib] >> 4) + 1;
    }
};

struct IQ3XXS {
    static constexpr int BYTES = 98;
    static constexpr bool PAIR = false;
    static constexpr float F = 0.25f;
    EFS_TI static float d(const uint8_t* b) { return f16(b); }
    EFS_TI static __m256i q(const uint8_t* b, int ib) {
        const uint8_t* p = b + 2 + 8 * ib;
        const uint32_t* g = g_iq.iq3xxs;
        const __m256i v = _mm256_setr_epi32((int)g[p[0]], (int)g[p[1]], (int)g[p[2]], (int)g[p[3]],
                                            (int)g[p[4]], (int)g[p[5]], (int)g[p[6]], (int)g[p[7]]);
        return _mm256_sign_epi8(v, ksign4(u32_(b + 66 + 4 * ib)));
    }
    EFS_TI static void ls(const uint8_t* b, int ib, int* l0, int* l1) {
        *l0 = *l1 = 2 * (int)(u32_(b + 66 + 4 * ib) >> 28) + 1;
    }
};

struct IQ3S {
    static constexpr int BYTES = 110;
    static constexpr bool PAIR = false;
    static constexpr float F = 1.f;
    EFS_TI static float d(const uint8_t* b) { return f16(b); }
    EFS_TI static __m256i q(const uint8_t* b, int ib) {
        const uint8_t* p = b + 2 + 8 * ib;
        const int h = b[66 + ib];
        const uint32_t* g = g_iq.iq3s;
        const __m256i v = _mm256_setr_epi32(
            (int)g[p[0] | ((h << 8) & 256)], (int)g[p[1] | ((h << 7) & 256)],
            (int)g[p[2] | ((h << 6) & 256)], (int)g[p[3] | ((h << 5) & 256)],
            (int)g[p[4] | ((h << 4) & 256)], (int)g[p[5] | ((h << 3) & 256)],
            (int)g[p[6] | ((h << 2) & 256)], (int)g[p[7] | ((h << 1) & 256)]);
        return _mm256_sign_epi8(v, sign_bits(b + 74 + 4 * ib));
    }
    EFS_TI static void ls(const uint8_t* b, int ib, int* l0, int* l1) {
        *l0 = *l1 = 1 + 2 * ((b[106 + ib / 2] >> (4 * (ib % 2))) & 0xf);
    }
};

EFS_TI __m256i times8(__m256i g) {      // int8 g in {-1, 0, 1} -> 8 g
    const __m256i g2 = _mm256_add_epi8(g, g), g4 = _mm256_add_epi8(g2, g2);
    return _mm256_add_epi8(g4, g4);
}

struct IQ1S {
    static constexpr int BYTES = 50;
    static constexpr bool PAIR = false;
    static constexpr float F = 0.125f;
    EFS_TI static float d(const uint8_t* b) { return f16(b); }
    EFS_TI static __m256i q(const uint8_t* b, int ib) {
        const uint8_t* p = b + 2 + 4 * ib;
        const int qh = u16_(b + 34 + 2 * ib);
        const uint64_t* g = g_iq.iq1s;
        const __m256i v = set4x64(g[p[0] | ((qh << 8) & 0x700)], g[p[1] | ((qh << 5) & 0x700)],
                                  g[p[2] | ((qh << 2) & 0x700)], g[p[3] | ((qh >> 1) & 0x700)]);
        return _mm256_add_epi8(times8(v), _mm256_set1_epi8(qh & 0x8000 ? -1 : 1));
    }
    EFS_TI static void ls(const uint8_t* b, int ib, int* l0, int* l1) {
        *l0 = *l1 = 2 * ((u16_(b + 34 + 2 * ib) >> 12) & 7) + 1;
    }
};

struct IQ1M {
    static constexpr int BYTES = 56;
    static constexpr bool PAIR = true;
    static constexpr float F = 0.125f;
    EFS_TI static float d(const uint8_t* b) {
        const uint16_t s0 = u16_(b + 48), s1 = u16_(b + 50), s2 = u16_(b + 52), s3 = u16_(b + 54);
        const uint16_t h = (uint16_t)((s0 >> 12) | ((s1 >> 8) & 0x00f0) | ((s2 >> 4) & 0x0f00) |
                                      (s3 & 0xf000));
        return _cvtsh_ss(h);
    }
    EFS_TI static __m256i q(const uint8_t* b, int ib) {
        const uint8_t* p = b + 4 * ib;
        const int h0 = b[32 + 2 * ib], h1 = b[33 + 2 * ib];
        const uint64_t* g = g_iq.iq1s;
        const __m256i v = set4x64(g[p[0] | ((h0 << 8) & 0x700)], g[p[1] | ((h0 << 4) & 0x700)],
                                  g[p[2] | ((h1 << 8) & 0x700)], g[p[3] | ((h1 << 4) & 0x700)]);
        const uint64_t neg = ~0ull, pos = 0x0101010101010101ull;
        const __m256i delta = set4x64(h0 & 0x08 ? neg : pos, h0 & 0x80 ? neg : pos,
                                      h1 & 0x08 ? neg : pos, h1 & 0x80 ? neg : pos);
        return _mm256_add_epi8(times8(v), delta);
    }
    EFS_TI static void ls(const uint8_t* b, int ib, int* l0, int* l1) {
        const int sc = u16_(b + 48 + 2 * (ib / 2)) >> (6 * (ib % 2));
        *l0 = 2 * (sc & 7) + 1;
        *l1 = 2 * ((sc >> 3) & 7) + 1;
    }
};

// --- exact mode ------------------------------------------------------------------------------

template <int NT, class D>
EFS_T void ex_iq(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                 const XPrep* xs, Out out) {
    const int64_t nb = cols / 256;
    const float* xp[NT];
    for (int t = 0; t < NT; ++t) xp[t] = xs[t].xp;
    const __m256 moff = magic(128.f);
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    const int64_t ahead = pf_ahead(rb);
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* b = W + r * rb;
        pf_row(b + ahead * rb, rb);
        __m256 a0[NT], a1[NT];
        for (int t = 0; t < NT; ++t) a0[t] = a1[t] = _mm256_setzero_ps();
        for (int64_t i = 0; i < nb; ++i, b += D::BYTES) {
            const float df = D::d(b) * D::F;
            for (int ib = 0; ib < 8; ++ib) {
                int l0, l1;
                D::ls(b, ib, &l0, &l1);
                const __m256 sc = D::PAIR ? _mm256_set_m128(_mm_set1_ps(df * (float)l1),
                                                            _mm_set1_ps(df * (float)l0))
                                          : _mm256_set1_ps(df * (float)l0);
                const __m256i v = _mm256_xor_si256(D::q(b, ib), flip);
                grp<NT>(v, moff, xp, 256 * i + 32 * ib, sc, ib & 1 ? a1 : a0);
            }
        }
        for (int t = 0; t < NT; ++t) out.put(t, r, hsum(_mm256_add_ps(a0[t], a1[t])));
    }
}

template <class D>
EFS_T void rows_ex(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                   const XPrep* xs, int nt, float* y, int64_t ys, float alpha, int accumulate) {
    for (int t0 = 0; t0 < nt; t0 += 4) {           // tokens in chunks of up to 4
        const Out o{y + (int64_t)t0 * ys, ys, alpha, accumulate};
        switch (nt - t0 < 4 ? nt - t0 : 4) {
            case 1: ex_iq<1, D>(W, rb, r0, r1, cols, xs + t0, o); break;
            case 2: ex_iq<2, D>(W, rb, r0, r1, cols, xs + t0, o); break;
            case 3: ex_iq<3, D>(W, rb, r0, r1, cols, xs + t0, o); break;
            default: ex_iq<4, D>(W, rb, r0, r1, cols, xs + t0, o); break;
        }
    }
}

// --- q8 mode ---------------------------------------------------------------------------------

EFS_TI __m256i dot_ss8(__m256i x, __m256i y) {   // signed x signed -> 8 int32 sums of 4
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x)),
                             _mm256_set1_epi16(1));
}

template <class D>
EFS_T float vd_iq(const uint8_t* b, int64_t cols, const Q8K* y) {
    const int64_t nb = cols / 256;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; ++i, b += D::BYTES) {
        const int8_t* q8 = y[i].qs;
        __m256i sumi = _mm256_setzero_si256();
        for (int ib = 0; ib < 8; ++ib) {
            int l0, l1;
            D::ls(b, ib, &l0, &l1);
            const __m256i p = dot_ss8(D::q(b, ib), loadu256((const uint8_t*)(q8 + 32 * ib)));
            const __m256i l = D::PAIR ? _mm256_setr_epi32(l0, l0, l0, l0, l1, l1, l1, l1)
                                      : _mm256_set1_epi32(l0);
            sumi = _mm256_add_epi32(sumi, _mm256_mullo_epi32(p, l));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(y[i].d * D::d(b) * D::F), _mm256_cvtepi32_ps(sumi),
                              acc);
    }
    return hsum(acc);
}

template <class D>
EFS_T void rows_q8(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                   const XPrep* xs, int nt, float* y, int64_t ys, float alpha, int accumulate) {
    const Out o{y, ys, alpha, accumulate};
    const int64_t ahead = pf_ahead(rb);
    for (int64_t r = r0; r < r1; ++r) {
        pf_row(W + (r + ahead) * rb, rb);
        for (int t = 0; t < nt; ++t) o.put(t, r, vd_iq<D>(W + r * rb, cols, (const Q8K*)xs[t].q));
    }
}

}  // namespace

RowsFn avx2_iq_rows(int type, int mode) {
#define EFS_CASE(T, D) case T: return mode == 0 ? rows_ex<D> : rows_q8<D>;
    switch (type) {
        EFS_CASE(T_IQ2_XXS, IQ2XXS) EFS_CASE(T_IQ2_XS, IQ2XS) EFS_CASE(T_IQ2_S, IQ2S)
        EFS_CASE(T_IQ3_XXS, IQ3XXS) EFS_CASE(T_IQ3_S, IQ3S) EFS_CASE(T_IQ1_S, IQ1S)
        EFS_CASE(T_IQ1_M, IQ1M)
        default: return nullptr;
    }
#undef EFS_CASE
}

}  // namespace efs

#else  // not x86

namespace efs {
RowsFn avx2_iq_rows(int, int) { return nullptr; }
}  // namespace efs

#endif
