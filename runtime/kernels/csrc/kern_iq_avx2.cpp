// AVX2 kernels of the lattice IQ types (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M)
// and the ternary TQ1_0 / TQ2_0 (layouts in kern_iq.cpp). Same rules as kern_avx2.cpp: target attributes on every function,
// only <immintrin.h> and C headers, called only after ops.cpp has checked the CPU.
//
// Every type is written as a decoder of 32 signed integer weights q per group ib (the grid
// entries gathered from the gguf-py tables in g_iq, their signs applied with sign_epi8) and an
// integer multiplier ls per 16 of them, with w = d * F * ls * q for a per-type constant F
// (a power of two). IQ1's grid values g in {-1, 0, 1} plus their delta of +-1/8 enter as the
// odd integers 8 g +- 1 with F = 1/8, so its delta costs nothing extra. The decoders are in
// kern_iq_avx2_types.h, shared with the AVX-512 unit (kern_iq_avx512.cpp).
//
// Exact mode: the weights of a group come as 4 x 8 exact floats (D::w): the small grids from
// their float tables with the signs flipped by a loaded mask (no int->float conversion), the
// large ones (IQ2_S, IQ1) and TQ from int8 by conversion; they meet the activations in natural
// order, per 16-element half scale * sum(w * x). q8 mode: integer
// dot products with the Q8_K activations (ggml-cpu's ggml_vec_dot_iq*_q8_K numerics: integer
// sums per sub-block times ls, combined in float per block).
#include "kern.h"

#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include "kern_iq_avx2_types.h"

namespace efs {
namespace {

// --- exact mode ------------------------------------------------------------------------------

// A block's 16 scale slots df * (2 l + 1) (slot 2 ib: the group's first half, 2 ib + 1: its
// second, the same l where the type has one per group) as two vectors of 8 (Sc2<D>::ls: the
// l's), converted and multiplied at once where the per-group form extracts, converts,
// multiplies and broadcasts each: a group's scale is then one broadcast load. The same float
// products, so the same bits. Types without one keep the per-group form.
template <class D> struct Sc2 { static constexpr bool ON = false; };
EFS_TI void nibble_slots(const uint8_t* p, __m256i* l) {      // 8 bytes' low, high nibbles
    const __m128i u = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i*)p),
                                        _mm_loadl_epi64((const __m128i*)p));
    const __m256i sh = _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4), m = _mm256_set1_epi32(15);
    l[0] = _mm256_and_si256(_mm256_srlv_epi32(_mm256_cvtepu8_epi32(u), sh), m);
    l[1] = _mm256_and_si256(_mm256_srlv_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(u, 8)), sh),
                            m);
}
template <> struct Sc2<IQ2S> {                   // scale byte ib at 74
    static constexpr bool ON = true;
    EFS_TI static void ls(const uint8_t* b, __m256i* l) { nibble_slots(b + 74, l); }
};
template <> struct Sc2<IQ2XS> {                  // at 66
    static constexpr bool ON = true;
    EFS_TI static void ls(const uint8_t* b, __m256i* l) { nibble_slots(b + 66, l); }
};
template <> struct Sc2<IQ3S> {                   // nibble ib % 2 of byte 106 + ib / 2, twice
    static constexpr bool ON = true;
    EFS_TI static void ls(const uint8_t* b, __m256i* l) {
        const __m128i v = _mm_shuffle_epi8(_mm_cvtsi32_si128((int)u32_(b + 106)),
                                           _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2,
                                                         3, 3, 3, 3));
        const __m256i sh = _mm256_setr_epi32(0, 0, 4, 4, 0, 0, 4, 4), m = _mm256_set1_epi32(15);
        l[0] = _mm256_and_si256(_mm256_srlv_epi32(_mm256_cvtepu8_epi32(v), sh), m);
        l[1] = _mm256_and_si256(_mm256_srlv_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)),
                                                  sh), m);
    }
};
template <> struct Sc2<IQ1S> {                   // bits 12..14 of word ib at 34, twice
    static constexpr bool ON = true;
    EFS_TI static void ls(const uint8_t* b, __m256i* l) {
        const __m128i w = _mm_loadu_si128((const __m128i*)(b + 34));
        const __m256i m = _mm256_set1_epi32(7);
        l[0] = _mm256_and_si256(_mm256_srli_epi32(_mm256_cvtepu16_epi32(
                                    _mm_unpacklo_epi16(w, w)), 12), m);
        l[1] = _mm256_and_si256(_mm256_srli_epi32(_mm256_cvtepu16_epi32(
                                    _mm_unpackhi_epi16(w, w)), 12), m);
    }
};
template <> struct Sc2<IQ1M> {                   // word ib / 2 at 48, bits 6 (ib % 2) + 0, 3
    static constexpr bool ON = true;
    EFS_TI static void ls(const uint8_t* b, __m256i* l) {
        const __m256i w = _mm256_castsi128_si256(
            _mm_cvtepu16_epi32(_mm_loadl_epi64((const __m128i*)(b + 48))));
        const __m256i sh = _mm256_setr_epi32(0, 3, 6, 9, 0, 3, 6, 9), m = _mm256_set1_epi32(7);
        l[0] = _mm256_and_si256(_mm256_srlv_epi32(_mm256_permutevar8x32_epi32(
                                    w, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1)), sh), m);
        l[1] = _mm256_and_si256(_mm256_srlv_epi32(_mm256_permutevar8x32_epi32(
                                    w, _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3)), sh), m);
    }
};
template <> struct Sc2<IQ2XXS> {                 // the top 4 bits of group ib's second dword
    static constexpr bool ON = true;
    EFS_TI static void ls(const uint8_t* b, __m256i* l) {
        for (int k = 0; k < 2; ++k)
            l[k] = _mm256_shuffle_epi32(_mm256_srli_epi32(loadu256(b + 2 + 32 * k), 28), 0xF5);
    }
};
template <> struct Sc2<IQ3XXS> {                 // the top 4 bits of the dword at 66 + 4 ib
    static constexpr bool ON = true;
    EFS_TI static void ls(const uint8_t* b, __m256i* l) {
        const __m256i v = _mm256_srli_epi32(loadu256(b + 66), 28);
        l[0] = _mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
        l[1] = _mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7));
    }
};
template <class D>
EFS_TI void block_scales2(const uint8_t* b, float df, float* s) {
    __m256i l[2];
    Sc2<D>::ls(b, l);
    for (int k = 0; k < 2; ++k)
        _mm256_store_ps(s + 8 * k, _mm256_mul_ps(_mm256_set1_ps(df), _mm256_cvtepi32_ps(
            _mm256_add_epi32(_mm256_slli_epi32(l[k], 1), _mm256_set1_epi32(1)))));
}

// Per group of 32: the weights as 4 x 8 floats (D::w), then per token and 16-element half
// h: scale_h * sum(w * x) accumulated into acc_h, x in natural order.
template <int NT, class D>
EFS_T void ex_iq(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                 const XPrep* xs, Out out) {
    const int64_t nb = cols / 256;
    const float* xv[NT];
    for (int t = 0; t < NT; ++t) xv[t] = xs[t].x;
    const char* pf = pf_start(W + r0 * rb);
    alignas(32) float sc[16];                  // Sc2's scales of the block
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* b = W + r * rb;
        __m256 a0[NT], a1[NT];
        for (int t = 0; t < NT; ++t) a0[t] = a1[t] = _mm256_setzero_ps();
        for (int64_t i = 0; i < nb; ++i, b += D::BYTES) {
            pf_next(pf, b + D::BYTES);
            const float df = D::d(b) * D::F;
            if constexpr (Sc2<D>::ON) block_scales2<D>(b, df, sc);
            for (int ib = 0; ib < 8; ++ib) {
                __m256 s0, s1;
                if constexpr (Sc2<D>::ON) {
                    s0 = _mm256_broadcast_ss(sc + 2 * ib);
                    s1 = D::PAIR ? _mm256_broadcast_ss(sc + 2 * ib + 1) : s0;
                } else {
                    int l0, l1;
                    D::ls(b, ib, &l0, &l1);
                    s0 = _mm256_set1_ps(df * (float)l0);
                    s1 = D::PAIR ? _mm256_set1_ps(df * (float)l1) : s0;
                }
                __m256 w[4];
                D::w(b, ib, w);
                for (int t = 0; t < NT; ++t) {
                    const float* x = xv[t] + 256 * i + 32 * ib;
                    __m256 h0 = _mm256_mul_ps(w[0], _mm256_loadu_ps(x));
                    __m256 h1 = _mm256_mul_ps(w[2], _mm256_loadu_ps(x + 16));
                    h0 = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(x + 8), h0);
                    h1 = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(x + 24), h1);
                    a0[t] = _mm256_fmadd_ps(h0, s0, a0[t]);
                    a1[t] = _mm256_fmadd_ps(h1, s1, a1[t]);
                }
            }
        }
        for (int t = 0; t < NT; ++t) out.put(t, r, hsum(_mm256_add_ps(a0[t], a1[t])));
    }
}

// --- q8 mode ---------------------------------------------------------------------------------

// Per group of 32, decoded once for up to 4 tokens: |q| times the activation bytes with q's
// signs (maddubs: 16 sums of 2 in int16), then madd by the group's multipliers as int16 lanes
// (l0 for elements 0..15, l1 for 16..31), which sums pairs and scales in one operation: the
// same int32 lanes as summing pairs by 1 and multiplying by ls after (exact integers, far from
// int32's range), so the same bits, without a 32-bit multiply per group and token.
// Types with D::MAG (their grid bytes unsigned, the signs apart) skip forming q and taking
// |q| and its signs back: the grid bytes are |q| (non-zero) and their sign vector gives the
// activations q's signs, as ggml's own AVX2 IQ2/IQ3 dot products do. The same products.

template <int NT, class D>
EFS_T void q8_iq(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                 const XPrep* xs, Out out) {
    const int64_t nb = cols / 256;
    const Q8K* y[NT];
    for (int t = 0; t < NT; ++t) y[t] = (const Q8K*)xs[t].q;
    const char* pf = pf_start(W + r0 * rb);
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* b = W + r * rb;
        __m256 acc[NT];
        for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
        for (int64_t i = 0; i < nb; ++i, b += D::BYTES) {
            pf_next(pf, b + D::BYTES);
            __m256i sumi[NT];
            for (int t = 0; t < NT; ++t) sumi[t] = _mm256_setzero_si256();
            for (int ib = 0; ib < 8; ++ib) {
                int l0, l1;
                D::ls(b, ib, &l0, &l1);
                const __m256i ls = D::PAIR ? _mm256_set_m128i(_mm_set1_epi16((short)l1),
                                                              _mm_set1_epi16((short)l0))
                                           : _mm256_set1_epi16((short)l0);
                __m256i aq, sq;         // |q| and q's signs for the activations
                if constexpr (D::MAG) {
                    aq = D::mag(b, ib);
                    sq = D::sgn(b, ib);
                } else {
                    sq = D::q(b, ib);
                    aq = _mm256_sign_epi8(sq, sq);
                }
                for (int t = 0; t < NT; ++t) {
                    const __m256i qy = loadu256((const uint8_t*)(y[t][i].qs + 32 * ib));
                    const __m256i p = _mm256_maddubs_epi16(aq, _mm256_sign_epi8(qy, sq));
                    sumi[t] = _mm256_add_epi32(sumi[t], _mm256_madd_epi16(p, ls));
                }
            }
            const float d = D::d(b);
            for (int t = 0; t < NT; ++t)
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(y[t][i].d * d * D::F),
                                         _mm256_cvtepi32_ps(sumi[t]), acc[t]);
        }
        for (int t = 0; t < NT; ++t) out.put(t, r, hsum(acc[t]));
    }
}

// --- either mode: tokens in chunks of up to 4 -----------------------------------------------

template <int NT, class D, bool Q8>
EFS_TI void pass(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                 const XPrep* xs, Out o) {
    if constexpr (Q8)
        q8_iq<NT, D>(W, rb, r0, r1, cols, xs, o);
    else
        ex_iq<NT, D>(W, rb, r0, r1, cols, xs, o);
}

template <class D, bool Q8>
EFS_T void rows_iq(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                   const XPrep* xs, int nt, float* y, int64_t ys, float alpha, int accumulate) {
    for (int t0 = 0; t0 < nt; t0 += 4) {
        const Out o{y + (int64_t)t0 * ys, ys, alpha, accumulate};
        switch (nt - t0 < 4 ? nt - t0 : 4) {
            case 1: pass<1, D, Q8>(W, rb, r0, r1, cols, xs + t0, o); break;
            case 2: pass<2, D, Q8>(W, rb, r0, r1, cols, xs + t0, o); break;
            case 3: pass<3, D, Q8>(W, rb, r0, r1, cols, xs + t0, o); break;
            default: pass<4, D, Q8>(W, rb, r0, r1, cols, xs + t0, o); break;
        }
    }
}

// --- dequantization ---------------------------------------------------------------------------

// One block's 256 floats as ggml's dequantize_row_* (kern_iq.cpp's deq_block_iq) gives them,
// bit for bit: each 8 weights' exact floats from D::w (IQ1: 8 g +- 1, times 1/8 exactly: g +-
// 1/8) times the scale the portable code computes, by the same float operations.
template <int TYPE, class D>
EFS_TI void deq_iq_block(const uint8_t* b, float* y) {
    const float d = D::d(b);
    for (int ib = 0; ib < 8; ++ib) {
        __m256 v[4];
        D::w(b, ib, v);
        for (int l = 0; l < 4; ++l) {
            float s;
            __m256 x = v[l];
            if constexpr (TYPE == T_IQ2_XXS) {
                s = d * (0.5f + (float)(u32_(b + 6 + 8 * ib) >> 28)) * 0.25f;
            } else if constexpr (TYPE == T_IQ2_XS || TYPE == T_IQ2_S) {
                const uint8_t sc = b[(TYPE == T_IQ2_XS ? 66 : 74) + ib];
                s = d * (0.5f + (float)(l < 2 ? sc & 0xf : sc >> 4)) * 0.25f;
            } else if constexpr (TYPE == T_IQ3_XXS) {
                s = d * (0.5f + (float)(u32_(b + 66 + 4 * ib) >> 28)) * 0.5f;
            } else if constexpr (TYPE == T_IQ3_S) {
                s = d * (float)(1 + 2 * ((b[106 + ib / 2] >> (4 * (ib % 2))) & 0xf));
            } else if constexpr (TYPE == T_IQ1_S) {
                s = d * (float)(2 * ((u16_(b + 34 + 2 * ib) >> 12) & 7) + 1);
                x = _mm256_mul_ps(x, _mm256_set1_ps(0.125f));
            } else if constexpr (TYPE == T_IQ1_M) {
                const int sc = u16_(b + 48 + 2 * (ib / 2));
                s = d * (float)(2 * ((sc >> (6 * (ib % 2) + 3 * (l / 2))) & 7) + 1);
                x = _mm256_mul_ps(x, _mm256_set1_ps(0.125f));
            } else {                                                  // TQ1_0, TQ2_0
                s = d;
            }
            _mm256_storeu_ps(y + 32 * ib + 8 * l, _mm256_mul_ps(_mm256_set1_ps(s), x));
        }
    }
}

template <int TYPE, class D>
EFS_T void deq_iq_rows(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                       float* y) {
    for (int64_t r = r0; r < r1; ++r)
        for (int64_t i = 0; i < cols / 256; ++i)
            deq_iq_block<TYPE, D>(W + r * rb + i * D::BYTES, y + (r - r0) * cols + 256 * i);
}

}  // namespace

bool avx2_iq_dequant_rows(int type, const uint8_t* W, int64_t rb, int64_t r0, int64_t r1,
                          int64_t cols, float* y) {
#define EFS_CASE(T, D) case T: deq_iq_rows<T, D>(W, rb, r0, r1, cols, y); return true;
    switch (type) {
        EFS_IQ_DECODERS(EFS_CASE)
        default: return false;
    }
#undef EFS_CASE
}

RowsFn avx2_iq_rows(int type, int mode) {
#define EFS_CASE(T, D) case T: return mode == 0 ? rows_iq<D, false> : rows_iq<D, true>;
    switch (type) {
        EFS_IQ_DECODERS(EFS_CASE)
        default: return nullptr;
    }
#undef EFS_CASE
}

}  // namespace efs

#else  // not x86

namespace efs {
RowsFn avx2_iq_rows(int, int) { return nullptr; }
bool avx2_iq_dequant_rows(int, const uint8_t*, int64_t, int64_t, int64_t, int64_t, float*) {
    return false;
}
}  // namespace efs

#endif
