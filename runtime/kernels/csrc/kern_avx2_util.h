// Helpers shared by the AVX2 units (kern_avx2.cpp, kern_iq_avx2.cpp): included only by them,
// inside an anonymous namespace, every function with the AVX2 target attribute, so no inline
// symbol compiled for AVX2 can be shared with the portable units. The unpack of 32 bytes into
// floats (u8f / grp) and the activation order it implies are described in kern_avx2.cpp.
#pragma once

#include <immintrin.h>
#include <string.h>

#include "kern.h"

#define EFS_T __attribute__((target("avx2,fma,f16c")))
#define EFS_TI __attribute__((target("avx2,fma,f16c"), always_inline)) inline

namespace efs {
namespace {

EFS_TI float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

EFS_TI int hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
    return _mm_cvtsi128_si32(s);
}

EFS_TI float f16(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

// ggml_e8m0_to_fp32_half (MXFP4's block scale, 2^(e-128)) inline: kern.h's e8m0_half lives in
// the scalar unit, out of line, and a call per 32-weight block slowed the MXFP4 kernels
// (bench/README.md).
EFS_TI float e8m0h(uint8_t e) {
    const uint32_t bits = e < 2 ? (0x00200000u << e) : ((uint32_t)(e - 1) << 23);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

EFS_TI __m256i loadu256(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
EFS_TI __m128i loadu128(const uint8_t* p) { return _mm_loadu_si128((const __m128i*)p); }

// 16 bytes -> 32 nibbles: low nibbles in the low lane (elements 0..15), high in the high lane.
EFS_TI __m256i nibbles(__m128i q) {
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0x0F));
}

// ggml's kvalues_iq4nl, twice (a shuffle table): IQ4_NL's and IQ4_XS's values.
EFS_TI __m256i tbl_iq4nl_s() {
    return _mm256_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89,
                            113, -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69,
                            89, 113);
}

// ggml's kvalues_mxfp4 (twice the E2M1 values; e8m0h halves the scale), twice.
EFS_TI __m256i tbl_mxfp4_s() {
    return _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12,
                            0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
}

// IQ4_XS's 6-bit scale of group ib (0..63; the multiplier is it less 32).
EFS_TI int iq4xs_ls(const uint8_t* b, int ib) {
    uint16_t sh;
    memcpy(&sh, b + 2, 2);
    return ((b[4 + ib / 2] >> 4 * (ib % 2)) & 0xf) | (((sh >> 2 * ib) & 3) << 4);
}

// 32 bits -> 32 bytes, 0xFF where the bit is set (byte i <-> bit i).
EFS_TI __m256i bytes_from_bits_32(const uint8_t* x) {
    uint32_t x32;
    memcpy(&x32, x, 4);
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                           0x0101010101010101, 0x0000000000000000);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x32), shuf);
    bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

// The unpack of a group of 32 bytes into 4 x 8 floats, all exact, comes in three forms, chosen
// per type by what measured fastest on each (bench/README.md, native kernels):
//  - OFF == 0: each byte q zero-extended into a dword by an in-lane byte shuffle, then converted;
//  - OFF == SIGNED: the bytes are int8 values q, each placed in the top byte of a dword by the
//    shuffle and converted, giving q * 2^24; the caller's scale carries the 2^-24 (unit<OFF>),
//    so every product and sum is the same to the bit (a power-of-two scaling of normal floats);
//  - OFF > 0: q - OFF without a conversion: the byte goes into the mantissa of 2^23 (bits
//    0x4B0000qq, two unpacks) and 2^23 + OFF is subtracted.
// The floats come out permuted: vector k, element j holds byte 4k+j (j < 4) or 16+4k+j-4
// (j >= 4); perm32() orders the activations to match.
constexpr int SIGNED = -1;

template <int OFF>
constexpr float unit() { return OFF == SIGNED ? 1.f / 16777216.f : 1.f; }

template <int OFF>
EFS_TI void u8f(__m256i v, __m256* w) {
    if constexpr (OFF > 0) {
        const __m256i z = _mm256_setzero_si256();
        const __m256i mg = _mm256_set1_epi16(0x4B00);
        const __m256 moff = _mm256_set1_ps(8388608.f + OFF);
        const __m256i lo = _mm256_unpacklo_epi8(v, z), hi = _mm256_unpackhi_epi8(v, z);
        w[0] = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(lo, mg)), moff);
        w[1] = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(lo, mg)), moff);
        w[2] = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(hi, mg)), moff);
        w[3] = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(hi, mg)), moff);
    } else {
        constexpr int P = OFF == 0 ? 0 : 3;        // the byte's place in its dword
        for (int k = 0; k < 4; ++k) {
            alignas(32) int8_t m[32];
            for (int i = 0; i < 32; ++i)
                m[i] = (i & 3) == P ? (int8_t)(4 * k + ((i & 15) >> 2)) : -128;
            w[k] = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(v, _mm256_load_si256((const __m256i*)m)));
        }
    }
}

// acc[t] += scale * sum_i (q_i - OFF) * x_t[i] over one group of 32 (x_t at xp[t] + off);
// `scale` is the group's scale times unit<OFF>().
template <int NT, int OFF>
EFS_TI void grp(__m256i v, const float* const* xp, int64_t o, __m256 scale, __m256* acc) {
    __m256 w[4];
    u8f<OFF>(v, w);
    for (int t = 0; t < NT; ++t) {
        const float* x = xp[t] + o;
        __m256 a = _mm256_mul_ps(w[0], _mm256_loadu_ps(x));
        a = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(x + 8), a);
        a = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(x + 16), a);
        a = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(x + 24), a);
        acc[t] = _mm256_fmadd_ps(a, scale, acc[t]);
    }
}

// Scale vector for a 32-group split in two 16-element sub-blocks: the low lane of the unpack
// holds bytes 0..15, the high lane bytes 16..31. `s` holds 8 scales; pair p = (2p, 2p+1).
EFS_TI __m256 pair_scale(__m256 s, int p) {
    const __m256i idx = _mm256_setr_epi32(2 * p, 2 * p, 2 * p, 2 * p,
                                          2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1);
    return _mm256_permutevar8x32_ps(s, idx);
}

// Software prefetch as a stream: a kernel keeps a cursor PF_DIST bytes ahead of the block it
// is about to read and, block by block, issues the cache lines the cursor passes, one or a
// few per block. Hardware prefetchers stop at 4 KiB page boundaries; prefetching a whole row
// at once instead (a burst of 50-70 lines at each row's start) fills the line-fill buffers the
// block's own loads need and was slower than no software prefetch at all. The cursor starts
// PF_DIST past the first row: the chunk before it in memory, whichever thread took it,
// streamed that far. Prefetching past the end of the matrix is harmless (no fault). Every
// unit's one-row kernels use it (the AVX-512 ones too: their bursts measured slower on a CPU
// with full-width AVX-512, bench/README.md).
constexpr int64_t PF_DIST = 4096;
EFS_TI const char* pf_start(const uint8_t* first) { return (const char*)first + PF_DIST; }
EFS_TI void pf_next(const char*& pf, const uint8_t* end) {   // end: past the bytes read next
    const char* to = (const char*)end + PF_DIST;
    for (; pf < to; pf += 64) _mm_prefetch(pf, _MM_HINT_T0);
}

// The AVX-512 two-row kernels read rows r and r + 1 side by side, block by block: two streams
// a row apart. Each gets a cursor d bytes ahead, d whole row pairs and at least 2 KiB (the
// same block of a later pair's row), moved on block by block as pf_next does. A burst of both
// rows' lines at each pair's start left the next pair's first blocks waiting on memory and ran
// the 151936 x 2048 Q6_K output head at half ggml's speed on a CPU with full-width AVX-512;
// one pair ahead was too close for short rows (an expert's 768-wide down rows: 1.2 KiB of
// Q6_K a pair). Measured in bench/README.md.
struct PfPair {
    const char* a;
    const char* b;
    int64_t d;
    EFS_TI explicit PfPair(int64_t rb)
        : a(nullptr), b(nullptr), d(2 * rb * ((2048 + 2 * rb - 1) / (2 * rb))) {}
    // at block i of the pair (b0, b1 there), up to the end of that block in the next pair
    EFS_TI void next(const uint8_t* b0, const uint8_t* b1, int64_t bytes) {
        const char* ta = (const char*)(b0 + d + bytes);
        const char* tb = (const char*)(b1 + d + bytes);
        if (a < ta - bytes) a = ta - bytes;         // a new pair: the other cursor took the gap
        if (b < tb - bytes) b = tb - bytes;
        for (; a < ta; a += 64) _mm_prefetch(a, _MM_HINT_T0);
        for (; b < tb; b += 64) _mm_prefetch(b, _MM_HINT_T0);
    }
};

// The activations a pass of the one-row kernels keeps in the L1 cache beside the weights'
// stream: past this many bytes (float32 or q8 activations, all the pass's tokens) each row
// re-reads them from L2, so the kernels take two rows at a time (RowCursor<2>) there.
constexpr int64_t X_L1_BYTES = 16 << 10;

// True when NT tokens of `cols` activations of `bytes` each fit X_L1_BYTES.
EFS_TI bool x_in_l1(int nt, int64_t cols, int64_t bytes) { return nt * cols * bytes <= X_L1_BYTES; }

// R consecutive rows' block cursors (R = 1 or 2) with their prefetch: a stream ahead of a single
// row (pf_next), PfPair's two cursors for a pair. At each block: prefetch(bytes), then the
// blocks at b[0..R-1], then step(bytes).
template <int R>
struct RowCursor {
    const uint8_t* b[R];
    PfPair pp;
    const char* pf;
    EFS_TI RowCursor(const uint8_t* W, int64_t rb, int64_t r0)
        : b{}, pp(rb), pf(pf_start(W + r0 * rb)) {}
    EFS_TI void at(const uint8_t* W, int64_t rb, int64_t r) {
        for (int j = 0; j < R; ++j) b[j] = W + (r + j) * rb;
    }
    EFS_TI void prefetch(int64_t bytes) {
        if (R == 2) pp.next(b[0], b[R - 1], bytes);
        else pf_next(pf, b[0] + bytes);
    }
    EFS_TI void step(int64_t bytes) {
        for (int j = 0; j < R; ++j) b[j] += bytes;
    }
};

struct Out {
    float* y;
    int64_t ys;
    float alpha;
    int accumulate;
    EFS_TI void put(int t, int64_t r, float v) const {
        float* o = y + (int64_t)t * ys + r;
        *o = accumulate ? *o + alpha * v : alpha * v;
    }
};

}  // namespace
}  // namespace efs
