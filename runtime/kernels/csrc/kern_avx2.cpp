// AVX2 + FMA + F16C kernels. Every function carries the target attribute (GCC and clang), so
// the unit builds with the default flags and its code runs only after ops.cpp has checked the
// CPU. Only <immintrin.h> and C headers are included: no inline symbol from a shared header is
// compiled for AVX2 here (which the linker could otherwise pick for the portable units).
//
// Exact mode (float32 activations). A group of 32 weights is turned into 32 bytes q and a
// per-type offset o, then into the floats q - o exactly (u8f in kern_avx2_util.h: a byte
// shuffle and a conversion, or the byte in the mantissa of 2^23 minus 2^23 + o). The unpack is
// in-lane, so the 32 floats come out in a fixed permuted order; the activations are permuted the
// same way once per call (perm32), as they are shared by every row. Per sub-block:
// scale * sum(q * x); mins as min * sum(x).
//
// q8 mode: llama.cpp's integer dot products (maddubs / madd), per block combined in float with
// the activation block's scale, as ggml-cpu's AVX2 ggml_vec_dot_*.
#include "kern.h"

#include <math.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include "kern_avx2_util.h"
#define EFS_KT EFS_T
#include "kern_k_avx2.h"

namespace efs {
namespace {

// ---------------------------------------------------------------------------------------------
// exact mode
// ---------------------------------------------------------------------------------------------

// IQ4_XS: d, scales_h:u16, scales_l[4], qs[128]; group ib of 32: 6-bit scale ls (iq4xs_ls),
// values kvalues_iq4nl[nibble] (tbl_iq4nl_s; lo nibbles = elements 0..15 of the group, hi =
// 16..31).

template <int NT>
EFS_T void ex_iq4_xs(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                     const XPrep* xs, Out out) {
    const int64_t nb = cols / 256;
    const float* xp[NT];
    for (int t = 0; t < NT; ++t) xp[t] = xs[t].xp;
    const __m256i tbl = tbl_iq4nl_s();
    const char* pf = pf_start(W + r0 * rb);
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* b = W + r * rb;
        __m256 a0[NT], a1[NT];
        for (int t = 0; t < NT; ++t) a0[t] = a1[t] = _mm256_setzero_ps();
        for (int64_t i = 0; i < nb; ++i, b += 136) {
            pf_next(pf, b + 136);
            const float d = f16(b) * unit<SIGNED>();
            for (int ib = 0; ib < 8; ib += 2) {
                const __m256i v0 = _mm256_shuffle_epi8(tbl, nibbles(loadu128(b + 8 + 16 * ib)));
                const __m256i v1 = _mm256_shuffle_epi8(tbl, nibbles(loadu128(b + 24 + 16 * ib)));
                grp<NT, SIGNED>(v0, xp, 256 * i + 32 * ib,
                                _mm256_set1_ps(d * (float)(iq4xs_ls(b, ib) - 32)), a0);
                grp<NT, SIGNED>(v1, xp, 256 * i + 32 * ib + 32,
                                _mm256_set1_ps(d * (float)(iq4xs_ls(b, ib + 1) - 32)), a1);
            }
        }
        for (int t = 0; t < NT; ++t) out.put(t, r, hsum(_mm256_add_ps(a0[t], a1[t])));
    }
}

// Blocks of 32: one group per block, w = d * (q - OFF) (+ m).
struct DQ4_0 {
    static constexpr int BYTES = 18;
    static constexpr int OFF = 8;
    static constexpr bool MIN = false;
    EFS_TI static __m256i q(const uint8_t* b) { return nibbles(loadu128(b + 2)); }
    EFS_TI static float d(const uint8_t* b) { return f16(b); }
    EFS_TI static float m(const uint8_t*) { return 0.f; }
};
struct DQ4_1 {
    static constexpr int BYTES = 20;
    static constexpr int OFF = 0;
    static constexpr bool MIN = true;
    EFS_TI static __m256i q(const uint8_t* b) { return nibbles(loadu128(b + 4)); }
    EFS_TI static float d(const uint8_t* b) { return f16(b); }
    EFS_TI static float m(const uint8_t* b) { return f16(b + 2); }
};
struct DQ5_0 {
    static constexpr int BYTES = 22;
    static constexpr int OFF = 16;
    static constexpr bool MIN = false;
    EFS_TI static __m256i q(const uint8_t* b) {
        return _mm256_or_si256(nibbles(loadu128(b + 6)),
                               _mm256_and_si256(bytes_from_bits_32(b + 2), _mm256_set1_epi8(0x10)));
    }
    EFS_TI static float d(const uint8_t* b) { return f16(b); }
    EFS_TI static float m(const uint8_t*) { return 0.f; }
};
struct DQ5_1 {
    static constexpr int BYTES = 24;
    static constexpr int OFF = 0;
    static constexpr bool MIN = true;
    EFS_TI static __m256i q(const uint8_t* b) {
        return _mm256_or_si256(nibbles(loadu128(b + 8)),
                               _mm256_and_si256(bytes_from_bits_32(b + 4), _mm256_set1_epi8(0x10)));
    }
    EFS_TI static float d(const uint8_t* b) { return f16(b); }
    EFS_TI static float m(const uint8_t* b) { return f16(b + 2); }
};
struct DQ8_0 {
    static constexpr int BYTES = 34;
    static constexpr int OFF = SIGNED;
    static constexpr bool MIN = false;
    EFS_TI static __m256i q(const uint8_t* b) { return loadu256(b + 2); }
    EFS_TI static float d(const uint8_t* b) { return f16(b); }
    EFS_TI static float m(const uint8_t*) { return 0.f; }
};
// MXFP4's scale times unit<SIGNED>() (2^-24) is a power of two exactly representable for every
// e8m0 exponent from 4 up; below that (a block scale under 2^-124, weights under 2^-121) the
// product may differ from the other unpacks' in the last bits of a result that small.
struct DMXFP4 {
    static constexpr int BYTES = 17;
    static constexpr int OFF = SIGNED;
    static constexpr bool MIN = false;
    EFS_TI static __m256i q(const uint8_t* b) {
        return _mm256_shuffle_epi8(tbl_mxfp4_s(), nibbles(loadu128(b + 1)));
    }
    EFS_TI static float d(const uint8_t* b) { return e8m0h(b[0]); }
    EFS_TI static float m(const uint8_t*) { return 0.f; }
};

struct DIQ4_NL {
    static constexpr int BYTES = 18;
    static constexpr int OFF = SIGNED;
    static constexpr bool MIN = false;
    EFS_TI static __m256i q(const uint8_t* b) {
        return _mm256_shuffle_epi8(tbl_iq4nl_s(), nibbles(loadu128(b + 2)));
    }
    EFS_TI static float d(const uint8_t* b) { return f16(b); }
    EFS_TI static float m(const uint8_t*) { return 0.f; }
};

// Rows r.. in groups of R (1 or 2), each row's even blocks into a0 and odd into a1; in a group
// the rows take each pair of blocks in turn, so the second reads the activations the first has
// just brought into the L1 cache. Returns the first row not done.
template <int NT, class D, int R>
EFS_TI int64_t b32_rows(const uint8_t* W, int64_t rb, int64_t r, int64_t r1, int64_t nb,
                        const float* const* xp, const float* const* s32, Out out) {
    constexpr float U = unit<D::OFF>();
    RowCursor<R> rc(W, rb, r);
    for (; r + R <= r1; r += R) {
        rc.at(W, rb, r);
        __m256 a0[R][NT], a1[R][NT];
        float mm[R][NT];
        for (int j = 0; j < R; ++j)
            for (int t = 0; t < NT; ++t) {
                a0[j][t] = a1[j][t] = _mm256_setzero_ps();
                mm[j][t] = 0.f;
            }
        int64_t i = 0;
        for (; i + 2 <= nb; i += 2) {
            rc.prefetch(2 * D::BYTES);
            for (int j = 0; j < R; ++j) {
                const uint8_t* b = rc.b[j];
                grp<NT, D::OFF>(D::q(b), xp, 32 * i, _mm256_set1_ps(D::d(b) * U), a0[j]);
                grp<NT, D::OFF>(D::q(b + D::BYTES), xp, 32 * i + 32,
                                _mm256_set1_ps(D::d(b + D::BYTES) * U), a1[j]);
                if (D::MIN)
                    for (int t = 0; t < NT; ++t)
                        mm[j][t] += D::m(b) * s32[t][i] + D::m(b + D::BYTES) * s32[t][i + 1];
            }
            rc.step(2 * D::BYTES);
        }
        if (i < nb)
            for (int j = 0; j < R; ++j) {
                const uint8_t* b = rc.b[j];
                grp<NT, D::OFF>(D::q(b), xp, 32 * i, _mm256_set1_ps(D::d(b) * U), a0[j]);
                if (D::MIN)
                    for (int t = 0; t < NT; ++t) mm[j][t] += D::m(b) * s32[t][i];
            }
        for (int j = 0; j < R; ++j)
            for (int t = 0; t < NT; ++t)
                out.put(t, r + j, hsum(_mm256_add_ps(a0[j][t], a1[j][t])) + mm[j][t]);
    }
    return r;
}

// Row by row; two rows in turn where a pass of one or two tokens has more than 16 KiB of
// activations, which a row at a time would re-read from L2 for every row (the same bits).
template <int NT, class D>
EFS_T void ex_b32(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                  const XPrep* xs, Out out) {
    const int64_t nb = cols / 32;
    const float* xp[NT];
    const float* s32[NT];
    for (int t = 0; t < NT; ++t) { xp[t] = xs[t].xp; s32[t] = xs[t].s32; }
    int64_t r = r0;
    if (NT <= 2 && !x_in_l1(NT, cols, 4)) r = b32_rows<NT, D, 2>(W, rb, r, r1, nb, xp, s32, out);
    b32_rows<NT, D, 1>(W, rb, r, r1, nb, xp, s32, out);
}

template <int NT> EFS_T void ex_q4_0(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1,
    int64_t cols, const XPrep* xs, Out out) { ex_b32<NT, DQ4_0>(W, rb, r0, r1, cols, xs, out); }
template <int NT> EFS_T void ex_q4_1(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1,
    int64_t cols, const XPrep* xs, Out out) { ex_b32<NT, DQ4_1>(W, rb, r0, r1, cols, xs, out); }
template <int NT> EFS_T void ex_q5_0(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1,
    int64_t cols, const XPrep* xs, Out out) { ex_b32<NT, DQ5_0>(W, rb, r0, r1, cols, xs, out); }
template <int NT> EFS_T void ex_q5_1(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1,
    int64_t cols, const XPrep* xs, Out out) { ex_b32<NT, DQ5_1>(W, rb, r0, r1, cols, xs, out); }
template <int NT> EFS_T void ex_q8_0(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1,
    int64_t cols, const XPrep* xs, Out out) { ex_b32<NT, DQ8_0>(W, rb, r0, r1, cols, xs, out); }
template <int NT> EFS_T void ex_mxfp4(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1,
    int64_t cols, const XPrep* xs, Out out) { ex_b32<NT, DMXFP4>(W, rb, r0, r1, cols, xs, out); }
template <int NT> EFS_T void ex_iq4_nl(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1,
    int64_t cols, const XPrep* xs, Out out) { ex_b32<NT, DIQ4_NL>(W, rb, r0, r1, cols, xs, out); }
template <int NT> EFS_T void ex_q4_k(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1,
    int64_t cols, const XPrep* xs, Out out) { ex_q45_k<NT, false>(W, rb, r0, r1, cols, xs, out); }
template <int NT> EFS_T void ex_q5_k(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1,
    int64_t cols, const XPrep* xs, Out out) { ex_q45_k<NT, true>(W, rb, r0, r1, cols, xs, out); }

// F16 / BF16 rows: natural order activations.
template <bool BF>
EFS_TI __m256 h8(const uint8_t* p) {
    if (BF)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(loadu128(p)), 16));
    return _mm256_cvtph_ps(loadu128(p));
}

template <int NT, bool BF>
EFS_T void ex_half(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                   const XPrep* xs, Out out) {
    const float* x[NT];
    for (int t = 0; t < NT; ++t) x[t] = xs[t].x;
    const char* pf = pf_start(W + r0 * rb);
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* p = W + r * rb;
        __m256 a0[NT], a1[NT];
        for (int t = 0; t < NT; ++t) a0[t] = a1[t] = _mm256_setzero_ps();
        int64_t c = 0;
        for (; c + 16 <= cols; c += 16) {
            pf_next(pf, p + 2 * c + 32);
            const __m256 w0 = h8<BF>(p + 2 * c), w1 = h8<BF>(p + 2 * c + 16);
            for (int t = 0; t < NT; ++t) {
                a0[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x[t] + c), a0[t]);
                a1[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x[t] + c + 8), a1[t]);
            }
        }
        for (; c + 8 <= cols; c += 8) {
            const __m256 w0 = h8<BF>(p + 2 * c);
            for (int t = 0; t < NT; ++t)
                a0[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x[t] + c), a0[t]);
        }
        float tail[NT];
        for (int t = 0; t < NT; ++t) tail[t] = 0.f;
        for (; c < cols; ++c) {
            uint16_t h;
            memcpy(&h, p + 2 * c, 2);
            float w;
            if (BF) {
                const uint32_t u = (uint32_t)h << 16;
                memcpy(&w, &u, 4);
            } else {
                w = _cvtsh_ss(h);
            }
            for (int t = 0; t < NT; ++t) tail[t] += w * x[t][c];
        }
        for (int t = 0; t < NT; ++t)
            out.put(t, r, hsum(_mm256_add_ps(a0[t], a1[t])) + tail[t]);
    }
}
template <int NT> EFS_T void ex_f16(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1,
    int64_t cols, const XPrep* xs, Out out) { ex_half<NT, false>(W, rb, r0, r1, cols, xs, out); }
template <int NT> EFS_T void ex_bf16(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1,
    int64_t cols, const XPrep* xs, Out out) { ex_half<NT, true>(W, rb, r0, r1, cols, xs, out); }

// Tokens in chunks of up to 4 (each weight group is unpacked once per chunk).
#define EFS_EX_ROWS(name)                                                                      \
    EFS_T void rows_##name(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols, \
                           const XPrep* xs, int nt, float* y, int64_t ys, float alpha,          \
                           int accumulate) {                                                    \
        for (int t0 = 0; t0 < nt; t0 += 4) {                                                    \
            const Out o{y + (int64_t)t0 * ys, ys, alpha, accumulate};                           \
            switch (nt - t0 < 4 ? nt - t0 : 4) {                                                \
                case 1: name<1>(W, rb, r0, r1, cols, xs + t0, o); break;                        \
                case 2: name<2>(W, rb, r0, r1, cols, xs + t0, o); break;                        \
                case 3: name<3>(W, rb, r0, r1, cols, xs + t0, o); break;                        \
                default: name<4>(W, rb, r0, r1, cols, xs + t0, o); break;                       \
            }                                                                                   \
        }                                                                                       \
    }

EFS_EX_ROWS(ex_q4_0) EFS_EX_ROWS(ex_q4_1) EFS_EX_ROWS(ex_q5_0) EFS_EX_ROWS(ex_q5_1)
EFS_EX_ROWS(ex_q8_0) EFS_EX_ROWS(ex_mxfp4) EFS_EX_ROWS(ex_q2_k) EFS_EX_ROWS(ex_q3_k)
EFS_EX_ROWS(ex_q4_k) EFS_EX_ROWS(ex_q5_k) EFS_EX_ROWS(ex_q6_k) EFS_EX_ROWS(ex_iq4_xs)
EFS_EX_ROWS(ex_f16) EFS_EX_ROWS(ex_bf16) EFS_EX_ROWS(ex_iq4_nl)

// ---------------------------------------------------------------------------------------------
// q8 mode: integer dot products (ggml-cpu AVX2 ggml_vec_dot_*)
// ---------------------------------------------------------------------------------------------

EFS_TI __m256i sum_pairs16(__m256i p16) { return _mm256_madd_epi16(p16, _mm256_set1_epi16(1)); }

// unsigned x signed bytes -> 8 int32 sums of 4 products (signed x signed: |x| and y with x's
// signs, as the callers do once per block for all their tokens)
EFS_TI __m256i dot_us(__m256i ax, __m256i sy) { return sum_pairs16(_mm256_maddubs_epi16(ax, sy)); }

// q8 products of up to 4 tokens (EFS_EX_ROWS chunks them): each block's weights decoded once
// and multiplied by every token's activation block, each token's sums in its own accumulators
// in the order of ggml's one-token dot product, so every token gets the bits of a product of
// one. Blocks of 32 (Q8_0 / Q8_1 activations): per block acc += (d * dy) * float(8 int32 sums),
// Q4_1 / Q5_1 adding m * s; then hsum(acc) + sum.
template <int NT, class D, bool SIGNED>
EFS_T void q8_b32(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                  const XPrep* xs, Out out) {
    const int64_t nb = cols / 32;
    const QX8* y[NT];
    for (int t = 0; t < NT; ++t) y[t] = (const QX8*)xs[t].q;
    const char* pf = pf_start(W + r0 * rb);
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* row = W + r * rb;
        __m256 acc[NT];
        float summ[NT];
        for (int t = 0; t < NT; ++t) { acc[t] = _mm256_setzero_ps(); summ[t] = 0.f; }
        for (int64_t i = 0; i < nb; ++i, row += D::BYTES) {
            pf_next(pf, row + D::BYTES);
            const __m256i q = D::qs(row);
            const __m256i aq = SIGNED ? _mm256_sign_epi8(q, q) : q;
            const float dw = D::d(row);
            for (int t = 0; t < NT; ++t) {
                const __m256i qy = loadu256((const uint8_t*)y[t][i].qs);
                const __m256i p = dot_us(aq, SIGNED ? _mm256_sign_epi8(qy, q) : qy);
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * y[t][i].d), _mm256_cvtepi32_ps(p),
                                         acc[t]);
                if (D::MIN) summ[t] += D::m(row) * y[t][i].s;
            }
        }
        for (int t = 0; t < NT; ++t) out.put(t, r, hsum(acc[t]) + summ[t]);
    }
}

struct IQ4_0 : DQ4_0 {          // q - 8, signed
    EFS_TI static __m256i qs(const uint8_t* b) {
        return _mm256_sub_epi8(nibbles(loadu128(b + 2)), _mm256_set1_epi8(8));
    }
};
struct IQ4_1 : DQ4_1 {
    EFS_TI static __m256i qs(const uint8_t* b) { return nibbles(loadu128(b + 4)); }
};
struct IQ5_0 : DQ5_0 {          // (q | h << 4) - 16 = q | (h ? 0 : 0xF0), signed
    EFS_TI static __m256i qs(const uint8_t* b) {
        return _mm256_or_si256(nibbles(loadu128(b + 6)),
            _mm256_andnot_si256(bytes_from_bits_32(b + 2), _mm256_set1_epi8((char)0xF0)));
    }
};
struct IQ5_1 : DQ5_1 {
    EFS_TI static __m256i qs(const uint8_t* b) { return DQ5_1::q(b); }
};
struct IQ8_0 : DQ8_0 {
    EFS_TI static __m256i qs(const uint8_t* b) { return loadu256(b + 2); }
};
struct IMXFP4 : DMXFP4 {
    EFS_TI static __m256i qs(const uint8_t* b) {
        return _mm256_shuffle_epi8(tbl_mxfp4_s(), nibbles(loadu128(b + 1)));
    }
};

struct IIQ4_NL : DIQ4_NL {
    EFS_TI static __m256i qs(const uint8_t* b) {
        return _mm256_shuffle_epi8(tbl_iq4nl_s(), nibbles(loadu128(b + 2)));
    }
};

template <int NT> EFS_T void q8_iq4_nl(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1,
    int64_t cols, const XPrep* xs, Out out) { q8_b32<NT, IIQ4_NL, true>(W, rb, r0, r1, cols, xs, out); }
template <int NT> EFS_T void q8_q4_0(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1,
    int64_t cols, const XPrep* xs, Out out) { q8_b32<NT, IQ4_0, true>(W, rb, r0, r1, cols, xs, out); }
template <int NT> EFS_T void q8_q4_1(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1,
    int64_t cols, const XPrep* xs, Out out) { q8_b32<NT, IQ4_1, false>(W, rb, r0, r1, cols, xs, out); }
template <int NT> EFS_T void q8_q5_0(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1,
    int64_t cols, const XPrep* xs, Out out) { q8_b32<NT, IQ5_0, true>(W, rb, r0, r1, cols, xs, out); }
template <int NT> EFS_T void q8_q5_1(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1,
    int64_t cols, const XPrep* xs, Out out) { q8_b32<NT, IQ5_1, false>(W, rb, r0, r1, cols, xs, out); }
template <int NT> EFS_T void q8_q8_0(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1,
    int64_t cols, const XPrep* xs, Out out) { q8_b32<NT, IQ8_0, true>(W, rb, r0, r1, cols, xs, out); }
template <int NT> EFS_T void q8_mxfp4(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1,
    int64_t cols, const XPrep* xs, Out out) { q8_b32<NT, IMXFP4, true>(W, rb, r0, r1, cols, xs, out); }

template <int NT> EFS_T void q8_q4_k(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1,
    int64_t cols, const XPrep* xs, Out out) { q8_q45_k<NT, false>(W, rb, r0, r1, cols, xs, out); }
template <int NT> EFS_T void q8_q5_k(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1,
    int64_t cols, const XPrep* xs, Out out) { q8_q45_k<NT, true>(W, rb, r0, r1, cols, xs, out); }

// IQ4_XS against Q8_K: per group of 32 the table values times the activations, times the
// group's 6-bit scale less 32; per block acc += (dy * d) * float(the int32 sums).
template <int NT>
EFS_T void q8_iq4_xs(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                     const XPrep* xs, Out out) {
    const int64_t nb = cols / 256;
    const __m256i tbl = tbl_iq4nl_s();
    const Q8K* y[NT];
    for (int t = 0; t < NT; ++t) y[t] = (const Q8K*)xs[t].q;
    const char* pf = pf_start(W + r0 * rb);
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* b = W + r * rb;
        __m256 acc[NT];
        for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
        for (int64_t i = 0; i < nb; ++i, b += 136) {
            pf_next(pf, b + 136);
            __m256i sumi[NT];
            for (int t = 0; t < NT; ++t) sumi[t] = _mm256_setzero_si256();
            for (int ib = 0; ib < 8; ++ib) {
                const __m256i v = _mm256_shuffle_epi8(tbl, nibbles(loadu128(b + 8 + 16 * ib)));
                const __m256i av = _mm256_sign_epi8(v, v);
                const __m256i ls = _mm256_set1_epi16((short)(iq4xs_ls(b, ib) - 32));
                for (int t = 0; t < NT; ++t) {
                    const __m256i yv8 = loadu256((const uint8_t*)(y[t][i].qs + 32 * ib));
                    const __m256i p = _mm256_maddubs_epi16(av, _mm256_sign_epi8(yv8, v));
                    sumi[t] = _mm256_add_epi32(sumi[t], _mm256_madd_epi16(ls, p));
                }
            }
            const float d = f16(b);
            for (int t = 0; t < NT; ++t)
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(y[t][i].d * d),
                                         _mm256_cvtepi32_ps(sumi[t]), acc[t]);
        }
        for (int t = 0; t < NT; ++t) out.put(t, r, hsum(acc[t]));
    }
}

EFS_EX_ROWS(q8_q4_0) EFS_EX_ROWS(q8_q4_1) EFS_EX_ROWS(q8_q5_0) EFS_EX_ROWS(q8_q5_1)
EFS_EX_ROWS(q8_q8_0) EFS_EX_ROWS(q8_mxfp4) EFS_EX_ROWS(q8_iq4_nl) EFS_EX_ROWS(q8_q4_k)
EFS_EX_ROWS(q8_q5_k) EFS_EX_ROWS(q8_q6_k) EFS_EX_ROWS(q8_q2_k) EFS_EX_ROWS(q8_q3_k)
EFS_EX_ROWS(q8_iq4_xs)

}  // namespace

// ---------------------------------------------------------------------------------------------
// activation quantization
// ---------------------------------------------------------------------------------------------

EFS_T void avx2_quantize_q8k(const float* x, Q8K* y, int64_t n) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < n / 256; ++i, x += 256) {
        __m256 mx = _mm256_setzero_ps();
        for (int j = 0; j < 256; j += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        if (!(amax > 0.f)) {
            y[i].d = 0.f;
            memset(y[i].qs, 0, 256);
            memset(y[i].bsums, 0, sizeof y[i].bsums);
            continue;
        }
        float max = 0.f;                    // the first element of largest magnitude, signed
        for (int j = 0; j < 256; ++j)
            if (fabsf(x[j]) == amax) { max = x[j]; break; }
        const float iscale = -127.f / max;
        const __m256 mul = _mm256_set1_ps(iscale);
        const __m256i c127 = _mm256_set1_epi32(127);
        const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for (int j = 0; j < 256; j += 32) {
            __m256i v[4];
            for (int k = 0; k < 4; ++k)
                v[k] = _mm256_min_epi32(c127, _mm256_cvtps_epi32(_mm256_round_ps(
                    _mm256_mul_ps(_mm256_loadu_ps(x + j + 8 * k), mul),
                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
            __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]),
                                           _mm256_packs_epi32(v[2], v[3]));
            p = _mm256_permutevar8x32_epi32(p, perm);
            _mm256_storeu_si256((__m256i*)(y[i].qs + j), p);
            // bsums: sum of 16 signed bytes = sad(q ^ 0x80, 0) over both 8-byte halves - 2048
            const __m256i s = _mm256_sad_epu8(_mm256_xor_si256(p, _mm256_set1_epi8((char)0x80)),
                                              _mm256_setzero_si256());
            alignas(32) int64_t sv[4];
            _mm256_store_si256((__m256i*)sv, s);
            y[i].bsums[j / 16] = (int16_t)(sv[0] + sv[1] - 2048);
            y[i].bsums[j / 16 + 1] = (int16_t)(sv[2] + sv[3] - 2048);
        }
        y[i].d = 1.f / iscale;
    }
}

EFS_T void avx2_quantize_qx8(const float* x, QX8* y, int64_t n, int with_sum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t i = 0; i < n / 32; ++i, x += 32) {
        __m256 v[4];
        __m256 mx = _mm256_setzero_ps();
        for (int k = 0; k < 4; ++k) {
            v[k] = _mm256_loadu_ps(x + 8 * k);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[k]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        const float d = amax / 127.f, id = amax != 0.f ? 127.f / amax : 0.f;
        const __m256 mul = _mm256_set1_ps(id);
        __m256i q[4];
        for (int k = 0; k < 4; ++k)
            q[k] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[k], mul),
                                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        const int sum = hsum_i32(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]),
                                                  _mm256_add_epi32(q[2], q[3])));
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i*)y[i].qs, _mm256_permutevar8x32_epi32(p, perm));
        y[i].d = _cvtsh_ss(_cvtss_sh(d, 0));
        y[i].s = with_sum ? _cvtsh_ss(_cvtss_sh(d * (float)sum, 0)) : 0.f;
    }
}

// exp(x) to about 1 ulp: x = n ln2 + r, |r| <= ln2/2, e^r by a degree-6 polynomial (Cephes
// expf coefficients), 2^n by the exponent field.
EFS_TI __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33654f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500E-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                         _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// g[i] = (g[i], or 1 for a sigmoid) / (1 + exp(-g[i])) over n floats.
template <bool SILU>
EFS_T void sig_rows(float* g, int64_t n) {
    int64_t i = 0;
    const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 e = exp8(_mm256_sub_ps(zero, x));
        _mm256_storeu_ps(g + i, _mm256_div_ps(SILU ? x : one, _mm256_add_ps(one, e)));
    }
    for (; i < n; ++i) g[i] = (SILU ? g[i] : 1.f) / (1.f + expf(-g[i]));
}

EFS_T void avx2_sigmoid(float* g, int64_t n) { sig_rows<false>(g, n); }
EFS_T void avx2_silu(float* g, int64_t n) { sig_rows<true>(g, n); }

EFS_T void avx2_silu_mul(float* g, const float* u, int64_t n, float limit, float alpha) {
    int64_t i = 0;
    const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
    if (alpha > 0.f) {                  // swiglu_oai: x / (1 + exp(alpha (-x))) * (v + 1)
        const float L = limit > 0.f ? limit : INFINITY;
        const __m256 hi = _mm256_set1_ps(L), lo = _mm256_set1_ps(-L), a = _mm256_set1_ps(alpha);
        for (; i + 8 <= n; i += 8) {
            const __m256 x = _mm256_min_ps(hi, _mm256_loadu_ps(g + i));
            const __m256 v = _mm256_max_ps(lo, _mm256_min_ps(hi, _mm256_loadu_ps(u + i)));
            const __m256 e = exp8(_mm256_mul_ps(a, _mm256_sub_ps(zero, x)));
            const __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, e));
            _mm256_storeu_ps(g + i, _mm256_mul_ps(s, _mm256_add_ps(v, one)));
        }
        silu_mul(g + i, u + i, n - i, limit, alpha);
        return;
    }
    if (limit > 0.f) {                  // swiglu_clamp: silu(min(g, L)) * clamp(u, -L, L)
        const __m256 hi = _mm256_set1_ps(limit), lo = _mm256_set1_ps(-limit);
        for (; i + 8 <= n; i += 8) {
            // (limit first: min/max return their second operand on NaN, which then stays NaN)
            const __m256 x = _mm256_min_ps(hi, _mm256_loadu_ps(g + i));
            const __m256 v = _mm256_max_ps(lo, _mm256_min_ps(hi, _mm256_loadu_ps(u + i)));
            const __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, x))));
            _mm256_storeu_ps(g + i, _mm256_mul_ps(s, v));
        }
        silu_mul(g + i, u + i, n - i, limit);
        return;
    }
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, x))));
        _mm256_storeu_ps(g + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
    }
    for (; i < n; ++i) g[i] = g[i] / (1.f + expf(-g[i])) * u[i];
}

// Four key rows per step against the head's query (its chunks loaded once per step), FMAs;
// the softmax's e^x eight at a time (exp8); the values accumulated 64 columns at a time in
// registers.
EFS_T void avx2_attn_heads(const AttnArgs& a, int64_t h0, int64_t h1, float* p) {
    const int64_t group = a.H / a.K, D = a.D, Dv = a.Dv, S = a.S, D8 = D / 8 * 8;
    for (int64_t h = h0; h < h1; ++h) {
        const int64_t g = h / group;
        const float* qh = a.q + h * D;
        const float* kg = a.kc + g * a.cap * D;
        const float* vg = a.vc + g * a.cap * Dv;
        int64_t j = 0;
        for (; j + 4 <= S; j += 4) {
            const float* k0 = kg + j * D;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t i = 0; i < D8; i += 8) {
                const __m256 qv = _mm256_loadu_ps(qh + i);
                a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + i), a0);
                a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + D + i), a1);
                a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 2 * D + i), a2);
                a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 3 * D + i), a3);
            }
            float d[4] = {hsum(a0), hsum(a1), hsum(a2), hsum(a3)};
            for (int64_t i = D8; i < D; ++i)
                for (int r = 0; r < 4; ++r) d[r] += qh[i] * k0[r * D + i];
            for (int r = 0; r < 4; ++r) p[j + r] = d[r] * a.scale;
        }
        for (; j < S; ++j) {                               // the last S % 4 rows
            const float* kr = kg + j * D;
            __m256 acc = _mm256_setzero_ps();
            for (int64_t i = 0; i < D8; i += 8)
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + i), _mm256_loadu_ps(kr + i), acc);
            float d = hsum(acc);
            for (int64_t i = D8; i < D; ++i) d += qh[i] * kr[i];
            p[j] = d * a.scale;
        }
        float m = p[0];
        for (int64_t t = 1; t < S; ++t) m = p[t] > m ? p[t] : m;
        const __m256 mv = _mm256_set1_ps(m);
        __m256 sv = _mm256_setzero_ps();
        int64_t t = 0;
        for (; t + 8 <= S; t += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + t), mv));
            _mm256_storeu_ps(p + t, e);
            sv = _mm256_add_ps(sv, e);
        }
        float sum = hsum(sv);
        for (; t < S; ++t) sum += (p[t] = expf(p[t] - m));
        const float inv = 1.0f / sum;
        for (t = 0; t < S; ++t) p[t] *= inv;
        float* oh = a.o + h * Dv;
        int64_t c = 0;
        for (; c + 64 <= Dv; c += 64) {
            __m256 o[8];
            for (int l = 0; l < 8; ++l) o[l] = _mm256_setzero_ps();
            for (t = 0; t < S; ++t) {
                const __m256 w = _mm256_broadcast_ss(p + t);
                const float* v = vg + t * Dv + c;
                for (int l = 0; l < 8; ++l)
                    o[l] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * l), o[l]);
            }
            for (int l = 0; l < 8; ++l) _mm256_storeu_ps(oh + c + 8 * l, o[l]);
        }
        for (; c < Dv; ++c) {
            float acc = 0.0f;
            for (t = 0; t < S; ++t) acc += p[t] * vg[t * Dv + c];
            oh[c] = acc;
        }
    }
}

// Q6_K rows as float32, each weight d * sc * q as the scalar dequant_rows computes it
// ((d * sc) rounded once, then times q): the unpack of ex_q6_k, 8 weights a conversion.
static EFS_T void deq_q6_k(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                           float* y) {
    const __m256i k32 = _mm256_set1_epi8(32);
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* b = W + r * rb;
        for (int64_t i = 0; i < cols / 256; ++i, b += 210, y += 256) {
            const float d = f16(b + 208);
            const int8_t* sc = (const int8_t*)(b + 192);
            for (int h = 0; h < 2; ++h) {
                __m256i q[4];
                q6_planes(b, h, q);
                for (int k = 0; k < 4; ++k) {               // elements 128h + 32k + l
                    const __m256i v = _mm256_sub_epi8(q[k], k32);
                    const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
                    const __m256 s0 = _mm256_set1_ps(d * (float)sc[8 * h + 2 * k]);
                    const __m256 s1 = _mm256_set1_ps(d * (float)sc[8 * h + 2 * k + 1]);
                    float* o = y + 128 * h + 32 * k;
                    _mm256_storeu_ps(o, _mm256_mul_ps(s0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo))));
                    _mm256_storeu_ps(o + 8, _mm256_mul_ps(s0, _mm256_cvtepi32_ps(
                        _mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)))));
                    _mm256_storeu_ps(o + 16, _mm256_mul_ps(s1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi))));
                    _mm256_storeu_ps(o + 24, _mm256_mul_ps(s1, _mm256_cvtepi32_ps(
                        _mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)))));
                }
            }
        }
    }
}

// Q4_K / Q5_K rows as float32: each weight d1 * q - m1 (d1 = d * scale, m1 = dmin * min, a
// multiply then a subtraction, not fused), as ggml's dequantize_row_q4_K / q5_K and the scalar
// deq_block give it.
template <bool FIVE>
static EFS_T void deq_q45_k(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,
                            float* y) {
    const int BYTES = FIVE ? 176 : 144;
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* b = W + r * rb;
        for (int64_t i = 0; i < cols / 256; ++i, b += BYTES, y += 256) {
            alignas(32) float ds[8], ms[8];               // d * scale, dmin * min
            _mm256_store_ps(ms, q45_scales(b, ds));
            const uint8_t* q = b + (FIVE ? 48 : 16);
            __m256i hb = FIVE ? loadu256(b + 16) : _mm256_setzero_si256();
            for (int j = 0; j < 4; ++j) {
                __m256i nib[2];
                q45_planes<FIVE>(loadu256(q + 32 * j), hb, nib[0], nib[1]);
                for (int h = 0; h < 2; ++h) {             // sub-block 2j + h: elements 64j + 32h + l
                    const __m256 d1 = _mm256_set1_ps(ds[2 * j + h]);
                    const __m256 m1 = _mm256_set1_ps(ms[2 * j + h]);
                    const __m128i lo = _mm256_castsi256_si128(nib[h]);
                    const __m128i hi = _mm256_extracti128_si256(nib[h], 1);
                    const __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
                    float* o = y + 64 * j + 32 * h;
                    for (int k = 0; k < 4; ++k)
                        _mm256_storeu_ps(o + 8 * k, _mm256_sub_ps(_mm256_mul_ps(d1,
                            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part[k]))), m1));
                }
            }
        }
    }
}

bool avx2_dequant_rows(int type, const uint8_t* W, int64_t rb, int64_t r0, int64_t r1,
                       int64_t cols, float* y) {
    switch (type) {
        case T_Q6_K: deq_q6_k(W, rb, r0, r1, cols, y); return true;
        case T_Q4_K: deq_q45_k<false>(W, rb, r0, r1, cols, y); return true;
        case T_Q5_K: deq_q45_k<true>(W, rb, r0, r1, cols, y); return true;
        default: return avx2_iq_dequant_rows(type, W, rb, r0, r1, cols, y);   // lattice, TQ
    }
}

RowsFn avx2_rows(int type, int mode) {
#define EFS_CASE(T, name) case T: return mode == 0 ? rows_ex_##name : rows_q8_##name;
    switch (type) {
        EFS_CASE(T_Q4_0, q4_0) EFS_CASE(T_Q4_1, q4_1) EFS_CASE(T_Q5_0, q5_0)
        EFS_CASE(T_Q5_1, q5_1) EFS_CASE(T_Q8_0, q8_0) EFS_CASE(T_MXFP4, mxfp4)
        EFS_CASE(T_Q2_K, q2_k) EFS_CASE(T_Q3_K, q3_k) EFS_CASE(T_Q4_K, q4_k)
        EFS_CASE(T_Q5_K, q5_k) EFS_CASE(T_Q6_K, q6_k) EFS_CASE(T_IQ4_XS, iq4_xs)
        EFS_CASE(T_IQ4_NL, iq4_nl)
        case T_F16: return rows_ex_f16;       // q8 mode: fp16-rounded activations (X_F16R)
        case T_BF16: return rows_ex_bf16;     // q8 mode: bf16-rounded activations (X_BF16R)
        default: return avx2_iq_rows(type, mode);   // the lattice IQ types (kern_iq_avx2.cpp)
    }
#undef EFS_CASE
}

bool avx2_compiled() { return true; }

}  // namespace efs

#else  // not x86: the portable kernels only

namespace efs {
RowsFn avx2_rows(int, int) { return nullptr; }
bool avx2_compiled() { return false; }
bool avx2_dequant_rows(int, const uint8_t*, int64_t, int64_t, int64_t, int64_t, float*) {
    return false;
}
void avx2_quantize_q8k(const float* x, Q8K* y, int64_t n) { quantize_q8k(x, y, n); }
void avx2_quantize_qx8(const float* x, QX8* y, int64_t n, int s) { quantize_qx8(x, y, n, s); }
void avx2_silu_mul(float* g, const float* u, int64_t n, float limit, float alpha) {
    silu_mul(g, u, n, limit, alpha);
}
void avx2_silu(float* g, int64_t n) {
    for (int64_t i = 0; i < n; ++i) g[i] = g[i] / (1.f + expf(-g[i]));
}
void avx2_sigmoid(float* g, int64_t n) {
    for (int64_t i = 0; i < n; ++i) g[i] = 1.f / (1.f + expf(-g[i]));
}
void avx2_attn_heads(const AttnArgs&, int64_t, int64_t, float*) {}   // never called off x86
}  // namespace efs

#endif
