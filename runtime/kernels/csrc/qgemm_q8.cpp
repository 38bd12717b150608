// Products of many tokens in q8 mode with 8-bit integer dot products (AVX-512 VNNI, or AVX-VNNI
// in 256-bit vectors with the same bits): the panel product of qgemm.cpp for llama.cpp's
// numerics. The activations are Q8_K (ggml's
// quantize_row_q8_K, as the q8 row kernels take them), the weights a block's integers, and
// every multiply-add of a block is an exact integer one; the float steps per 256-weight block
// are the q8 row kernels' (d_x * d * isum, less d_x * dmin * msum where the type has mins), so
// the results are those kernels' up to float summation order, as llama.cpp's own tiled products
// are.
//
//  - a panel is 32 rows (two vectors of 16 lanes, a lane a row) of one 256-weight block: each
//    row decoded to 256 unsigned bytes (decode_block: the K-quants' values as stored, the
//    lattice IQ and ternary types' signed grid values + 128) and its integer multipliers per
//    group of 16 or 32 weights, then transposed so that a 32-bit lane holds 4 consecutive
//    weights of one row (vpdpbusd's unsigned operand);
//  - the activations are the Q8_K blocks as the q8 row kernels take them: vpdpbusd multiplies
//    the weights by each token's signed bytes, broadcast 4 at a time. What a weight's offset
//    adds (Q6_K's 32, the IQ types' 128, times the group's sum of x) is taken off per block
//    from the Q8_K block's sums of 16 (bsums) by one vpdpwssd per two groups, as the mins of
//    Q2_K, Q4_K and Q5_K are (off: the rows' offset multipliers or mins as int16 pairs);
//  - the micro-kernel keeps 2 row vectors x NT tokens of group sums and of block sums in
//    registers: for 4 weights it loads the two weight vectors, broadcasts each token's 4 bytes
//    and issues 2 NT vpdpbusd (64 multiply-adds each: four times a float32 FMA's 16); at the
//    end of a group the group's sums are multiplied by the rows' multipliers (vpmulld) into the
//    block sums. A block's panel (8 KiB) stays in the L1 cache while every token uses it.
#include "kern.h"

#include <string.h>

#if (defined(__x86_64__) || defined(__i386__)) && !defined(EFS_EMULATE_AVX512)
#include "kern_avx2_util.h"
#define EFS_KT EFS_T
#include "kern_iq_avx2_types.h"
#include "kern_k_avx2.h"      // q45_planes, q6_planes, k4_scales: a block's fields
#include "qpanel_rows.h"       // decode_block
#include "transpose16.h"

#define EFS_V __attribute__((target("avx512f,avx512vl,avx512bw,avx512vnni,avx2,fma,f16c")))
#define EFS_VI __attribute__((target("avx512f,avx512vl,avx512bw,avx512vnni,avx2,fma,f16c"), \
                              always_inline)) inline
#define EFS_W __attribute__((target("avx2,fma,f16c,avxvnni")))        // AVX-VNNI, 256 bits

namespace efs {
namespace {

constexpr int NV = 2;            // row vectors of a panel
constexpr int TILE = 6;          // tokens per micro-kernel call (AVX-512)
constexpr int TILE8 = 3;         // the same under AVX-VNNI (16 registers)

// One 256-weight block of 32 rows, decoded.
struct alignas(64) Panel {
    int32_t w[NV][64][16];       // [vector][4-weight step][row]: 4 unsigned weights per lane
    int32_t ls[NV][16][16];      // [vector][group][row] integer multipliers
    int32_t off[NV][8][16];      // [vector][pair][row] two int16: the multipliers of groups
                                 // 2p, 2p+1 of the weights' offset (Q6_K sc, IQ ls), or
                                 // the mins of groups 2p, 2p+1 (Q2_K) or of the
                                 // 32-group p, twice (Q4_K/Q5_K)
    float a[NV][16];             // d (K-quants), d * F (IQ types)
    float m[NV][16];             // dmin (the types with mins), else 0
    alignas(64) uint8_t rows[16][256];   // one vector's rows before the transpose
};

EFS_TI int32_t i16pair(int lo, int hi) {
    return (int32_t)(((uint32_t)(uint16_t)(int16_t)hi << 16) | (uint16_t)(int16_t)lo);
}

// Row j of vector v from block b: weights into p.rows[j], multipliers, offsets and scales.
template <int TYPE>
EFS_TI void decode_row(const uint8_t* b, Panel& p, int v, int j) {
    int32_t ls[16], mn[16];
    decode_block<TYPE>(b, p.rows[j], ls, mn, &p.a[v][j], &p.m[v][j]);
    if constexpr (LS_GROUP<TYPE> == 32) {
        for (int g = 0; g < 8; ++g) {
            p.ls[v][g][j] = ls[g];                          // groups of 32
            p.off[v][g][j] = i16pair(mn[g], mn[g]);         // its two bsums
        }
    } else {
        const int32_t* o = HAS_MINS<TYPE> ? mn : ls;        // Q2_K's mins per 16, else ls
        for (int g = 0; g < 16; ++g) p.ls[v][g][j] = ls[g];
        for (int q2 = 0; q2 < 8; ++q2) p.off[v][q2][j] = i16pair(o[2 * q2], o[2 * q2 + 1]);
    }
}

// A zero row (past the matrix's last): no weights, no multipliers.
EFS_TI void zero_row(Panel& p, int v, int j) {
    memset(p.rows[j], 0, 256);
    for (int g = 0; g < 16; ++g) p.ls[v][g][j] = 0;
    for (int q2 = 0; q2 < 8; ++q2) p.off[v][q2][j] = 0;
    p.a[v][j] = p.m[v][j] = 0.f;
}

// p.rows (16 rows of 64 32-bit words) into p.w[v] ([64 words][16 rows]): four 16 x 16
// transposes.
template <class P>
EFS_VI void transpose(P& p, int v) {
    for (int cb = 0; cb < 4; ++cb)
        transpose16((const int32_t*)(p.rows[0] + 64 * cb), 64, p.w[v][16 * cb], 16);
}

#if EFS_AVXVNNI_TARGET
// The same for AVX2 (8 rows a vector): p.rows into p.w[v] in the same layout, 8 x 8 blocks
// of 32-bit words transposed by unpacks and 128-bit permutes.
EFS_TI void transpose8(Panel& p, int v) {
    for (int h = 0; h < 2; ++h)                       // rows 8h .. 8h + 7
        for (int qb = 0; qb < 8; ++qb) {              // words 8qb .. 8qb + 7
            __m256i r[8], t[8], u[8];
            for (int i = 0; i < 8; ++i)
                r[i] = _mm256_load_si256((const __m256i*)(p.rows[8 * h + i] + 32 * qb));
            for (int i = 0; i < 8; i += 2) {
                t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
                t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
            }
            for (int i = 0; i < 8; i += 4) {
                u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
                u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
                u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
                u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
            }
            for (int j = 0; j < 4; ++j) {
                _mm256_store_si256((__m256i*)(p.w[v][8 * qb + j] + 8 * h),
                                   _mm256_permute2x128_si256(u[j], u[j + 4], 0x20));
                _mm256_store_si256((__m256i*)(p.w[v][8 * qb + j + 4] + 8 * h),
                                   _mm256_permute2x128_si256(u[j], u[j + 4], 0x31));
            }
        }
}

#endif

// A panel reads 32 rows' block i, 32 short runs a row apart that the hardware prefetchers do
// not follow; a prompt reads each expert's weights once, from memory. So as row r's block i
// (of nb) is decoded, the block PF_BLOCKS further on is prefetched (past the row's last block,
// row r + 32's, the next panel's), the tokens' products of the blocks between giving the lines
// time to arrive (past the matrix's end: harmless).
constexpr int64_t PF_BLOCKS = 2;
EFS_TI void prefetch_ahead(const uint8_t* W, int64_t rb, int64_t r, int64_t i, int64_t nb,
                           int64_t bytes) {
    int64_t a = i + PF_BLOCKS;
    if (a >= nb) a -= nb, r += 32;
    const char* b = (const char*)(W + r * rb + a * bytes);
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(b + o, _MM_HINT_T0);
    _mm_prefetch(b + bytes - 1, _MM_HINT_T0);
}

// Vector v's 16 rows of the matrix (rows r0 + 16 v ...) at block i into p.rows, with their
// multipliers and scales (rows past r1 zero).
template <int TYPE>
EFS_TI void decode_rows(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t i,
                        int bytes, Panel& p, int v) {
    for (int j = 0; j < 16; ++j) {
        const int64_t r = r0 + 16 * v + j;
        if (r < r1) {
            prefetch_ahead(W, rb, r, i, rb / bytes, bytes);
            decode_row<TYPE>(W + r * rb + i * bytes, p, v, j);
        } else
            zero_row(p, v, j);
    }
}

// Rows [r0, r0 + 32) of the matrix at block i into p.
template <int TYPE>
EFS_V void decode_panel(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t i,
                        int bytes, Panel& p) {
    for (int v = 0; v < NV; ++v) {
        decode_rows<TYPE>(W, rb, r0, r1, i, bytes, p, v);
        transpose(p, v);
    }
}

#if EFS_AVXVNNI_TARGET
template <int TYPE>
EFS_W void decode_panel8(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t i,
                         int bytes, Panel& p) {
    for (int v = 0; v < NV; ++v) {
        decode_rows<TYPE>(W, rb, r0, r1, i, bytes, p, v);
        transpose8(p, v);
    }
}
#endif

// NT tokens (t0 ...) of block i against panel p into C [token][32] (stride 32), added.
template <int NT, int G, int SHIFT>
EFS_V void tile(const Panel& p, const Q8K* x, int64_t nb, int64_t t0, int64_t i, float* C) {
    __m512i bsum[NV][NT];
    for (int v = 0; v < NV; ++v)
        for (int t = 0; t < NT; ++t) bsum[v][t] = _mm512_setzero_si512();
    const Q8K* xb[NT];
    for (int t = 0; t < NT; ++t) xb[t] = x + (t0 + t) * nb + i;
    for (int g = 0; g < 256 / G; ++g) {
        __m512i acc[NV][NT];
        for (int v = 0; v < NV; ++v)
            for (int t = 0; t < NT; ++t) acc[v][t] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int s = g * G / 4; s < (g + 1) * G / 4; ++s) {
            const __m512i w0 = _mm512_load_si512(p.w[0][s]), w1 = _mm512_load_si512(p.w[1][s]);
            for (int t = 0; t < NT; ++t) {
                int32_t q;
                memcpy(&q, xb[t]->qs + 4 * s, 4);
                const __m512i xq = _mm512_set1_epi32(q);
                acc[0][t] = _mm512_dpbusd_epi32(acc[0][t], w0, xq);
                acc[1][t] = _mm512_dpbusd_epi32(acc[1][t], w1, xq);
            }
        }
        for (int v = 0; v < NV; ++v) {
            const __m512i l = _mm512_load_si512(p.ls[v][g]);
            for (int t = 0; t < NT; ++t)
                bsum[v][t] = _mm512_add_epi32(bsum[v][t], _mm512_mullo_epi32(acc[v][t], l));
        }
    }
    for (int v = 0; v < NV; ++v) {
        const __m512 a = _mm512_load_ps(p.a[v]);
        for (int t = 0; t < NT; ++t) {
            int32_t bs[8];                                 // the bsums as int16 pairs
            memcpy(bs, xb[t]->bsums, sizeof(bs));
            __m512i o = _mm512_setzero_si512();
            for (int q2 = 0; q2 < 8; ++q2)
                o = _mm512_dpwssd_epi32(o, _mm512_load_si512(p.off[v][q2]),
                                        _mm512_set1_epi32(bs[q2]));
            const __m512 dx = _mm512_set1_ps(xb[t]->d);
            float* c = C + (t0 + t) * 32 + 16 * v;
            __m512 y;
            if (SHIFT >= 0) {                              // the offset's share, in integers
                const __m512i isum = _mm512_sub_epi32(bsum[v][t], _mm512_slli_epi32(o, SHIFT));
                y = _mm512_mul_ps(_mm512_mul_ps(dx, a), _mm512_cvtepi32_ps(isum));
            } else {                                       // dmin * mins
                y = _mm512_sub_ps(_mm512_mul_ps(_mm512_mul_ps(dx, a),
                                                _mm512_cvtepi32_ps(bsum[v][t])),
                                  _mm512_mul_ps(_mm512_mul_ps(dx, _mm512_load_ps(p.m[v])),
                                                _mm512_cvtepi32_ps(o)));
            }
            _mm512_storeu_ps(c, _mm512_add_ps(_mm512_loadu_ps(c), y));
        }
    }
}

template <int G, int SHIFT>
EFS_V void tokens(const Panel& p, const Q8K* x, int64_t nb, int64_t nt, int64_t i, float* C) {
    int64_t t0 = 0;
    for (; t0 + TILE <= nt; t0 += TILE) tile<TILE, G, SHIFT>(p, x, nb, t0, i, C);
    switch (nt - t0) {
        case 1: tile<1, G, SHIFT>(p, x, nb, t0, i, C); break;
        case 2: tile<2, G, SHIFT>(p, x, nb, t0, i, C); break;
        case 3: tile<3, G, SHIFT>(p, x, nb, t0, i, C); break;
        case 4: tile<4, G, SHIFT>(p, x, nb, t0, i, C); break;
        case 5: tile<5, G, SHIFT>(p, x, nb, t0, i, C); break;
        default: break;
    }
}

#if EFS_AVXVNNI_TARGET
// tile's AVX-VNNI form: a row vector (16 rows) as two halves of 8 at a time, the same
// integer sums and, lane by lane, the same float steps, so the same bits.
template <int NT, int G, int SHIFT>
EFS_W void tile8(const Panel& p, const Q8K* x, int64_t nb, int64_t t0, int64_t i, float* C) {
    const Q8K* xb[NT];
    for (int t = 0; t < NT; ++t) xb[t] = x + (t0 + t) * nb + i;
    for (int v = 0; v < NV; ++v) {
        __m256i bsum[2][NT];
        for (int h = 0; h < 2; ++h)
            for (int t = 0; t < NT; ++t) bsum[h][t] = _mm256_setzero_si256();
        for (int g = 0; g < 256 / G; ++g) {
            __m256i acc[2][NT];
            for (int h = 0; h < 2; ++h)
                for (int t = 0; t < NT; ++t) acc[h][t] = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int s = g * G / 4; s < (g + 1) * G / 4; ++s) {
                const __m256i w0 = _mm256_load_si256((const __m256i*)p.w[v][s]);
                const __m256i w1 = _mm256_load_si256((const __m256i*)(p.w[v][s] + 8));
                for (int t = 0; t < NT; ++t) {
                    int32_t q;
                    memcpy(&q, xb[t]->qs + 4 * s, 4);
                    const __m256i xq = _mm256_set1_epi32(q);
                    acc[0][t] = _mm256_dpbusd_avx_epi32(acc[0][t], w0, xq);
                    acc[1][t] = _mm256_dpbusd_avx_epi32(acc[1][t], w1, xq);
                }
            }
            for (int h = 0; h < 2; ++h) {
                const __m256i l = _mm256_load_si256((const __m256i*)(p.ls[v][g] + 8 * h));
                for (int t = 0; t < NT; ++t)
                    bsum[h][t] = _mm256_add_epi32(bsum[h][t], _mm256_mullo_epi32(acc[h][t], l));
            }
        }
        for (int h = 0; h < 2; ++h) {
            const __m256 a = _mm256_load_ps(p.a[v] + 8 * h);
            for (int t = 0; t < NT; ++t) {
                int32_t bs[8];
                memcpy(bs, xb[t]->bsums, sizeof(bs));
                __m256i o = _mm256_setzero_si256();
                for (int q2 = 0; q2 < 8; ++q2)
                    o = _mm256_dpwssd_avx_epi32(
                        o, _mm256_load_si256((const __m256i*)(p.off[v][q2] + 8 * h)),
                        _mm256_set1_epi32(bs[q2]));
                const __m256 dx = _mm256_set1_ps(xb[t]->d);
                float* c = C + (t0 + t) * 32 + 16 * v + 8 * h;
                __m256 y;
                if (SHIFT >= 0) {
                    const __m256i isum = _mm256_sub_epi32(bsum[h][t], _mm256_slli_epi32(o, SHIFT));
                    y = _mm256_mul_ps(_mm256_mul_ps(dx, a), _mm256_cvtepi32_ps(isum));
                } else {
                    y = _mm256_sub_ps(_mm256_mul_ps(_mm256_mul_ps(dx, a),
                                                    _mm256_cvtepi32_ps(bsum[h][t])),
                                      _mm256_mul_ps(_mm256_mul_ps(
                                          dx, _mm256_load_ps(p.m[v] + 8 * h)),
                                          _mm256_cvtepi32_ps(o)));
                }
                _mm256_storeu_ps(c, _mm256_add_ps(_mm256_loadu_ps(c), y));
            }
        }
    }
}

template <int G, int SHIFT>
EFS_W void tokens8(const Panel& p, const Q8K* x, int64_t nb, int64_t nt, int64_t i, float* C) {
    int64_t t0 = 0;
    for (; t0 + TILE8 <= nt; t0 += TILE8) tile8<TILE8, G, SHIFT>(p, x, nb, t0, i, C);
    switch (nt - t0) {
        case 1: tile8<1, G, SHIFT>(p, x, nb, t0, i, C); break;
        case 2: tile8<2, G, SHIFT>(p, x, nb, t0, i, C); break;
        default: break;
    }
}
#endif

// A thread's rows [r0, r1), a 32-row panel at a time: its sums C zeroed, `block(p0, i)` for
// each of its nblk 256-weight blocks (decodes the block and multiplies it by every token into
// C), then C copied to y.
template <class Block>
EFS_TI void over_panels(int64_t r0, int64_t r1, int64_t nt, int64_t nblk, float* C, float* y,
                        int64_t ys, const Block& block) {
    for (int64_t p0 = r0; p0 < r1; p0 += 16 * NV) {
        memset(C, 0, sizeof(float) * 32 * nt);
        for (int64_t i = 0; i < nblk; ++i) block(p0, i);
        const int64_t n = r1 - p0 < 32 ? r1 - p0 : 32;
        for (int64_t t = 0; t < nt; ++t) memcpy(y + t * ys + p0, C + t * 32, n * sizeof(float));
    }
}

// The Q8_K types' panels (WIDE: AVX-512, else AVX-VNNI).
template <int TYPE, bool WIDE>
EFS_TI void panels(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, const Q8K* x,
                   int64_t nt, int64_t cols, float* C, float* y, int64_t ys, Panel& p) {
    constexpr int G = LS_GROUP<TYPE>, SHIFT = OFFSET_SHIFT<TYPE>;
    const int64_t nb = cols / 256;
    const int bytes = (int)(rb / nb);
    over_panels(r0, r1, nt, nb, C, y, ys, [&](int64_t p0, int64_t i) {
        if constexpr (WIDE) {
            decode_panel<TYPE>(W, rb, p0, r1, i, bytes, p);
            tokens<G, SHIFT>(p, x, nb, nt, i, C);
        } else {
#if EFS_AVXVNNI_TARGET
            decode_panel8<TYPE>(W, rb, p0, r1, i, bytes, p);
            tokens8<G, SHIFT>(p, x, nb, nt, i, C);
#endif
        }
    });
}

thread_local Panel t_panel;

#if EFS_AVXVNNI_TARGET
template <int TYPE>
EFS_W void rows_q8_8(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, const void* x,
                     const int32_t*, int64_t nt, int64_t cols, float* C, float* y, int64_t ys) {
    panels<TYPE, false>(W, rb, r0, r1, (const Q8K*)x, nt, cols, C, y, ys, t_panel);
}
#endif

template <int TYPE>
EFS_V void rows_q8(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, const void* x,
                   const int32_t*, int64_t nt, int64_t cols, float* C, float* y, int64_t ys) {
    panels<TYPE, true>(W, rb, r0, r1, (const Q8K*)x, nt, cols, C, y, ys, t_panel);
}

// --- blocks of 32 against Q8_0 / Q8_1 activations (AVX-512) -----------------------------------
//
// Q8_0, Q4_0, IQ4_NL, MXFP4 and Q5_0 against Q8_0 activations, Q4_1 and Q5_1 against Q8_1. The
// same panel of 32 rows x 256 weights (eight blocks), each block's weights as unsigned bytes
// (the signed types' + 128: B32_OFF), its float scale and (Q4_1, Q5_1) min; per block and token
// the integer sum (less 128 times the token's block sum, xsum, for the signed types) times
// d_w * d_x, plus the min times the token's block s (d_x times its sum), added into float sums
// kept in registers over the panel's eight blocks: ggml_vec_dot_*_q8_0's and _q8_1's numerics
// (sumi * (d_w * d_x) per block, + m_w * s_x) up to float rounding and order.

constexpr int TILE32 = 5;        // tokens per call: 2 x 5 integer and 2 x 5 float sums

struct alignas(64) Panel32 {
    int32_t w[NV][64][16];       // as Panel's
    float bd[NV][8][16];         // [vector][block][row] the block's scale
    float bm[NV][8][16];         // [vector][block][row] the block's min (Q4_1, Q5_1)
    alignas(64) uint8_t rows[16][256];
};

// Row j of vector v: its ns blocks from b (the first of them; 8, or fewer at the end of a row
// that is not whole 256-weight panels), weights (+ B32_OFF), scales and mins.
template <int TYPE>
EFS_TI void decode_row32(const uint8_t* b, Panel32& p, int v, int j, int ns) {
    float d[8], m[8];
    decode_blocks32<TYPE>(b, p.rows[j], d, ns, m);
    for (int k = 0; k < ns; ++k) p.bd[v][k][j] = d[k];
    if constexpr (HAS_MINS<TYPE>)
        for (int k = 0; k < ns; ++k) p.bm[v][k][j] = m[k];
}

template <int TYPE>
EFS_V void decode_panel32(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t i,
                          int ns, Panel32& p) {
    for (int v = 0; v < NV; ++v) {
        for (int j = 0; j < 16; ++j) {
            const int64_t r = r0 + 16 * v + j;
            if (r < r1) {
                constexpr int64_t PANEL = 8 * B32_BYTES<TYPE>;     // bytes of 256 weights
                prefetch_ahead(W, rb, r, i, (rb + PANEL - 1) / PANEL, PANEL);
                decode_row32<TYPE>(W + r * rb + i * PANEL, p, v, j, ns);
            } else {
                memset(p.rows[j], 0, 256);
                for (int k = 0; k < 8; ++k) p.bd[v][k][j] = p.bm[v][k][j] = 0.f;
            }
        }
        transpose(p, v);
    }
}

// NT tokens (t0 ...) of the panel's eight blocks (the 256 weights of block-group i).
template <int TYPE, int NT>
EFS_V void tile32(const Panel32& p, const QX8* x, const int32_t* xsum, int64_t nb, int64_t t0,
                  int64_t i, int ns, float* C) {
    __m512 f[NV][NT];
    for (int v = 0; v < NV; ++v)
        for (int t = 0; t < NT; ++t) f[v][t] = _mm512_setzero_ps();
    for (int k = 0; k < ns; ++k) {
        const int64_t blk = 8 * i + k;
        __m512i acc[NV][NT];
        for (int v = 0; v < NV; ++v)
            for (int t = 0; t < NT; ++t) acc[v][t] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int s = 0; s < 8; ++s) {
            const __m512i w0 = _mm512_load_si512(p.w[0][8 * k + s]);
            const __m512i w1 = _mm512_load_si512(p.w[1][8 * k + s]);
            for (int t = 0; t < NT; ++t) {
                int32_t q;
                memcpy(&q, x[(t0 + t) * nb + blk].qs + 4 * s, 4);
                const __m512i xq = _mm512_set1_epi32(q);
                acc[0][t] = _mm512_dpbusd_epi32(acc[0][t], w0, xq);
                acc[1][t] = _mm512_dpbusd_epi32(acc[1][t], w1, xq);
            }
        }
        for (int v = 0; v < NV; ++v) {
            const __m512 bd = _mm512_load_ps(p.bd[v][k]);
            for (int t = 0; t < NT; ++t) {
                const int64_t at = (t0 + t) * nb + blk;
                const __m512i isum = B32_OFF<TYPE> == 0 ? acc[v][t] : _mm512_sub_epi32(
                    acc[v][t], _mm512_set1_epi32(B32_OFF<TYPE> * xsum[at]));
                f[v][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum),
                                          _mm512_mul_ps(bd, _mm512_set1_ps(x[at].d)), f[v][t]);
                if constexpr (HAS_MINS<TYPE>)
                    f[v][t] = _mm512_fmadd_ps(_mm512_load_ps(p.bm[v][k]),
                                              _mm512_set1_ps(x[at].s), f[v][t]);
            }
        }
    }
    for (int v = 0; v < NV; ++v)
        for (int t = 0; t < NT; ++t) {
            float* c = C + (t0 + t) * 32 + 16 * v;
            _mm512_storeu_ps(c, _mm512_add_ps(_mm512_loadu_ps(c), f[v][t]));
        }
}

thread_local Panel32 t_panel32;

template <int TYPE>
EFS_V void rows_q8_32(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, const void* xv,
                      const int32_t* xsum, int64_t nt, int64_t cols, float* C, float* y,
                      int64_t ys) {
    const QX8* x = (const QX8*)xv;
    const int64_t nb = cols / 32;
    Panel32& p = t_panel32;
    const int64_t nblk = (cols + 255) / 256;    // a last panel of fewer blocks: cols % 256
    over_panels(r0, r1, nt, nblk, C, y, ys, [&](int64_t p0, int64_t i) {
        const int ns = panel_steps(i, nblk, cols);
        decode_panel32<TYPE>(W, rb, p0, r1, i, ns, p);
        int64_t t0 = 0;
        for (; t0 + TILE32 <= nt; t0 += TILE32)
            tile32<TYPE, TILE32>(p, x, xsum, nb, t0, i, ns, C);
        switch (nt - t0) {
            case 1: tile32<TYPE, 1>(p, x, xsum, nb, t0, i, ns, C); break;
            case 2: tile32<TYPE, 2>(p, x, xsum, nb, t0, i, ns, C); break;
            case 3: tile32<TYPE, 3>(p, x, xsum, nb, t0, i, ns, C); break;
            case 4: tile32<TYPE, 4>(p, x, xsum, nb, t0, i, ns, C); break;
            default: break;
        }
    });
}

}  // namespace

// The Q8_K types' switch: EFS_Q8_FN, defined around each use, is the rows function template.
#define EFS_Q8_CASE(T, D) case T: return EFS_Q8_FN<T>;
#define EFS_Q8_CASES                                                                      \
    switch (type) {                                                                       \
        EFS_Q8_CASE(T_Q4_K, -) EFS_Q8_CASE(T_Q5_K, -) EFS_Q8_CASE(T_Q6_K, -)              \
        EFS_Q8_CASE(T_Q2_K, -) EFS_Q8_CASE(T_Q3_K, -) EFS_Q8_CASE(T_IQ4_XS, -)            \
        EFS_IQ_DECODERS(EFS_Q8_CASE)                                                      \
        default: return nullptr;                                                          \
    }

QgemmQ8Fn avx512_qgemm_q8(int type) {
    switch (type) {
        case T_Q8_0: return rows_q8_32<T_Q8_0>;
        case T_Q4_0: return rows_q8_32<T_Q4_0>;
        case T_IQ4_NL: return rows_q8_32<T_IQ4_NL>;
        case T_MXFP4: return rows_q8_32<T_MXFP4>;
        case T_Q5_0: return rows_q8_32<T_Q5_0>;
        case T_Q4_1: return rows_q8_32<T_Q4_1>;
        case T_Q5_1: return rows_q8_32<T_Q5_1>;
        default: break;
    }
#define EFS_Q8_FN rows_q8
    EFS_Q8_CASES
#undef EFS_Q8_FN
}
#if EFS_AVXVNNI_TARGET
QgemmQ8Fn avxvnni_qgemm_q8(int type) {
#define EFS_Q8_FN rows_q8_8
    EFS_Q8_CASES
#undef EFS_Q8_FN
}
#else
QgemmQ8Fn avxvnni_qgemm_q8(int) { return nullptr; }
#endif
#undef EFS_Q8_CASES
#undef EFS_Q8_CASE

}  // namespace efs

#else  // not x86, or the emulated-AVX-512 test build (no VNNI there)

namespace efs {
QgemmQ8Fn avx512_qgemm_q8(int) { return nullptr; }
QgemmQ8Fn avxvnni_qgemm_q8(int) { return nullptr; }
}  // namespace efs

#endif
