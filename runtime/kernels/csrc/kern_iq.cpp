// The lattice ("grid") IQ types in portable C++: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S,
// IQ1_M. Their codebooks are llama.cpp facts handed over from gguf-py at load (set_iq_table),
// so nothing here is a hand copy. Block layouts (ggml-common.h), per 32 weights ib:
//
//  - IQ2_XXS d:f16, qs:u16[32]: two words per ib, 4 grid bytes then 4x7 sign bits and a 4-bit
//    scale s; w = d * (0.5 + s) * 0.25 * grid * sign.
//  - IQ2_XS d, qs:u16[32], scales[8]: u16 = 9-bit grid | 7-bit ksigns index << 9, a 4-bit
//    scale per 16 weights; same value.
//  - IQ2_S d, qs[32], signs[32], qh[8], scales[8]: 10-bit grid index (qs | 2 bits of qh << 8),
//    explicit sign bits, a 4-bit scale per 16 weights.
//  - IQ3_XXS d, qs[64], scales_and_signs:u32[8]: 8-bit index into a 4-wide grid, the word
//    holds 4x7 sign bits and a 4-bit scale; w = d * (0.5 + s) * 0.5 * grid * sign.
//  - IQ3_S d, qs[64], qh[8], signs[32], scales[4]: 9-bit index, w = d * (1 + 2s) * grid * sign.
//  - IQ1_S d, qs[32], qh:u16[8]: 11-bit index; w = d * (2 * ((qh >> 12) & 7) + 1) *
//    (grid + delta), delta = -0.125 where bit 15 of qh is set, else 0.125.
//  - IQ1_M qs[32], qh[16], scales:u16[4]: d (fp16) in the top nibbles of the scale words,
//    3-bit scales per 16 weights, a delta sign per 8 weights (bit 3 of each qh nibble).
//  - TQ1_0 qs[48], qh[4], d: five base-3 digits per byte, digit n of byte q being
//    ((q * 3^n mod 256) * 3) >> 8; elements 0..159 are digit n of qs[0..31] (n major),
//    160..239 of qs[32..47], 240..255 digits 0..3 of qh[0..3]; w = d * (digit - 1).
//  - TQ2_0 qs[64], d: 2-bit codes t, element 32 n + j of each 128 is bits 2n.. of byte j;
//    w = d * (t - 1).
//
// Exact mode dequantizes a block the way ggml's dequantize_row_* does (kern_scalar.cpp's
// exact_rows does the float dot); q8 mode follows ggml-cpu's ggml_vec_dot_iq*_q8_K_generic:
// integer sums per sub-block, combined in float.
#include "kern.h"

#include <string.h>

namespace efs {

IqTables g_iq;

namespace {

const int8_t KV_IQ4NL_BUILTIN[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                     1, 13, 25, 38, 53, 69, 89, 113};

bool g_have[8];   // iq2xxs, iq2xs, iq2s, iq3xxs, iq3s, iq1s, ksigns, kvalues_iq4nl

inline float f16at(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return fp16_to_fp32(h);
}

inline uint16_t u16at(const uint8_t* p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

inline uint32_t u32at(const uint8_t* p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

inline const int8_t* g8(const uint64_t* grid, int idx) { return (const int8_t*)(grid + idx); }
inline const uint8_t* g4(const uint32_t* grid, int idx) { return (const uint8_t*)(grid + idx); }

inline float iq1m_d(const uint8_t* b) {
    const uint8_t* sc = b + 48;
    const uint16_t s0 = u16at(sc), s1 = u16at(sc + 2), s2 = u16at(sc + 4), s3 = u16at(sc + 6);
    return fp16_to_fp32((uint16_t)((s0 >> 12) | ((s1 >> 8) & 0x00f0) | ((s2 >> 4) & 0x0f00) |
                                   (s3 & 0xf000)));
}

// The float forms (kern.h) of table k of set_iq_table's slots, from its bytes just stored.
void float_tables(int k) {
    struct F { const int8_t* src; float* dst; int n; };
    const F fs[6] = {
        {(const int8_t*)g_iq.iq2xxs, g_iq.f_iq2xxs, 256 * 8},
        {(const int8_t*)g_iq.iq2xs, g_iq.f_iq2xs, 512 * 8},
        {(const int8_t*)g_iq.iq2s, g_iq.f_iq2s, 1024 * 8},
        {(const int8_t*)g_iq.iq3xxs, g_iq.f_iq3xxs, 256 * 4},
        {(const int8_t*)g_iq.iq3s, g_iq.f_iq3s, 512 * 4},
        {nullptr, nullptr, 0},                      // iq1s: f_iq1 and i_iq1, 8 g + delta, below
    };
    if (k < 6) {
        for (int i = 0; i < fs[k].n; ++i) fs[k].dst[i] = (float)fs[k].src[i];
        if (k == 5)
            for (int i = 0; i < 2 * 2048; ++i)
                for (int j = 0; j < 8; ++j) {
                    const int v = 8 * g8(g_iq.iq1s, i & 2047)[j] + (i >> 11 ? -1 : 1);
                    g_iq.f_iq1[8 * i + j] = (float)v;
                    ((int8_t*)&g_iq.i_iq1[i])[j] = (int8_t)v;
                }
    } else if (k == 6) {
        for (int i = 0; i < 128; ++i)
            for (int j = 0; j < 8; ++j)
                g_iq.f_ksigns[8 * i + j] = (g_iq.ksigns[i] >> j) & 1 ? 0x80000000u : 0u;
    }
    for (int i = 0; i < 256; ++i)
        for (int j = 0; j < 8; ++j) g_iq.f_bits[8 * i + j] = (i >> j) & 1 ? 0x80000000u : 0u;
}

}  // namespace

const char* set_iq_table(const char* name, const uint8_t* data, int64_t nbytes) {
    struct Slot { const char* name; void* dst; int64_t bytes; int k; };
    const Slot slots[] = {
        {"iq2xxs", g_iq.iq2xxs, sizeof g_iq.iq2xxs, 0}, {"iq2xs", g_iq.iq2xs, sizeof g_iq.iq2xs, 1},
        {"iq2s", g_iq.iq2s, sizeof g_iq.iq2s, 2}, {"iq3xxs", g_iq.iq3xxs, sizeof g_iq.iq3xxs, 3},
        {"iq3s", g_iq.iq3s, sizeof g_iq.iq3s, 4}, {"iq1s", g_iq.iq1s, sizeof g_iq.iq1s, 5},
        {"ksigns", g_iq.ksigns, sizeof g_iq.ksigns, 6},
        {"kvalues_iq4nl", g_iq.kvalues_iq4nl, sizeof g_iq.kvalues_iq4nl, 7},
    };
    for (const Slot& s : slots) {
        if (strcmp(s.name, name) != 0) continue;
        if (nbytes != s.bytes) return "wrong size";
        if (s.k == 7 && memcmp(data, KV_IQ4NL_BUILTIN, 16) != 0)
            return "differs from the kvalues_iq4nl the IQ4_XS / IQ4_NL kernels use";
        memcpy(s.dst, data, (size_t)nbytes);
        float_tables(s.k);
        if (s.k == 6)
            for (int k = 0; k < 128; ++k) {
                uint64_t m = 0;
                for (int j = 0; j < 8; ++j)
                    m |= (uint64_t)((g_iq.ksigns[k] >> j) & 1 ? 0xFF : 0x01) << (8 * j);
                g_iq.ksigns_mask[k] = m;
            }
        g_have[s.k] = true;
        bool all = true;
        for (bool h : g_have) all = all && h;
        g_iq.ok = all;
        return nullptr;
    }
    return "unknown table";
}

bool is_iq_family(int type) {
    return type == T_TQ1_0 || type == T_TQ2_0 || is_iq_grid(type);
}

// TQ1_0's base-3 digit `n` of element byte q, minus one (-1, 0, 1).
static inline int tq1_digit(uint8_t q, int n) {
    static const uint8_t pow3[5] = {1, 3, 9, 27, 81};
    const uint8_t m = (uint8_t)(q * pow3[n]);
    return (((int)m * 3) >> 8) - 1;
}

// The 256 integer weights (t - 1) of a TQ1_0 / TQ2_0 block in element order.
static void tq_ints(int type, const uint8_t* b, int8_t* q) {
    if (type == T_TQ2_0) {
        for (int h = 0; h < 2; ++h)
            for (int n = 0; n < 4; ++n)
                for (int j = 0; j < 32; ++j)
                    q[128 * h + 32 * n + j] = (int8_t)(((b[32 * h + j] >> (2 * n)) & 3) - 1);
        return;
    }
    for (int n = 0; n < 5; ++n)
        for (int j = 0; j < 32; ++j) q[32 * n + j] = (int8_t)tq1_digit(b[j], n);
    for (int n = 0; n < 5; ++n)
        for (int j = 0; j < 16; ++j) q[160 + 16 * n + j] = (int8_t)tq1_digit(b[32 + j], n);
    for (int n = 0; n < 4; ++n)
        for (int j = 0; j < 4; ++j) q[240 + 4 * n + j] = (int8_t)tq1_digit(b[48 + j], n);
}

bool is_iq_grid(int type) {
    switch (type) {
        case T_IQ2_XXS: case T_IQ2_XS: case T_IQ2_S: case T_IQ3_XXS: case T_IQ3_S:
        case T_IQ1_S: case T_IQ1_M: return true;
        default: return false;
    }
}

void deq_block_iq(int type, const uint8_t* b, float* y) {
    switch (type) {
    case T_IQ2_XXS: {
        const float d = f16at(b);
        for (int ib = 0; ib < 8; ++ib) {
            const uint8_t* q = b + 2 + 8 * ib;
            const uint32_t aux = u32at(q + 4);
            const float db = d * (0.5f + (float)(aux >> 28)) * 0.25f;
            for (int l = 0; l < 4; ++l) {
                const int8_t* g = g8(g_iq.iq2xxs, q[l]);
                const uint8_t s = g_iq.ksigns[(aux >> (7 * l)) & 127];
                for (int j = 0; j < 8; ++j) *y++ = db * (float)((s >> j) & 1 ? -g[j] : g[j]);
            }
        }
        break;
    }
    case T_IQ2_XS: {
        const float d = f16at(b);
        for (int ib = 0; ib < 8; ++ib) {
            const uint8_t sc = b[66 + ib];
            for (int l = 0; l < 4; ++l) {
                const float db = d * (0.5f + (float)(l < 2 ? sc & 0xf : sc >> 4)) * 0.25f;
                const uint16_t w = u16at(b + 2 + 8 * ib + 2 * l);
                const int8_t* g = g8(g_iq.iq2xs, w & 511);
                const uint8_t s = g_iq.ksigns[w >> 9];
                for (int j = 0; j < 8; ++j) *y++ = db * (float)((s >> j) & 1 ? -g[j] : g[j]);
            }
        }
        break;
    }
    case T_IQ2_S: {
        const float d = f16at(b);
        const uint8_t* qs = b + 2;
        const uint8_t* sg = b + 34;
        const uint8_t* qh = b + 66;
        for (int ib = 0; ib < 8; ++ib) {
            const uint8_t sc = b[74 + ib];
            for (int l = 0; l < 4; ++l) {
                const float db = d * (0.5f + (float)(l < 2 ? sc & 0xf : sc >> 4)) * 0.25f;
                const int8_t* g = g8(g_iq.iq2s, qs[4 * ib + l] | ((qh[ib] << (8 - 2 * l)) & 0x300));
                const uint8_t s = sg[4 * ib + l];
                for (int j = 0; j < 8; ++j) *y++ = db * (float)((s >> j) & 1 ? -g[j] : g[j]);
            }
        }
        break;
    }
    case T_IQ3_XXS: {
        const float d = f16at(b);
        for (int ib = 0; ib < 8; ++ib) {
            const uint32_t aux = u32at(b + 66 + 4 * ib);
            const float db = d * (0.5f + (float)(aux >> 28)) * 0.5f;
            const uint8_t* q = b + 2 + 8 * ib;
            for (int l = 0; l < 4; ++l) {
                const uint8_t s = g_iq.ksigns[(aux >> (7 * l)) & 127];
                const uint8_t* g1 = g4(g_iq.iq3xxs, q[2 * l]);
                const uint8_t* g2 = g4(g_iq.iq3xxs, q[2 * l + 1]);
                for (int j = 0; j < 4; ++j) {
                    y[j] = db * (float)((s >> j) & 1 ? -(int)g1[j] : (int)g1[j]);
                    y[j + 4] = db * (float)((s >> (j + 4)) & 1 ? -(int)g2[j] : (int)g2[j]);
                }
                y += 8;
            }
        }
        break;
    }
    case T_IQ3_S: {
        const float d = f16at(b);
        for (int ib = 0; ib < 8; ++ib) {
            const int sc = (b[106 + ib / 2] >> (4 * (ib % 2))) & 0xf;
            const float db = d * (float)(1 + 2 * sc);
            const uint8_t* q = b + 2 + 8 * ib;
            const uint8_t qh = b[66 + ib];
            for (int k = 0; k < 8; ++k) {
                const uint8_t* g = g4(g_iq.iq3s, q[k] | (((qh >> k) & 1) << 8));
                const uint8_t s = b[74 + 4 * ib + k / 2] >> (4 * (k % 2));
                for (int j = 0; j < 4; ++j) *y++ = db * (float)((s >> j) & 1 ? -(int)g[j] : (int)g[j]);
            }
        }
        break;
    }
    case T_IQ1_S: {
        const float d = f16at(b);
        for (int ib = 0; ib < 8; ++ib) {
            const uint16_t qh = u16at(b + 34 + 2 * ib);
            const float dl = d * (float)(2 * ((qh >> 12) & 7) + 1);
            const float delta = qh & 0x8000 ? -0.125f : 0.125f;
            for (int l = 0; l < 4; ++l) {
                const int8_t* g = g8(g_iq.iq1s, b[2 + 4 * ib + l] | (((qh >> (3 * l)) & 7) << 8));
                for (int j = 0; j < 8; ++j) *y++ = dl * ((float)g[j] + delta);
            }
        }
        break;
    }
    case T_IQ1_M: {
        const float d = iq1m_d(b);
        for (int ib = 0; ib < 8; ++ib) {
            const uint16_t sc = u16at(b + 48 + 2 * (ib / 2));
            for (int l = 0; l < 4; ++l) {
                const int s = (sc >> (6 * (ib % 2) + 3 * (l / 2))) & 7;
                const float dl = d * (float)(2 * s + 1);
                const uint8_t h = b[32 + 2 * ib + l / 2] >> (4 * (l % 2));
                const float delta = h & 8 ? -0.125f : 0.125f;
                const int8_t* g = g8(g_iq.iq1s, b[4 * ib + l] | ((h & 7) << 8));
                for (int j = 0; j < 8; ++j) *y++ = dl * ((float)g[j] + delta);
            }
        }
        break;
    }
    case T_TQ1_0: case T_TQ2_0: {
        const float d = f16at(b + (type == T_TQ1_0 ? 52 : 64));
        int8_t q[256];
        tq_ints(type, b, q);
        for (int j = 0; j < 256; ++j) y[j] = d * (float)q[j];
        break;
    }
    default:
        break;
    }
}

// The signed integer weights of one block (grid * sign; IQ1: 8 * (grid + delta), an odd
// integer) and the integer multiplier of each 16 of them, so that w = d * f * ls * q with f
// the type's constant factor (ggml_vec_dot_*: ls = 2s + 1 and f = 1/8 for IQ2, 1/4 for
// IQ3_XXS, 1 for IQ3_S, 1/8 for IQ1 here).
static float int_block(int type, const uint8_t* b, int8_t* q, int* ls) {
    switch (type) {
    case T_IQ2_XXS: case T_IQ3_XXS: {
        const bool three = type == T_IQ3_XXS;
        for (int ib = 0; ib < 8; ++ib) {
            const uint32_t aux = u32at(b + (three ? 66 + 4 * ib : 2 + 8 * ib + 4));
            ls[2 * ib] = ls[2 * ib + 1] = 2 * (int)(aux >> 28) + 1;
            const uint8_t* qi = b + 2 + 8 * ib;
            for (int l = 0; l < 4; ++l) {
                const uint8_t s = g_iq.ksigns[(aux >> (7 * l)) & 127];
                for (int j = 0; j < 8; ++j) {
                    const int g = three ? g4(g_iq.iq3xxs, qi[2 * l + j / 4])[j % 4]
                                        : g8(g_iq.iq2xxs, qi[l])[j];
                    q[32 * ib + 8 * l + j] = (int8_t)((s >> j) & 1 ? -g : g);
                }
            }
        }
        return three ? 0.25f : 0.125f;
    }
    case T_IQ2_XS: case T_IQ2_S: {
        const bool xs = type == T_IQ2_XS;
        for (int ib = 0; ib < 8; ++ib) {
            const uint8_t sc = b[(xs ? 66 : 74) + ib];
            ls[2 * ib] = 2 * (sc & 0xf) + 1;
            ls[2 * ib + 1] = 2 * (sc >> 4) + 1;
            for (int l = 0; l < 4; ++l) {
                const int8_t* g;
                uint8_t s;
                if (xs) {
                    const uint16_t wd = u16at(b + 2 + 8 * ib + 2 * l);
                    g = g8(g_iq.iq2xs, wd & 511);
                    s = g_iq.ksigns[wd >> 9];
                } else {
                    g = g8(g_iq.iq2s, b[2 + 4 * ib + l] | ((b[66 + ib] << (8 - 2 * l)) & 0x300));
                    s = b[34 + 4 * ib + l];
                }
                for (int j = 0; j < 8; ++j)
                    q[32 * ib + 8 * l + j] = (int8_t)((s >> j) & 1 ? -g[j] : g[j]);
            }
        }
        return 0.125f;
    }
    case T_IQ3_S: {
        for (int ib = 0; ib < 8; ++ib) {
            ls[2 * ib] = ls[2 * ib + 1] = 1 + 2 * ((b[106 + ib / 2] >> (4 * (ib % 2))) & 0xf);
            const uint8_t qh = b[66 + ib];
            for (int k = 0; k < 8; ++k) {
                const uint8_t* g = g4(g_iq.iq3s, b[2 + 8 * ib + k] | (((qh >> k) & 1) << 8));
                const uint8_t s = b[74 + 4 * ib + k / 2] >> (4 * (k % 2));
                for (int j = 0; j < 4; ++j)
                    q[32 * ib + 4 * k + j] = (int8_t)((s >> j) & 1 ? -(int)g[j] : (int)g[j]);
            }
        }
        return 1.f;
    }
    case T_IQ1_S: {
        for (int ib = 0; ib < 8; ++ib) {
            const uint16_t qh = u16at(b + 34 + 2 * ib);
            ls[2 * ib] = ls[2 * ib + 1] = 2 * ((qh >> 12) & 7) + 1;
            const int delta = qh & 0x8000 ? -1 : 1;
            for (int l = 0; l < 4; ++l) {
                const int8_t* g = g8(g_iq.iq1s, b[2 + 4 * ib + l] | (((qh >> (3 * l)) & 7) << 8));
                for (int j = 0; j < 8; ++j) q[32 * ib + 8 * l + j] = (int8_t)(8 * g[j] + delta);
            }
        }
        return 0.125f;
    }
    case T_IQ1_M: {
        for (int ib = 0; ib < 8; ++ib) {
            const uint16_t sc = u16at(b + 48 + 2 * (ib / 2));
            ls[2 * ib] = 2 * ((sc >> (6 * (ib % 2))) & 7) + 1;
            ls[2 * ib + 1] = 2 * ((sc >> (6 * (ib % 2) + 3)) & 7) + 1;
            for (int l = 0; l < 4; ++l) {
                const uint8_t h = b[32 + 2 * ib + l / 2] >> (4 * (l % 2));
                const int delta = h & 8 ? -1 : 1;
                const int8_t* g = g8(g_iq.iq1s, b[4 * ib + l] | ((h & 7) << 8));
                for (int j = 0; j < 8; ++j) q[32 * ib + 8 * l + j] = (int8_t)(8 * g[j] + delta);
            }
        }
        return 0.125f;
    }
    case T_TQ1_0: case T_TQ2_0:
        tq_ints(type, b, q);
        for (int g = 0; g < 16; ++g) ls[g] = 1;
        return 1.f;
    default:
        return 0.f;
    }
}

static float block_d(int type, const uint8_t* b) {
    switch (type) {
        case T_IQ1_M: return iq1m_d(b);
        case T_TQ1_0: return f16at(b + 52);
        case T_TQ2_0: return f16at(b + 64);
        default: return f16at(b);
    }
}

float vdot_q8_iq(int type, const uint8_t* row, int64_t cols, const Q8K* y) {
    const int64_t nb = cols / 256;
    int bytes = 0;
    switch (type) {
        case T_IQ2_XXS: bytes = 66; break;
        case T_IQ2_XS: bytes = 74; break;
        case T_IQ2_S: bytes = 82; break;
        case T_IQ3_XXS: bytes = 98; break;
        case T_IQ3_S: bytes = 110; break;
        case T_IQ1_S: bytes = 50; break;
        case T_IQ1_M: bytes = 56; break;
        case T_TQ1_0: bytes = 54; break;
        case T_TQ2_0: bytes = 66; break;
        default: return 0.f;
    }
    float sumf = 0.f;
    int8_t q[256];
    int ls[16];
    for (int64_t i = 0; i < nb; ++i) {
        const uint8_t* b = row + i * bytes;
        const float f = int_block(type, b, q, ls);
        int bsum = 0;
        for (int g = 0; g < 16; ++g) {
            int s = 0;
            for (int j = 0; j < 16; ++j) s += q[16 * g + j] * y[i].qs[16 * g + j];
            bsum += ls[g] * s;
        }
        sumf += block_d(type, b) * y[i].d * (float)bsum * f;
    }
    return sumf;
}

}  // namespace efs
