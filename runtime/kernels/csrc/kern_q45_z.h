// A Q4_K/Q5_K block's scales for the AVX-512 units' one-row exact kernels (kern_avx512.cpp's
// Q4_K, kern_k_avx512.cpp's Q5_K), kept in one register: the products q45_scales makes (the
// AVX2 kernels' d * scale and dmin * min), so the same bits. Each group's scale vector is then
// one permute of it, where a store of the scales and broadcast loads of them waited on the
// store. Included by those units after kern_k_avx2.h, inside no namespace.
#pragma once

#include "avx512_emulated.h"
#include "kern_k_avx2.h"

#define EFS_QZI __attribute__((target(EFS_T512_F), always_inline)) inline

namespace efs {
namespace {

// The block's 8 mins times dmin in lanes 0..7 (the AVX2 kernels' mins vector, lo8 of it) and
// its 8 sub-block scales times d in lanes 8..15.
EFS_QZI __m512 q45_scales_z(const uint8_t* b) {
    const __m128i ms = _mm_shuffle_epi32(k4_scales_v(b + 4), 0x4E);   // mins, scales
    uint32_t dd;
    memcpy(&dd, b, 4);
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dd));       // d, dmin
    const __m512 dv = _mm512_permutexvar_ps(
        _mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
        _mm512_castps128_ps512(dm));
    return _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(ms)));
}

// [scale a x 8 | scale b x 8] of q45_scales_z's vector.
EFS_QZI __m512 q45_pair(__m512 sv, int a, int b) {
    a += 8;
    b += 8;
    return _mm512_permutexvar_ps(_mm512_setr_epi32(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b),
                                 sv);
}

}  // namespace
}  // namespace efs
