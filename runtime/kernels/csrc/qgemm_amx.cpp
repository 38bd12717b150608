// Products of many tokens in exact mode on AMX (Intel's tile matrix unit, Sapphire Rapids and
// later: bf16 products summed in float32, 16 x 16 x 32 of them an instruction): qgemm.cpp's
// panel product for the Q8_K types and the blocks-of-32 types Q8_0, Q4_0, Q5_0, Q4_1, Q5_1,
// IQ4_NL and MXFP4 (in rows of any multiple of 32 weights), with nothing rounded but the
// float32 sums.
//
//  - each activation is split into three bf16 numbers whose sum is it exactly (x rounded to
//    bf16, the rest rounded, what is left: 8 + 8 + 8 significant bits hold a float's 24);
//  - the weights are decode_block's integers: u - offset (at most 128 in magnitude, exact in
//    bf16) for the types with a multiplier per 32 weights, whose step of 32 weights is then one
//    A tile, its sums multiplied by the step's a * ls (the blocks-of-32 types: the block's
//    scale) and the mins (Q4_K/Q5_K's m * mn, Q4_1/Q5_1's m, times the group's sum of x) taken
//    off per step
//    (rows_amx); for those with a multiplier per 16 (Q2_K, Q3_K, Q6_K, IQ2_XS, IQ2_S, IQ1_M),
//    v = ls * (u - offset), exact in bf16 (Q2_K, Q3_K: one A tile a step) or split into two
//    exact bf16 numbers (a multiple of 16 and the rest: two A tiles), whose sums add up over
//    the block and are multiplied by a once, Q2_K's mins taken off per block (rows_amx16);
//  - the product of a weight part and an activation part is exact in float32, so the tile
//    unit's sums are float32 sums of exact terms, as the float panel's FMAs are.
// The result is F.linear on the reference dequantization up to float32 rounding (the float
// panel's test bound; closer to the float64 product than the float panel), not the float
// panel's bits: its summation order differs.
//
// Layout: the weights are the tiles' A operand (16 rows x 32 weights, a panel's rows as they are
// decoded; a panel is 32 rows, two A tiles); the activations the B operand, prepared once per
// call (amx_prepare) as bf16 pairs of consecutive weights' activations, [part][token tile]
// [pair][16 tokens]; the sums C are 16 rows x 16 tokens in tiles 4-7.
#include "kern.h"

#include <string.h>

#include <memory>
#include <vector>

#if (defined(__x86_64__) || defined(__i386__)) && !defined(EFS_EMULATE_AVX512) && \
    EFS_AMX_TARGET
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "kern_avx2_util.h"
#define EFS_KT EFS_T
#include "kern_iq_avx2_types.h"
#include "kern_k_avx2.h"      // q45_planes, q6_planes, k4_scales
#include "qpanel_rows.h"      // decode_block
#include "transpose16.h"

#define EFS_X __attribute__((target( \
    "avx512f,avx512vl,avx512bw,avx512bf16,amx-tile,amx-bf16,avx2,fma,f16c")))
// The tile loads read memory the compiler is not told of: stores before them must be done.
#define EFS_MEMORY_BARRIER() __asm__ volatile("" ::: "memory")

namespace efs {
namespace {

struct alignas(64) TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// A 32-row panel of one 256-weight block: for each 32-weight step two A tiles (rows 0-15,
// 16-31), with their rows' float multipliers of the step's group (a * ls) and mins (Q4_K/Q5_K's
// m * mn, Q4_1/Q5_1's -m).
struct alignas(64) AmxPanel {
    uint16_t A[8][2][16][32];    // [step][half][row][weight]: bf16 of u - offset
    float s[2][16][8];           // [half][row][step] the multiplier of the step's group
    float mm[2][16][8];          // ... and its mins' (HAS_MINS), else 0
};

// 32 floats that are integers of at most 8 significant bits as 32 bf16 (exact: their upper
// halves).
EFS_X inline void store_bf16(uint16_t* o, __m512 f0, __m512 f1) {
    const __m512i odd = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37,
                                         35, 33, 31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7,
                                         5, 3, 1);
    _mm512_storeu_si512(o, _mm512_permutex2var_epi16(_mm512_castps_si512(f0), odd,
                                                     _mm512_castps_si512(f1)));
}

// 32 signed bytes as 32 bf16.
EFS_X inline void store_bf16_i8(uint16_t* o, __m256i v8) {
    store_bf16(o, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v8))),
               _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v8, 1))));
}

// 32 int16 of at most 8 significant bits as 32 bf16.
EFS_X inline void store_bf16_i16(uint16_t* o, __m512i v) {
    store_bf16(o, _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(v))),
               _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(v, 1))));
}

// The types whose multipliers are per group of 32 weights, a step's A tile (Q4_K, Q5_K, IQ4_XS,
// the IQ and TQ types with one multiplier per 32, and the blocks-of-32 types, whose float
// scale is the step's), take the sums of each step times its multiplier (rows_amx); those with
// a multiplier per 16 (Q2_K, Q3_K, Q6_K, IQ2_XS, IQ2_S, IQ1_M) the multipliers folded into the
// weights (rows_amx16).
template <int TYPE>
constexpr bool blocks32() {
    return TYPE == T_Q8_0 || TYPE == T_Q4_0 || TYPE == T_IQ4_NL || TYPE == T_MXFP4 ||
           TYPE == T_Q5_0 || TYPE == T_Q4_1 || TYPE == T_Q5_1;
}

template <int TYPE>
constexpr bool per32() {
    if constexpr (TYPE == T_Q4_K || TYPE == T_Q5_K || TYPE == T_IQ4_XS || blocks32<TYPE>())
        return true;
    else if constexpr (TYPE == T_Q2_K || TYPE == T_Q3_K || TYPE == T_Q6_K) return false;
    else return !IqOf<TYPE>::D::PAIR;
}

// The 4- and 5-bit blocks whose values index a table of at most 32 (Q4_0's q - 8, Q5_0's q -
// 16, Q4_1's and Q5_1's q, IQ4_NL's and IQ4_XS's kvalues): a step's 32 weights become bf16 by
// one word permute of the table (bf16_lut) instead of a conversion through float. (Measured
// slower for Q4_K's and Q5_K's bytes, and no faster for MXFP4's nibbles, so those convert.)
template <int TYPE>
constexpr bool LUT = TYPE == T_Q4_0 || TYPE == T_IQ4_NL || TYPE == T_IQ4_XS ||
                     TYPE == T_Q5_0 || TYPE == T_Q4_1 || TYPE == T_Q5_1;

// The table of a LUT type, its 32 entries as bf16 into t.
template <int TYPE>
EFS_X void bf16_lut(uint16_t* t) {
    const __m256i k = _mm256_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16,
                                       17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
    const __m256i v = TYPE == T_Q4_0 ? _mm256_sub_epi8(k, _mm256_set1_epi8(8))
                      : TYPE == T_Q5_0 ? _mm256_sub_epi8(k, _mm256_set1_epi8(16))
                      : TYPE == T_Q4_1 || TYPE == T_Q5_1 ? k : tbl_iq4nl_s();
    store_bf16_i8(t, v);
}

// 32 indices (bytes under 32) as their bf16 values from lut.
EFS_X inline void store_lut(uint16_t* o, __m256i idx, __m512i lut) {
    _mm512_storeu_si512(o, _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(idx), lut));
}

// decode_panel's row j (h, r) of a LUT type at b (its block, or its first block of 32).
template <int TYPE>
EFS_X void decode_lut_row(const uint8_t* b, int ns, __m512i lut, AmxPanel& P, int h, int r) {
    if constexpr (TYPE == T_IQ4_XS) {
        const float a = f16(b);
        for (int kk = 0; kk < 8; ++kk) {
            P.s[h][r][kk] = a * (float)(iq4xs_ls(b, kk) - 32);
            store_lut(P.A[kk][h][r], nibbles(loadu128(b + 8 + 16 * kk)), lut);
        }
        _mm256_storeu_ps(P.mm[h][r], _mm256_setzero_ps());
    } else {                                            // blocks of 32
        for (int kk = 0; kk < ns; ++kk, b += B32_BYTES<TYPE>) {
            P.s[h][r][kk] = f16(b);
            P.mm[h][r][kk] = HAS_MINS<TYPE> ? -f16(b + 2) : 0.f;   // w = d q + m
            store_lut(P.A[kk][h][r], b32_codes<TYPE>(b), lut);
        }
    }
}

// decode_panel's row j (h, r) of the other types at b: decode_block's (or decode_blocks32's)
// bytes less the offset, through float to bf16.
template <int TYPE>
EFS_X void decode_bytes_row(const uint8_t* b, int ns, AmxPanel& P, int h, int r) {
    constexpr int OFF = OFFSET_SHIFT<TYPE> < 0 ? 0 : 1 << OFFSET_SHIFT<TYPE>;
    alignas(32) uint8_t u[256];                         // the row's block, decoded
    if constexpr (blocks32<TYPE>()) {                   // the blocks' scales: the steps'
        decode_blocks32<TYPE>(b, u, P.s[h][r], ns);
        _mm256_storeu_ps(P.mm[h][r], _mm256_setzero_ps());
    } else {
        alignas(32) int32_t ls[16], mn[16], l8[8];
        float a, m;
        decode_block<TYPE>(b, u, ls, mn, &a, &m);
        for (int kk = 0; kk < 8; ++kk)          // the steps' multipliers (IQ: ls of 16, twice)
            l8[kk] = ls[LS_GROUP<TYPE> == 32 ? kk : 2 * kk];
        _mm256_storeu_ps(P.s[h][r], _mm256_mul_ps(_mm256_set1_ps(a), _mm256_cvtepi32_ps(
            _mm256_load_si256((const __m256i*)l8))));
        _mm256_storeu_ps(P.mm[h][r], HAS_MINS<TYPE> ? _mm256_mul_ps(_mm256_set1_ps(m),
            _mm256_cvtepi32_ps(_mm256_load_si256((const __m256i*)mn))) : _mm256_setzero_ps());
    }
    const __m256i off = _mm256_set1_epi8((char)OFF);
    for (int kk = 0; kk < ns; ++kk)
        store_bf16_i8(P.A[kk][h][r], _mm256_sub_epi8(loadu256(u + 32 * kk), off));
}

// Rows p0 + j0 .. p0 + j1 - 1 of the matrix (those from r1 on zero) at block i into P: its
// first ns steps (panel_steps); lut32: a LUT type's bf16_lut.
template <int TYPE>
EFS_X void decode_panel(const uint8_t* W, int64_t rb, int64_t p0, int64_t r1, int64_t i,
                        int64_t bytes, int ns, const uint16_t* lut32, AmxPanel& P, int j0,
                        int j1) {
    const __m512i lut = LUT<TYPE> ? _mm512_load_si512(lut32) : _mm512_setzero_si512();
    for (int j = j0; j < j1; ++j) {
        const int h = j / 16, r = j % 16;
        if (p0 + j >= r1) {
            for (int kk = 0; kk < ns; ++kk) memset(P.A[kk][h][r], 0, 64);
            _mm256_storeu_ps(P.s[h][r], _mm256_setzero_ps());
            _mm256_storeu_ps(P.mm[h][r], _mm256_setzero_ps());
            continue;
        }
        const uint8_t* b = W + (p0 + j) * rb + i * bytes;
        if constexpr (LUT<TYPE>)
            decode_lut_row<TYPE>(b, ns, lut, P, h, r);
        else
            decode_bytes_row<TYPE>(b, ns, P, h, r);
    }
}

// The products of step kk of block i for NJ token tiles (jt ...): tiles 0/1 the panel's two A
// tiles, 2/3 the activations' parts in turn, 4 + 2 j + h the sums of A tile h and token tile j
// (store_sums takes them out). xb: the prepared activations, ntile token tiles of half =
// cols / 2 pairs a part.
template <int NJ>
EFS_X void step_products(const AmxPanel& P, const uint32_t* xb, int64_t ntile, int64_t half,
                         int64_t jt, int64_t i, int kk) {
    _tile_zero(4);
    _tile_zero(5);
    if constexpr (NJ > 1) {
        _tile_zero(6);
        _tile_zero(7);
    }
    _tile_loadd(0, P.A[kk][0], 64);
    _tile_loadd(1, P.A[kk][1], 64);
    const uint32_t* b = xb + (jt * half + 16 * (8 * i + kk)) * 16;
    const int64_t part = ntile * half * 16, tile = half * 16;
#define EFS_AMX_TILE(J, C0, C1)                                                             \
    if constexpr (NJ > J) {                                                                 \
        _tile_loadd(2, b + J * tile, 64);                                                   \
        _tile_dpbf16ps(C0, 0, 2);                                                           \
        _tile_dpbf16ps(C1, 1, 2);                                                           \
        _tile_loadd(3, b + part + J * tile, 64);                                            \
        _tile_dpbf16ps(C0, 0, 3);                                                           \
        _tile_dpbf16ps(C1, 1, 3);                                                           \
        _tile_loadd(2, b + 2 * part + J * tile, 64);                                        \
        _tile_dpbf16ps(C0, 0, 2);                                                           \
        _tile_dpbf16ps(C1, 1, 2);                                                           \
    }
    EFS_AMX_TILE(0, 4, 5)
    EFS_AMX_TILE(1, 6, 7)
#undef EFS_AMX_TILE
}

// The sums of step_products into cbuf[2 j + h].
template <int NJ>
EFS_X void store_sums(float (*cbuf)[16][16]) {
    _tile_stored(4, cbuf[0], 64);
    _tile_stored(5, cbuf[1], 64);
    if constexpr (NJ > 1) {
        _tile_stored(6, cbuf[2], 64);
        _tile_stored(7, cbuf[3], 64);
    }
}

// The panel's rows' sums acc [rows][tp] += multiplier * step sums - mins * the group's sums of
// x, for nj token tiles from jt. xs: [group of 16][tp] the groups' sums of x.
template <bool MINS>
EFS_X void add_step(const AmxPanel& P, const float (*cbuf)[16][16], const float* xs,
                    int64_t tp, int64_t jt, int nj, int64_t i, int kk, float* acc) {
    for (int jj = 0; jj < nj; ++jj) {
        const int64_t t0 = 16 * (jt + jj);
        const float* xg2 = xs + 2 * (8 * i + kk) * tp + t0;      // the step's two groups
        const __m512 xg = MINS ? _mm512_add_ps(_mm512_loadu_ps(xg2), _mm512_loadu_ps(xg2 + tp))
                               : _mm512_setzero_ps();
        for (int h = 0; h < 2; ++h)
            for (int r = 0; r < 16; ++r) {
                float* o = acc + (16 * h + r) * tp + t0;
                __m512 y = _mm512_fmadd_ps(_mm512_set1_ps(P.s[h][r][kk]),
                                           _mm512_load_ps(cbuf[2 * jj + h][r]),
                                           _mm512_loadu_ps(o));
                if (MINS) y = _mm512_fnmadd_ps(_mm512_set1_ps(P.mm[h][r][kk]), xg, y);
                _mm512_storeu_ps(o, y);
            }
    }
}

// A thread's rows [r0, r1), a 32-row panel at a time: the panel's sums acc [32][tp] zeroed,
// for each 256-weight block i `multiply(i, P, acc, between)` (the tile products of the block
// decoded in P, added into acc), then acc to y's tokens; the tiles configured (eight of 16 rows
// x 64 bytes) for the call and released after. `decode(Q, p0, i, j0, j1)` writes rows j0 .. j1
// - 1 of panel p0's block i into Q. PIPE: the (panel, block) after each one is decoded into the
// other of the two panels bufs[0], bufs[1] while its products run: multiply calls
// `between(k, n)` after issuing step k of n of its first token tile's products, which decodes
// the next block's rows 32 k / n .. 32 (k + 1) / n - 1 (the vector units decode while the tile
// unit multiplies: the folded form, whose steps are all products). Else each block is decoded
// into bufs[0], the only one, before its products (rows_amx, whose vector units scale each
// step's sums while the next step's products run: there the decode between them measured
// slower).
template <bool PIPE, class Panel, class Decode, class Multiply>
EFS_X void amx_panels(int64_t r0, int64_t r1, int64_t nt, int64_t nb, float* y, int64_t ys,
                      Panel* bufs, const Decode& decode, const Multiply& multiply) {
    const int64_t tp = (nt + 15) / 16 * 16, ntile = tp / 16;
    thread_local std::vector<float> accv;
    if ((int64_t)accv.size() < 32 * tp) accv.resize(32 * tp);
    float* acc = accv.data();
    alignas(64) float out[16][16];
    TileConfig cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    EFS_MEMORY_BARRIER();
    _tile_loadconfig(&cfg);
    int cur = 0;
    if (PIPE) decode(bufs[0], r0, 0, 0, 32);
    for (int64_t p0 = r0; p0 < r1; p0 += 32) {
        memset(acc, 0, sizeof(float) * 32 * tp);
        for (int64_t i = 0; i < nb; ++i) {
            if constexpr (PIPE) {
                const int64_t np0 = i + 1 < nb ? p0 : p0 + 32, ni = i + 1 < nb ? i + 1 : 0;
                Panel& next = bufs[cur ^ 1];
                EFS_MEMORY_BARRIER();
                multiply(i, bufs[cur], acc, [&](int k, int n) {
                    EFS_MEMORY_BARRIER();           // after the step's tile loads
                    if (np0 < r1) decode(next, np0, ni, 32 * k / n, 32 * (k + 1) / n);
                });
                cur ^= 1;
            } else {
                decode(bufs[0], p0, i, 0, 32);
                EFS_MEMORY_BARRIER();
                multiply(i, bufs[0], acc, [](int, int) {});
            }
        }
        for (int64_t q0 = p0; q0 < p0 + 32 && q0 < r1; q0 += 16) {
            const int64_t n = r1 - q0 < 16 ? r1 - q0 : 16;
            const float* a = acc + (q0 - p0) * tp;
            for (int64_t j = 0; j < ntile; ++j) {       // [16 rows][16 tokens] to y's tokens
                transpose16((const int32_t*)a + 16 * j, tp, (int32_t*)out[0], 16);
                for (int64_t t = 16 * j; t < nt && t < 16 * j + 16; ++t)
                    memcpy(y + t * ys + q0, out[t - 16 * j], n * sizeof(float));
            }
        }
    }
    _tile_release();
}

thread_local AmxPanel t_panel;

template <int TYPE>
EFS_X void rows_amx(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, const uint32_t* xb,
                    const float* xs, int64_t nt, int64_t cols, float* y, int64_t ys) {
    constexpr bool MINS = HAS_MINS<TYPE>;
    // blocks of 32: a last block of the cols % 256 weights' steps where the row is not whole
    // 256-weight panels
    const int64_t tp = (nt + 15) / 16 * 16, ntile = tp / 16, nb = (cols + 255) / 256;
    const int64_t half = cols / 2, bytes = blocks32<TYPE>() ? 8 * B32_BYTES<TYPE> : rb / nb;
    alignas(64) float cbuf[4][16][16];
    alignas(64) uint16_t lut[32];
    if constexpr (LUT<TYPE>) bf16_lut<TYPE>(lut);
    const auto decode = [&](AmxPanel& Q, int64_t p0, int64_t i, int j0, int j1) {
        decode_panel<TYPE>(W, rb, p0, r1, i, bytes, panel_steps(i, nb, cols), lut, Q, j0, j1);
    };
    amx_panels<false>(r0, r1, nt, nb, y, ys, &t_panel, decode,
                      [&](int64_t i, const AmxPanel& P, float* acc, const auto&) {
        const int ns = panel_steps(i, nb, cols);
        for (int64_t jt = 0; jt < ntile; jt += 2) {
            const int nj = ntile - jt < 2 ? 1 : 2;
            // step kk's products are issued before step kk - 1's sums are added, so that the
            // tile unit and the vector units work at once
            for (int kk = 0; kk < ns; ++kk) {
                if (nj == 1)
                    step_products<1>(P, xb, ntile, half, jt, i, kk);
                else
                    step_products<2>(P, xb, ntile, half, jt, i, kk);
                if (kk > 0) add_step<MINS>(P, cbuf, xs, tp, jt, nj, i, kk - 1, acc);
                if (nj == 1)
                    store_sums<1>(cbuf);
                else
                    store_sums<2>(cbuf);
            }
            add_step<MINS>(P, cbuf, xs, tp, jt, nj, i, ns - 1, acc);
        }
    });
}

// --- types with a multiplier per 16 weights (Q2_K, Q3_K, Q6_K, IQ2_XS, IQ2_S, IQ1_M): multipliers
// folded in
//
// Each weight's integer v = ls * (u - offset) is exact in bf16 where it is at most 256 in
// magnitude (Q2_K's 45, Q3_K's 128: one part); else (at most 4096) it is split into two exact
// bf16 numbers, a multiple of 16 and the rest (-8..7). A step's 32 weights of 16 rows are one A
// tile a part, whose products with the activations' three parts add into one sum tile over the
// block's eight steps; per block the sums are multiplied by a, and Q2_K's mins (m * mn times the
// groups' sums of x, 16 a block) taken off.

template <int TYPE>
constexpr int FOLD_PARTS = TYPE == T_Q2_K || TYPE == T_Q3_K ? 1 : 2;

struct alignas(64) AmxPanel16 {
    uint16_t A[8][2][2][16][32];  // [step][half][part][row][weight] bf16
    float a[2][16];               // [half][row] the block's scale
    float mm[2][16][16];          // [half][row][group] Q2_K's m * mn
};

// Rows p0 + j0 .. p0 + j1 - 1 of the matrix (those from r1 on zero) at block i into P.
template <int TYPE>
EFS_X void decode_panel16(const uint8_t* W, int64_t rb, int64_t p0, int64_t r1, int64_t i,
                          int64_t bytes, AmxPanel16& P, int j0, int j1) {
    constexpr int OFF = OFFSET_SHIFT<TYPE> < 0 ? 0 : 1 << OFFSET_SHIFT<TYPE>;
    for (int j = j0; j < j1; ++j) {
        const int h = j / 16, r = j % 16;
        if (p0 + j >= r1) {
            for (int kk = 0; kk < 8; ++kk)
                for (int pt = 0; pt < FOLD_PARTS<TYPE>; ++pt) memset(P.A[kk][h][pt][r], 0, 64);
            P.a[h][r] = 0.f;
            if (HAS_MINS<TYPE>) memset(P.mm[h][r], 0, sizeof(P.mm[h][r]));
            continue;
        }
        alignas(32) uint8_t u[256];
        int32_t ls[16], mn[16];
        float m;
        decode_block<TYPE>(W + (p0 + j) * rb + i * bytes, u, ls, mn, &P.a[h][r], &m);
        if constexpr (HAS_MINS<TYPE>)
            for (int g = 0; g < 16; ++g) P.mm[h][r][g] = m * (float)mn[g];
        for (int kk = 0; kk < 8; ++kk) {
            __m512i v = _mm512_sub_epi16(_mm512_cvtepu8_epi16(loadu256(u + 32 * kk)),
                                         _mm512_set1_epi16(OFF));
            v = _mm512_mullo_epi16(v, _mm512_inserti64x4(_mm512_set1_epi16((short)ls[2 * kk]),
                                                         _mm256_set1_epi16((short)ls[2 * kk + 1]),
                                                         1));
            if constexpr (FOLD_PARTS<TYPE> == 1) {
                store_bf16_i16(P.A[kk][h][0][r], v);
            } else {
                const __m512i hi = _mm512_and_si512(_mm512_add_epi16(v, _mm512_set1_epi16(8)),
                                                    _mm512_set1_epi16(~15));
                store_bf16_i16(P.A[kk][h][0][r], hi);
                store_bf16_i16(P.A[kk][h][1][r], _mm512_sub_epi16(v, hi));
            }
        }
    }
}

// Block i's sums for token tile j: tiles 0-3 the A tiles (half h, part pt: 2 h + pt), 4/5 the
// activations' parts in turn, 6/7 the halves' sums (fold_store takes them out); between(kk, 8)
// after each step's products.
template <int PARTS, class Between>
EFS_X void fold_products(const AmxPanel16& P, const uint32_t* xb, int64_t ntile, int64_t half,
                         int64_t j, int64_t i, const Between& between) {
    _tile_zero(6);
    _tile_zero(7);
    const int64_t part = ntile * half * 16;
    for (int kk = 0; kk < 8; ++kk) {
        _tile_loadd(0, P.A[kk][0][0], 64);
        _tile_loadd(2, P.A[kk][1][0], 64);
        if constexpr (PARTS == 2) {
            _tile_loadd(1, P.A[kk][0][1], 64);
            _tile_loadd(3, P.A[kk][1][1], 64);
        }
        const uint32_t* b = xb + (j * half + 16 * (8 * i + kk)) * 16;
#define EFS_AMX_PART(B, OFS)     /* the two sums in turn: each product waits for its sum's  \
                                    previous one */                                         \
        _tile_loadd(B, b + OFS, 64);                                                        \
        _tile_dpbf16ps(6, 0, B);                                                            \
        _tile_dpbf16ps(7, 2, B);                                                            \
        if constexpr (PARTS == 2) {                                                         \
            _tile_dpbf16ps(6, 1, B);                                                        \
            _tile_dpbf16ps(7, 3, B);                                                        \
        }
        EFS_AMX_PART(4, 0)
        EFS_AMX_PART(5, part)
        EFS_AMX_PART(4, 2 * part)
#undef EFS_AMX_PART
        between(kk, 8);
    }
}

EFS_X void fold_store(float (*cbuf)[16][16]) {
    _tile_stored(6, cbuf[0], 64);
    _tile_stored(7, cbuf[1], 64);
}

// acc's token tile j += a * the block's sums (less Q2_K's mins: m * mn[g] times group g's sum
// of x, xs [group of 16][tp]).
template <bool MINS>
EFS_X void fold_add(const AmxPanel16& P, const float (*cbuf)[16][16], const float* xs,
                    int64_t tp, int64_t i, int64_t j, float* acc) {
    __m512 xg[16];
    if constexpr (MINS)
        for (int g = 0; g < 16; ++g) xg[g] = _mm512_loadu_ps(xs + (16 * i + g) * tp + 16 * j);
    for (int h = 0; h < 2; ++h)
        for (int r = 0; r < 16; ++r) {
            float* o = acc + (16 * h + r) * tp + 16 * j;
            __m512 y = _mm512_fmadd_ps(_mm512_set1_ps(P.a[h][r]), _mm512_load_ps(cbuf[h][r]),
                                       _mm512_loadu_ps(o));
            if constexpr (MINS)
                for (int g = 0; g < 16; ++g)
                    y = _mm512_fnmadd_ps(_mm512_set1_ps(P.mm[h][r][g]), xg[g], y);
            _mm512_storeu_ps(o, y);
        }
}

thread_local AmxPanel16 t_panel16[2];

template <int TYPE>
EFS_X void rows_amx16(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, const uint32_t* xb,
                      const float* xs, int64_t nt, int64_t cols, float* y, int64_t ys) {
    constexpr bool MINS = HAS_MINS<TYPE>;
    const int64_t tp = (nt + 15) / 16 * 16, ntile = tp / 16, nb = cols / 256, half = cols / 2;
    alignas(64) float cbuf[2][16][16];
    const auto decode = [&](AmxPanel16& Q, int64_t p0, int64_t i, int j0, int j1) {
        decode_panel16<TYPE>(W, rb, p0, r1, i, rb / nb, Q, j0, j1);
    };
    const auto none = [](int, int) {};
    amx_panels<true>(r0, r1, nt, nb, y, ys, t_panel16, decode,
                     [&](int64_t i, const AmxPanel16& P, float* acc, const auto& between) {
        for (int64_t j = 0; j < ntile; ++j) {       // tile j's products before tile j - 1's sums
            if (j == 0)
                fold_products<FOLD_PARTS<TYPE>>(P, xb, ntile, half, j, i, between);
            else
                fold_products<FOLD_PARTS<TYPE>>(P, xb, ntile, half, j, i, none);
            if (j > 0) fold_add<MINS>(P, cbuf, xs, tp, i, j - 1, acc);
            fold_store(cbuf);
        }
        fold_add<MINS>(P, cbuf, xs, tp, i, ntile - 1, acc);
    });
}

}  // namespace

bool amx_enable() {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 22)))
        return false;                                   // AMX-TILE, AMX-BF16
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !(a & (1u << 5)))
        return false;                                   // AVX512-BF16
#ifdef __linux__
    // the tile state is granted per process on request (ARCH_REQ_XCOMP_PERM, XTILEDATA)
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#else
    return false;
#endif
}

EFS_X void amx_prepare(const float* x, int64_t nt, int64_t cols, int64_t j, uint32_t* xb,
                       float* xs) {
    const int64_t tp = (nt + 15) / 16 * 16, ntile = tp / 16, half = cols / 2;
    thread_local std::vector<uint16_t> spv;
    if ((int64_t)spv.size() < 3 * 16 * cols) spv.resize(3 * 16 * cols);
    uint16_t* sp = spv.data();                          // [part][16 tokens][cols] bf16
    for (int64_t t = 0; t < 16; ++t) {
        const int64_t tok = 16 * j + t;
        uint16_t* o = sp + t * cols;
        if (tok >= nt) {
            for (int s = 0; s < 3; ++s) memset(o + s * 16 * cols, 0, cols * 2);
            for (int64_t g = 0; g < cols / 16; ++g) xs[g * tp + tok] = 0.f;
            continue;
        }
        const float* xr = x + tok * cols;
        for (int64_t k = 0; k < cols; k += 16) {
            __m512 v = _mm512_loadu_ps(xr + k);
            for (int s = 0; s < 3; ++s) {
                const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
                _mm256_storeu_si256((__m256i*)(o + s * 16 * cols + k), h);
                v = _mm512_sub_ps(v, _mm512_castsi512_ps(
                    _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
            }
        }
        for (int64_t g = 0; g < cols / 16; ++g)
            xs[g * tp + tok] = _mm512_reduce_add_ps(_mm512_loadu_ps(xr + 16 * g));
    }
    for (int s = 0; s < 3; ++s)
        for (int64_t p = 0; p < half; p += 16)
            transpose16((const int32_t*)(sp + s * 16 * cols) + p, half,
                        (int32_t*)xb + ((s * ntile + j) * half + p) * 16, 16);
}

template <int TYPE>
QgemmAmxFn amx_fn() {
    if constexpr (per32<TYPE>()) return rows_amx<TYPE>;
    else return rows_amx16<TYPE>;
}

#define EFS_AMX_CASE(T, D) case T: return amx_fn<T>();
QgemmAmxFn amx_qgemm(int type, int64_t cols) {
    if (cols % 256 != 0) {          // the blocks-of-32 types, a last block of fewer steps
        if (cols % 32 != 0) return nullptr;
        switch (type) {
            EFS_AMX_CASE(T_Q8_0, -) EFS_AMX_CASE(T_Q4_0, -) EFS_AMX_CASE(T_IQ4_NL, -)
            EFS_AMX_CASE(T_MXFP4, -) EFS_AMX_CASE(T_Q5_0, -) EFS_AMX_CASE(T_Q4_1, -)
            EFS_AMX_CASE(T_Q5_1, -)
            default: return nullptr;
        }
    }
    switch (type) {
        EFS_AMX_CASE(T_Q4_K, -) EFS_AMX_CASE(T_Q5_K, -) EFS_AMX_CASE(T_Q6_K, -)
        EFS_AMX_CASE(T_Q2_K, -) EFS_AMX_CASE(T_Q3_K, -) EFS_AMX_CASE(T_IQ4_XS, -)
        EFS_AMX_CASE(T_Q8_0, -) EFS_AMX_CASE(T_Q4_0, -) EFS_AMX_CASE(T_IQ4_NL, -)
        EFS_AMX_CASE(T_MXFP4, -) EFS_AMX_CASE(T_Q5_0, -) EFS_AMX_CASE(T_Q4_1, -)
        EFS_AMX_CASE(T_Q5_1, -)
        EFS_IQ_DECODERS(EFS_AMX_CASE)
        default: return nullptr;
    }
}
#undef EFS_AMX_CASE

}  // namespace efs

#else  // not x86, the emulated-AVX-512 test build, or a compiler without the AMX targets

namespace efs {
bool amx_enable() { return false; }
void amx_prepare(const float*, int64_t, int64_t, int64_t, uint32_t*, float*) {}
QgemmAmxFn amx_qgemm(int, int64_t) { return nullptr; }
}  // namespace efs

#endif
