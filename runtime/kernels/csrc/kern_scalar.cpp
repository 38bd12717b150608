// Portable kernels (no intrinsics): the fallback on any CPU, and the reference the AVX2 unit is
// tested against. Block layouts are ggml-common.h's; dequantisation follows ggml's
// dequantize_row_* (= gguf-py's numpy dequant, bit for bit), the q8 dot products follow
// ggml-cpu's ggml_vec_dot_*_generic (integer sums per block, combined in float).
#include "kern.h"

#include <algorithm>

#include <math.h>
#include <string.h>

namespace efs {

// --- scalar helpers ------------------------------------------------------------------------

float fp16_to_fp32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {                                   // subnormal: renormalise
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; --exp; }
            man &= 0x3ff;
            bits = sign | (exp << 23) | (man << 13);
        }
    } else if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

uint16_t fp32_to_fp16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000;
    uint32_t mant = x & 0x7fffff;
    int32_t exp = (int32_t)((x >> 23) & 0xff);
    if (exp == 0xff) return (uint16_t)(sign | 0x7c00 | (mant ? 0x200 : 0));
    exp = exp - 127 + 15;
    if (exp >= 0x1f) return (uint16_t)(sign | 0x7c00);
    if (exp <= 0) {
        if (exp < -10) return (uint16_t)sign;
        mant |= 0x800000;
        const int shift = 14 - exp;
        uint32_t h = mant >> shift;
        const uint32_t rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (h & 1))) ++h;
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((uint32_t)exp << 10) | (mant >> 13);
    const uint32_t rem = mant & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) ++h;   // may carry into the exponent: ok
    return (uint16_t)(sign | h);
}

float bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) {
        u = (u | 0x00400000) & 0xffff0000u;                  // quiet NaN
    } else {
        u = (u + (0x7fff + ((u >> 16) & 1))) & 0xffff0000u;
    }
    memcpy(&f, &u, 4);
    return f;
}

float e8m0_half(uint8_t e) {
    uint32_t bits = e < 2 ? (0x00200000u << e) : ((uint32_t)(e - 1) << 23);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float f16at(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return fp16_to_fp32(h);
}

static const TypeInfo TYPES[] = {
    {T_F16, 1, 2}, {T_BF16, 1, 2}, {T_Q4_0, 32, 18}, {T_Q4_1, 32, 20}, {T_Q5_0, 32, 22},
    {T_Q5_1, 32, 24}, {T_Q8_0, 32, 34}, {T_Q2_K, 256, 84}, {T_Q3_K, 256, 110},
    {T_Q4_K, 256, 144}, {T_Q5_K, 256, 176}, {T_Q6_K, 256, 210}, {T_IQ4_XS, 256, 136},
    {T_MXFP4, 32, 17}, {T_IQ4_NL, 32, 18}, {T_IQ2_XXS, 256, 66}, {T_IQ2_XS, 256, 74},
    {T_IQ2_S, 256, 82}, {T_IQ3_XXS, 256, 98}, {T_IQ3_S, 256, 110}, {T_IQ1_S, 256, 50},
    {T_IQ1_M, 256, 56}, {T_TQ1_0, 256, 54}, {T_TQ2_0, 256, 66},
};

const TypeInfo* type_info(int type) {
    for (const TypeInfo& t : TYPES)
        if (t.type == type) return is_iq_grid(type) && !g_iq.ok ? nullptr : &t;
    return nullptr;
}

int q8_format(int type) {
    switch (type) {
        case T_Q2_K: case T_Q3_K: case T_Q4_K: case T_Q5_K: case T_Q6_K: case T_IQ4_XS:
        case T_IQ2_XXS: case T_IQ2_XS: case T_IQ2_S: case T_IQ3_XXS: case T_IQ3_S: case T_IQ1_S:
        case T_IQ1_M: case T_TQ1_0: case T_TQ2_0:
            return X_Q8K;
        case T_Q4_0: case T_Q5_0: case T_Q8_0: case T_MXFP4: case T_IQ4_NL: return X_Q8_0;
        case T_Q4_1: case T_Q5_1: return X_Q8_1;
        case T_F16: return X_F16R;
        case T_BF16: return X_BF16R;
        default: return -1;
    }
}

// --- activation preparation ----------------------------------------------------------------

void perm32(const float* x, float* xp, int64_t n) {
    // Element j (0..7) of the k-th float vector unpacked from 32 bytes (kern_avx2.cpp
    // u8_to_f32) is byte 4k+j (j < 4) or 16+4k+j-4 (j >= 4) of the 32.
    for (int64_t c = 0; c + 32 <= n; c += 32)
        for (int k = 0; k < 4; ++k)
            for (int j = 0; j < 8; ++j)
                xp[c + 8 * k + j] = x[c + (j < 4 ? 4 * k + j : 16 + 4 * k + j - 4)];
}

void perm128(const float* x, float* xz, int64_t n) {
    // Vector k (nibble k of each dword of 64 packed Q4_K bytes), lane l (kern_avx512.cpp).
    for (int64_t c = 0; c + 128 <= n; c += 128)
        for (int k = 0; k < 8; ++k)
            for (int l = 0; l < 16; ++l)
                xz[c + 16 * k + l] = x[c + (l >= 8 ? 64 : 0) + (k & 1) * 32 + 4 * (l & 7) + k / 2];
}

void perm_q2(const float* x, float* xq, int64_t n) {
    // Vector 4g + m (value k = g + 4m of each dword of 64 packed Q2_K / Q3_K bytes), lane l
    // (kern_avx512.cpp).
    for (int64_t c = 0; c + 256 <= n; c += 256)
        for (int g = 0; g < 4; ++g)
            for (int m = 0; m < 4; ++m)
                for (int l = 0; l < 16; ++l)
                    xq[c + 16 * (4 * g + m) + l] = x[c + 128 * (l / 8) + 32 * g + 4 * (l % 8) + m];
}

void perm_iq4(const float* x, float* xi, int64_t n) {
    // Vector k (nibble k of each dword of 64 packed IQ4_XS bytes: 4 groups of 16), lane l
    // (kern_avx512.cpp).
    for (int64_t c = 0; c + 128 <= n; c += 128)
        for (int k = 0; k < 8; ++k)
            for (int l = 0; l < 16; ++l)
                xi[c + 16 * k + l] = x[c + 32 * (l / 4) + 16 * (k & 1) + 4 * (l % 4) + k / 2];
}

int exact_layouts(int type) {
    return type == T_Q4_K   ? X_XZ
           : type == T_Q2_K || type == T_Q3_K ? X_XQ
           : type == T_IQ4_XS ? X_XI
           : type == T_Q5_K || type == T_Q6_K ? X_XH
           : type == T_IQ2_XXS || type == T_IQ3_XXS || type == T_IQ3_S ? X_XG
                                                                       : 0;
}

void perm_g32(const float* x, float* xg, int64_t n) {
    // Each 32: x[0..7], x[16..23], x[8..15], x[24..31], so that one 16-float load holds the
    // AVX2 kernels' first products of both halves of a lattice group, the next their second
    // (kern_iq_avx512.cpp's one-row kernels).
    static const int from[4] = {0, 16, 8, 24};
    for (int64_t c = 0; c + 32 <= n; c += 32)
        for (int k = 0; k < 4; ++k)
            for (int l = 0; l < 8; ++l) xg[c + 8 * k + l] = x[c + from[k] + l];
}

void perm_h64(const float* xp, float* xh, int64_t n) {
    // Lanes 0..7 of 16-float vector k of each 64-chunk: xp's AVX2 vector k of the chunk's first
    // 32 (the a0 groups of the AVX2 kernels), lanes 8..15 that of its second 32 (a1's).
    for (int64_t c = 0; c + 64 <= n; c += 64)
        for (int k = 0; k < 4; ++k)
            for (int l = 0; l < 8; ++l) {
                xh[c + 16 * k + l] = xp[c + 8 * k + l];
                xh[c + 16 * k + 8 + l] = xp[c + 32 + 8 * k + l];
            }
}

void sums16(const float* x, float* s16, float* s32, int64_t n) {
    for (int64_t g = 0; g < n / 16; ++g) {
        float a = 0.f;
        for (int i = 0; i < 16; ++i) a += x[16 * g + i];
        s16[g] = a;
    }
    for (int64_t g = 0; g < n / 32; ++g) s32[g] = s16[2 * g] + s16[2 * g + 1];
}

static inline int nearest_int(float fval) {             // ggml-quants.c
    float val = fval + 12582912.f;
    int i;
    memcpy(&i, &val, 4);
    return (i & 0x007fffff) - 0x00400000;
}

void quantize_q8k(const float* x, Q8K* y, int64_t n) {
    for (int64_t i = 0; i < n / 256; ++i, x += 256) {
        float max = 0.f, amax = 0.f;
        for (int j = 0; j < 256; ++j) {
            const float ax = fabsf(x[j]);
            if (ax > amax) { amax = ax; max = x[j]; }
        }
        if (!amax) {
            y[i].d = 0.f;
            memset(y[i].qs, 0, 256);
            memset(y[i].bsums, 0, sizeof y[i].bsums);
            continue;
        }
        const float iscale = -127.f / max;
        for (int j = 0; j < 256; ++j) {
            const int v = nearest_int(iscale * x[j]);
            y[i].qs[j] = (int8_t)(v < 127 ? v : 127);
        }
        for (int j = 0; j < 16; ++j) {
            int s = 0;
            for (int k = 0; k < 16; ++k) s += y[i].qs[16 * j + k];
            y[i].bsums[j] = (int16_t)s;
        }
        y[i].d = 1.f / iscale;
    }
}

void quantize_qx8(const float* x, QX8* y, int64_t n, int with_sum) {
    // ggml-cpu's x86 quantize_row_q8_0 / q8_1: d = amax/127 stored as fp16, q = round-to-
    // nearest-even(x * 127/amax), s = d * sum(q) stored as fp16.
    for (int64_t i = 0; i < n / 32; ++i, x += 32) {
        float amax = 0.f;
        for (int j = 0; j < 32; ++j) amax = fmaxf(amax, fabsf(x[j]));
        const float d = amax / 127.f, id = amax != 0.f ? 127.f / amax : 0.f;
        int sum = 0;
        for (int j = 0; j < 32; ++j) {
            const int v = (int)nearbyintf(x[j] * id);
            y[i].qs[j] = (int8_t)v;
            sum += v;
        }
        y[i].d = fp16_to_fp32(fp32_to_fp16(d));
        y[i].s = with_sum ? fp16_to_fp32(fp32_to_fp16(d * (float)sum)) : 0.f;
    }
}

void silu_mul(float* g, const float* u, int64_t n, float limit, float alpha) {
    if (alpha > 0.f) {                  // swiglu_oai (ggml_vec_swiglu_oai's order of operations)
        for (int64_t i = 0; i < n; ++i) {
            const float x = limit > 0.f ? std::min(g[i], limit) : g[i];
            const float v = limit > 0.f ? std::max(std::min(u[i], limit), -limit) : u[i];
            g[i] = x / (1.f + expf(alpha * (-x))) * (v + 1.f);
        }
        return;
    }
    if (limit > 0.f) {
        for (int64_t i = 0; i < n; ++i) {
            const float x = std::min(g[i], limit), v = std::max(std::min(u[i], limit), -limit);
            g[i] = x / (1.f + expf(-x)) * v;
        }
        return;
    }
    for (int64_t i = 0; i < n; ++i) g[i] = g[i] / (1.f + expf(-g[i])) * u[i];
}

void round_f16(const float* x, float* y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] = fp16_to_fp32(fp32_to_fp16(x[i]));
}

void round_bf16(const float* x, float* y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] = bf16_round(x[i]);
}

// --- exact mode: dequantize a block (ggml dequantize_row_*), then a float dot ----------------

static const int8_t KV_IQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                    1, 13, 25, 38, 53, 69, 89, 113};
static const int8_t KV_MXFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static inline void scale_min_k4(int j, const uint8_t* q, uint8_t* d, uint8_t* m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4);
    }
}

static void q3k_scales(const uint8_t* s12, int8_t* out) {
    const uint32_t kmask1 = 0x03030303, kmask2 = 0x0f0f0f0f;
    uint32_t aux[4];
    memcpy(aux, s12, 12);
    const uint32_t tmp = aux[2];
    aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
    aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
    aux[0] = (aux[0] & kmask2) | (((tmp >> 0) & kmask1) << 4);
    aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
    memcpy(out, aux, 16);
}

static void deq_block(int type, const uint8_t* b, float* y) {
    switch (type) {
    case T_Q4_0: {
        const float d = f16at(b);
        for (int j = 0; j < 16; ++j) {
            y[j] = ((b[2 + j] & 0xF) - 8) * d;
            y[j + 16] = ((b[2 + j] >> 4) - 8) * d;
        }
        break;
    }
    case T_Q4_1: {
        const float d = f16at(b), m = f16at(b + 2);
        for (int j = 0; j < 16; ++j) {
            y[j] = (b[4 + j] & 0xF) * d + m;
            y[j + 16] = (b[4 + j] >> 4) * d + m;
        }
        break;
    }
    case T_Q5_0: case T_Q5_1: {
        const bool one = type == T_Q5_1;
        const float d = f16at(b), m = one ? f16at(b + 2) : 0.f;
        const uint8_t* p = b + (one ? 4 : 2);
        uint32_t qh;
        memcpy(&qh, p, 4);
        const uint8_t* qs = p + 4;
        for (int j = 0; j < 16; ++j) {
            const int xh0 = ((qh >> j) << 4) & 0x10, xh1 = (qh >> (j + 12)) & 0x10;
            const int x0 = (qs[j] & 0xF) | xh0, x1 = (qs[j] >> 4) | xh1;
            if (one) {
                y[j] = x0 * d + m;
                y[j + 16] = x1 * d + m;
            } else {
                y[j] = (x0 - 16) * d;
                y[j + 16] = (x1 - 16) * d;
            }
        }
        break;
    }
    case T_Q8_0: {
        const float d = f16at(b);
        for (int j = 0; j < 32; ++j) y[j] = (int8_t)b[2 + j] * d;
        break;
    }
    case T_MXFP4: {
        const float d = e8m0_half(b[0]);
        for (int j = 0; j < 16; ++j) {
            y[j] = KV_MXFP4[b[1 + j] & 0xF] * d;
            y[j + 16] = KV_MXFP4[b[1 + j] >> 4] * d;
        }
        break;
    }
    case T_Q2_K: {
        const uint8_t* sc = b;
        const uint8_t* q = b + 16;
        const float d = f16at(b + 80), mn = f16at(b + 82);
        int is = 0;
        for (int n = 0; n < 256; n += 128) {
            int shift = 0;
            for (int j = 0; j < 4; ++j) {
                uint8_t s = sc[is++];
                float dl = d * (s & 0xF), ml = mn * (s >> 4);
                for (int l = 0; l < 16; ++l) *y++ = dl * ((q[l] >> shift) & 3) - ml;
                s = sc[is++];
                dl = d * (s & 0xF); ml = mn * (s >> 4);
                for (int l = 0; l < 16; ++l) *y++ = dl * ((q[l + 16] >> shift) & 3) - ml;
                shift += 2;
            }
            q += 32;
        }
        break;
    }
    case T_Q3_K: {
        const uint8_t* hm = b;
        const uint8_t* q = b + 32;
        int8_t scales[16];
        q3k_scales(b + 96, scales);
        const float d_all = f16at(b + 108);
        int is = 0;
        uint8_t m = 1;
        for (int n = 0; n < 256; n += 128) {
            int shift = 0;
            for (int j = 0; j < 4; ++j) {
                float dl = d_all * (scales[is++] - 32);
                for (int l = 0; l < 16; ++l)
                    *y++ = dl * ((int8_t)((q[l] >> shift) & 3) - ((hm[l] & m) ? 0 : 4));
                dl = d_all * (scales[is++] - 32);
                for (int l = 0; l < 16; ++l)
                    *y++ = dl * ((int8_t)((q[l + 16] >> shift) & 3) - ((hm[l + 16] & m) ? 0 : 4));
                shift += 2;
                m <<= 1;
            }
            q += 32;
        }
        break;
    }
    case T_Q4_K: case T_Q5_K: {
        const bool five = type == T_Q5_K;
        const float d = f16at(b), mn = f16at(b + 2);
        const uint8_t* sc = b + 4;
        const uint8_t* qh = b + 16;
        const uint8_t* q = b + (five ? 48 : 16);
        int is = 0;
        uint8_t u1 = 1, u2 = 2;
        for (int j = 0; j < 256; j += 64) {
            uint8_t s, m;
            scale_min_k4(is + 0, sc, &s, &m);
            const float d1 = d * s, m1 = mn * m;
            scale_min_k4(is + 1, sc, &s, &m);
            const float d2 = d * s, m2 = mn * m;
            for (int l = 0; l < 32; ++l)
                *y++ = d1 * ((q[l] & 0xF) + (five && (qh[l] & u1) ? 16 : 0)) - m1;
            for (int l = 0; l < 32; ++l)
                *y++ = d2 * ((q[l] >> 4) + (five && (qh[l] & u2) ? 16 : 0)) - m2;
            q += 32;
            is += 2;
            u1 <<= 2;
            u2 <<= 2;
        }
        break;
    }
    case T_Q6_K: {
        const uint8_t* ql = b;
        const uint8_t* qh = b + 128;
        const int8_t* sc = (const int8_t*)(b + 192);
        const float d = f16at(b + 208);
        for (int n = 0; n < 256; n += 128) {
            for (int l = 0; l < 32; ++l) {
                const int is = l / 16;
                const int8_t q1 = (int8_t)((ql[l + 0] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                const int8_t q2 = (int8_t)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                const int8_t q3 = (int8_t)((ql[l + 0] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                const int8_t q4 = (int8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                y[l + 0] = d * sc[is + 0] * q1;
                y[l + 32] = d * sc[is + 2] * q2;
                y[l + 64] = d * sc[is + 4] * q3;
                y[l + 96] = d * sc[is + 6] * q4;
            }
            y += 128;
            ql += 64;
            qh += 32;
            sc += 8;
        }
        break;
    }
    case T_IQ4_XS: {
        const float d = f16at(b);
        uint16_t sh;
        memcpy(&sh, b + 2, 2);
        const uint8_t* sl = b + 4;
        const uint8_t* qs = b + 8;
        for (int ib = 0; ib < 8; ++ib) {
            const int ls = ((sl[ib / 2] >> 4 * (ib % 2)) & 0xf) | (((sh >> 2 * ib) & 3) << 4);
            const float dl = d * (ls - 32);
            for (int j = 0; j < 16; ++j) {
                y[j] = dl * KV_IQ4NL[qs[j] & 0xf];
                y[j + 16] = dl * KV_IQ4NL[qs[j] >> 4];
            }
            y += 32;
            qs += 16;
        }
        break;
    }
    case T_IQ4_NL: {
        const float d = f16at(b);
        for (int j = 0; j < 16; ++j) {
            y[j] = d * KV_IQ4NL[b[2 + j] & 0xf];
            y[j + 16] = d * KV_IQ4NL[b[2 + j] >> 4];
        }
        break;
    }
    case T_F16:
        y[0] = f16at(b);
        break;
    case T_BF16: {
        uint32_t u = (uint32_t)b[0] << 16 | (uint32_t)b[1] << 24;
        memcpy(y, &u, 4);
        break;
    }
    default:
        deq_block_iq(type, b, y);
        break;
    }
}

static void exact_rows(int type, const uint8_t* W, int64_t rb, int64_t r0, int64_t r1,
                       int64_t cols, const XPrep* xs, int nt, float* y, int64_t ys, float alpha,
                       int accumulate) {
    const TypeInfo* ti = type_info(type);
    const int B = ti->block;
    const int64_t nb = cols / B;
    float buf[256];
    float acc[16];
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* row = W + r * rb;
        for (int t0 = 0; t0 < nt; t0 += 16) {
            const int n = nt - t0 < 16 ? nt - t0 : 16;
            for (int t = 0; t < n; ++t) acc[t] = 0.f;
            if (B == 1) {                           // F16 / BF16: straight through
                for (int64_t i = 0; i < cols; ++i) {
                    deq_block(type, row + 2 * i, buf);
                    for (int t = 0; t < n; ++t) acc[t] += buf[0] * xs[t0 + t].x[i];
                }
            } else {
                for (int64_t i = 0; i < nb; ++i) {
                    deq_block(type, row + i * ti->bytes, buf);
                    for (int t = 0; t < n; ++t) {
                        const float* x = xs[t0 + t].x + i * B;
                        float a = 0.f;
                        for (int j = 0; j < B; ++j) a += buf[j] * x[j];
                        acc[t] += a;
                    }
                }
            }
            for (int t = 0; t < n; ++t) {
                float* o = y + (int64_t)(t0 + t) * ys + r;
                *o = accumulate ? *o + alpha * acc[t] : alpha * acc[t];
            }
        }
    }
}

// --- q8 mode: integer dot products per block (ggml_vec_dot_*_generic) -----------------------

static float vdot_q8(int type, const uint8_t* row, int64_t cols, const void* qv) {
    const TypeInfo* ti = type_info(type);
    const int64_t nb = cols / ti->block;
    float sumf = 0.f;
    if (ti->block == 32) {
        const QX8* y = (const QX8*)qv;
        for (int64_t ib = 0; ib < nb; ++ib) {
            const uint8_t* b = row + ib * ti->bytes;
            const int8_t* q8 = y[ib].qs;
            int sumi = 0;
            switch (type) {
            case T_Q4_0:
                for (int j = 0; j < 16; ++j)
                    sumi += ((b[2 + j] & 0xF) - 8) * q8[j] + ((b[2 + j] >> 4) - 8) * q8[j + 16];
                sumf += sumi * (f16at(b) * y[ib].d);
                break;
            case T_Q4_1:
                for (int j = 0; j < 16; ++j)
                    sumi += (b[4 + j] & 0xF) * q8[j] + (b[4 + j] >> 4) * q8[j + 16];
                sumf += (f16at(b) * y[ib].d) * sumi + f16at(b + 2) * y[ib].s;
                break;
            case T_Q5_0: case T_Q5_1: {
                const bool one = type == T_Q5_1;
                const uint8_t* p = b + (one ? 4 : 2);
                uint32_t qh;
                memcpy(&qh, p, 4);
                const uint8_t* qs = p + 4;
                const int off = one ? 0 : 16;
                for (int j = 0; j < 16; ++j) {
                    const int xh0 = ((qh >> j) << 4) & 0x10, xh1 = (qh >> (j + 12)) & 0x10;
                    sumi += (((qs[j] & 0xF) | xh0) - off) * q8[j]
                          + (((qs[j] >> 4) | xh1) - off) * q8[j + 16];
                }
                if (one)
                    sumf += (f16at(b) * y[ib].d) * sumi + f16at(b + 2) * y[ib].s;
                else
                    sumf += sumi * (f16at(b) * y[ib].d);
                break;
            }
            case T_Q8_0:
                for (int j = 0; j < 32; ++j) sumi += (int8_t)b[2 + j] * q8[j];
                sumf += sumi * (f16at(b) * y[ib].d);
                break;
            case T_MXFP4:
                for (int j = 0; j < 16; ++j)
                    sumi += KV_MXFP4[b[1 + j] & 0xF] * q8[j] + KV_MXFP4[b[1 + j] >> 4] * q8[j + 16];
                sumf += (y[ib].d * e8m0_half(b[0])) * sumi;
                break;
            case T_IQ4_NL:
                for (int j = 0; j < 16; ++j)
                    sumi += KV_IQ4NL[b[2 + j] & 0xF] * q8[j] + KV_IQ4NL[b[2 + j] >> 4] * q8[j + 16];
                sumf += sumi * (f16at(b) * y[ib].d);
                break;
            default:
                break;
            }
        }
        return sumf;
    }
    const Q8K* y = (const Q8K*)qv;
    if (is_iq_family(type)) return vdot_q8_iq(type, row, cols, y);
    for (int64_t i = 0; i < nb; ++i) {
        const uint8_t* b = row + i * ti->bytes;
        const int8_t* q8 = y[i].qs;
        switch (type) {
        case T_Q2_K: {
            const uint8_t* sc = b;
            const uint8_t* q2 = b + 16;
            int summs = 0;
            for (int j = 0; j < 16; ++j) summs += y[i].bsums[j] * (sc[j] >> 4);
            const float dall = y[i].d * f16at(b + 80), dmin = y[i].d * f16at(b + 82);
            int isum = 0, is = 0;
            for (int k = 0; k < 2; ++k) {
                int shift = 0;
                for (int j = 0; j < 4; ++j) {
                    int d = sc[is++] & 0xF, s = 0;
                    for (int l = 0; l < 16; ++l) s += q8[l] * ((q2[l] >> shift) & 3);
                    isum += d * s;
                    d = sc[is++] & 0xF;
                    s = 0;
                    for (int l = 16; l < 32; ++l) s += q8[l] * ((q2[l] >> shift) & 3);
                    isum += d * s;
                    shift += 2;
                    q8 += 32;
                }
                q2 += 32;
            }
            sumf += dall * isum - dmin * summs;
            break;
        }
        case T_Q3_K: {
            int8_t scales[16];
            q3k_scales(b + 96, scales);
            const uint8_t* hm = b;
            const uint8_t* q = b + 32;
            int isum = 0, g = 0;
            uint8_t m = 1;
            for (int n = 0; n < 2; ++n) {
                int shift = 0;
                for (int j = 0; j < 4; ++j) {
                    for (int h = 0; h < 2; ++h, ++g) {
                        int s = 0;
                        for (int l = 16 * h; l < 16 * h + 16; ++l)
                            s += q8[l] * (((q[l] >> shift) & 3) - ((hm[l] & m) ? 0 : 4));
                        isum += (scales[g] - 32) * s;
                    }
                    shift += 2;
                    m <<= 1;
                    q8 += 32;
                }
                q += 32;
            }
            sumf += f16at(b + 108) * y[i].d * isum;
            break;
        }
        case T_Q4_K: case T_Q5_K: {
            const bool five = type == T_Q5_K;
            const uint8_t* sc = b + 4;
            const uint8_t* qh = b + 16;
            const uint8_t* q = b + (five ? 48 : 16);
            int sums = 0, summ = 0;
            for (int j = 0; j < 4; ++j) {
                for (int h = 0; h < 2; ++h) {
                    const int s_idx = 2 * j + h;
                    uint8_t s, m;
                    scale_min_k4(s_idx, sc, &s, &m);
                    int dot = 0;
                    for (int l = 0; l < 32; ++l) {
                        int v = h ? (q[32 * j + l] >> 4) : (q[32 * j + l] & 0xF);
                        if (five && (qh[l] >> s_idx) & 1) v += 16;
                        dot += v * q8[64 * j + 32 * h + l];
                    }
                    sums += s * dot;
                    summ += m * (y[i].bsums[2 * s_idx] + y[i].bsums[2 * s_idx + 1]);
                }
            }
            sumf += f16at(b) * y[i].d * sums - f16at(b + 2) * y[i].d * summ;
            break;
        }
        case T_Q6_K: {
            const uint8_t* ql = b;
            const uint8_t* qh = b + 128;
            const int8_t* sc = (const int8_t*)(b + 192);
            int isum = 0;
            for (int n = 0; n < 2; ++n) {
                for (int k = 0; k < 4; ++k) {
                    for (int h = 0; h < 2; ++h) {
                        int s = 0;
                        for (int l = 16 * h; l < 16 * h + 16; ++l) {
                            const int lo = k & 1 ? ql[64 * n + 32 + l] : ql[64 * n + l];
                            const int v = ((k >= 2 ? lo >> 4 : lo & 0xF)
                                           | (((qh[32 * n + l] >> (2 * k)) & 3) << 4)) - 32;
                            s += v * q8[128 * n + 32 * k + l];
                        }
                        isum += sc[8 * n + 2 * k + h] * s;
                    }
                }
            }
            sumf += f16at(b + 208) * y[i].d * isum;
            break;
        }
        case T_IQ4_XS: {
            const float d4d8 = f16at(b) * y[i].d;
            uint16_t h;
            memcpy(&h, b + 2, 2);
            const uint8_t* sl = b + 4;
            const uint8_t* qs = b + 8;
            for (int ib = 0; ib < 8; ib += 2) {
                const int ls1 = (sl[ib / 2] & 0xf) | ((h << 4) & 0x30);
                const int ls2 = (sl[ib / 2] >> 4) | ((h << 2) & 0x30);
                h >>= 4;
                int s1 = 0, s2 = 0;
                for (int j = 0; j < 16; ++j) {
                    s1 += q8[j] * KV_IQ4NL[qs[j] & 0xf] + q8[j + 16] * KV_IQ4NL[qs[j] >> 4];
                    s2 += q8[j + 32] * KV_IQ4NL[qs[j + 16] & 0xf]
                        + q8[j + 48] * KV_IQ4NL[qs[j + 16] >> 4];
                }
                sumf += d4d8 * (ls1 - 32) * s1 + d4d8 * (ls2 - 32) * s2;
                qs += 32;
                q8 += 64;
            }
            break;
        }
        default:
            break;
        }
    }
    return sumf;
}

static void q8_rows(int type, const uint8_t* W, int64_t rb, int64_t r0, int64_t r1,
                    int64_t cols, const XPrep* xs, int nt, float* y, int64_t ys, float alpha,
                    int accumulate) {
    for (int64_t r = r0; r < r1; ++r)
        for (int t = 0; t < nt; ++t) {
            const float v = alpha * vdot_q8(type, W + r * rb, cols, xs[t].q);
            float* o = y + (int64_t)t * ys + r;
            *o = accumulate ? *o + v : v;
        }
}

#define EFS_EX(T)                                                                             \
    static void ex_##T(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,   \
                       const XPrep* xs, int nt, float* y, int64_t ys, float a, int acc) {     \
        exact_rows(T_##T, W, rb, r0, r1, cols, xs, nt, y, ys, a, acc);                       \
    }
#define EFS_Q8(T)                                                                             \
    static void q8_##T(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols,   \
                       const XPrep* xs, int nt, float* y, int64_t ys, float a, int acc) {     \
        q8_rows(T_##T, W, rb, r0, r1, cols, xs, nt, y, ys, a, acc);                          \
    }
#define EFS_SCALAR(T) EFS_EX(T) EFS_Q8(T)

EFS_SCALAR(Q4_0) EFS_SCALAR(Q4_1) EFS_SCALAR(Q5_0) EFS_SCALAR(Q5_1) EFS_SCALAR(Q8_0)
EFS_SCALAR(Q2_K) EFS_SCALAR(Q3_K) EFS_SCALAR(Q4_K) EFS_SCALAR(Q5_K) EFS_SCALAR(Q6_K)
EFS_SCALAR(IQ4_XS) EFS_SCALAR(MXFP4) EFS_EX(F16) EFS_EX(BF16)
EFS_SCALAR(IQ4_NL) EFS_SCALAR(IQ2_XXS) EFS_SCALAR(IQ2_XS) EFS_SCALAR(IQ2_S) EFS_SCALAR(IQ3_XXS)
EFS_SCALAR(IQ3_S) EFS_SCALAR(IQ1_S) EFS_SCALAR(IQ1_M) EFS_SCALAR(TQ1_0) EFS_SCALAR(TQ2_0)

void dequant_rows(int type, const uint8_t* W, int64_t rb, int64_t r0, int64_t r1,
                  int64_t cols, float* y) {
    const TypeInfo* ti = type_info(type);
    const int B = ti->block;
    const int64_t nb = cols / B;
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* row = W + r * rb;
        float* out = y + (r - r0) * cols;
        for (int64_t i = 0; i < nb; ++i) deq_block(type, row + i * ti->bytes, out + i * B);
    }
}

RowsFn scalar_rows(int type, int mode) {
#define EFS_CASE(T) case T_##T: return mode == 0 ? ex_##T : q8_##T;
    switch (type) {
        EFS_CASE(Q4_0) EFS_CASE(Q4_1) EFS_CASE(Q5_0) EFS_CASE(Q5_1) EFS_CASE(Q8_0)
        EFS_CASE(Q2_K) EFS_CASE(Q3_K) EFS_CASE(Q4_K) EFS_CASE(Q5_K) EFS_CASE(Q6_K)
        EFS_CASE(IQ4_XS) EFS_CASE(MXFP4) EFS_CASE(IQ4_NL)
        EFS_CASE(IQ2_XXS) EFS_CASE(IQ2_XS) EFS_CASE(IQ2_S) EFS_CASE(IQ3_XXS) EFS_CASE(IQ3_S)
        EFS_CASE(IQ1_S) EFS_CASE(IQ1_M) EFS_CASE(TQ1_0) EFS_CASE(TQ2_0)
        // F16 / BF16 in q8 mode: the float dot on fp16/bf16-rounded activations (X_F16R /
        // X_BF16R), as ggml_vec_dot_f16 / _bf16 with float accumulation.
        case T_F16: return ex_F16;
        case T_BF16: return ex_BF16;
        default: return nullptr;
    }
#undef EFS_CASE
}

}  // namespace efs
