// A 16 x 16 block of 32-bit words transposed in AVX-512 registers (four rounds of swapping the
// off-diagonal blocks of 8, 4, 2, 1 words): out row i (stride os words) = column i of in
// (stride is words). The panel products use it to put 4 bytes or 2 bf16 of one row in a lane
// (qgemm_q8.cpp, qgemm_amx.cpp). Included inside an anonymous namespace.
#pragma once

#include <immintrin.h>
#include <stdint.h>

namespace efs {
namespace {

__attribute__((target("avx512f"), always_inline)) inline void transpose16(
        const int32_t* in, int64_t is, int32_t* out, int64_t os) {
    static const int D[4] = {8, 4, 2, 1};
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(in + i * is);
    for (int s = 0; s < 4; ++s) {
        alignas(64) int32_t a[16], b[16];
        for (int c = 0; c < 16; ++c) {
            const bool set = c & D[s];
            a[c] = set ? 16 + c - D[s] : c;        // row i (bit clear): A[c] or B[c - d]
            b[c] = set ? 16 + c : c + D[s];        // row i + d: A[c + d] or B[c]
        }
        const __m512i lo = _mm512_load_si512(a), hi = _mm512_load_si512(b);
        const int d = D[s];
        for (int i = 0; i < 16; ++i) {
            if (i & d) continue;
            const __m512i A = r[i], B = r[i + d];
            r[i] = _mm512_permutex2var_epi32(A, lo, B);
            r[i + d] = _mm512_permutex2var_epi32(A, hi, B);
        }
    }
    for (int i = 0; i < 16; ++i) _mm512_storeu_si512(out + i * os, r[i]);
}

}  // namespace
}  // namespace efs
