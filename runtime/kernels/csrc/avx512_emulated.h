// AVX-512 emulated for testing on a CPU without it: built with EFS_EMULATE_AVX512 (the
// build's EXPERTFS_KERNELS_EMULATE_AVX512=1), the AVX-512 units' intrinsics come from SIMDe
// (https://github.com/simd-everywhere/simde, Debian's libsimde-dev), which computes each
// 512-bit operation with two 256-bit ones (the module is built for AVX2 and FMA: fused
// multiply-adds as the hardware's), and the CPU checks report AVX-512. The kernels' code is
// unchanged, so a box without AVX-512 can check their results (bit for bit against the AVX2
// kernels, as tests/runtime/kernels/test_avx512_emulated.py does); their speed means nothing.
// Without EFS_EMULATE_AVX512 this header only names the target features of the real build.
#pragma once

#ifdef EFS_EMULATE_AVX512
#include <immintrin.h>
#include <string.h>
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <simde/x86/gfni.h>
// SIMDe 0.7.4's alias of this one takes the masked form's four arguments
#undef _mm512_madd_epi16
#define _mm512_madd_epi16(a, b) simde_mm512_madd_epi16(a, b)
// the conversions and the gather SIMDe 0.7.4 does not have
static inline simde__m512 efs_simde_cvtepi32_ps(simde__m512i a) {
    simde__m512i_private ap = simde__m512i_to_private(a);
    simde__m512_private rp;
    for (int i = 0; i < 16; ++i) rp.f32[i] = (float)ap.i32[i];
    return simde__m512_from_private(rp);
}
// N elements of type S in a (a vector of N * sizeof(S) bytes) widened to D: a 512-bit vector
template <class D, class S, int N, class A>
static inline simde__m512i efs_simde_widen(A a) {
    static_assert(N * sizeof(S) <= sizeof(A), "N elements of a");
    static_assert(N * sizeof(D) == sizeof(simde__m512i), "a 512-bit result");
    S s[N];
    D d[N];
    memcpy(s, &a, sizeof s);
    for (int i = 0; i < N; ++i) d[i] = (D)s[i];
    simde__m512i r;
    memcpy(&r, d, sizeof r);
    return r;
}
static inline simde__m512i efs_simde_i64gather_epi64(simde__m512i idx, const void* base,
                                                     int scale) {        // 8 qwords gathered
    simde__m512i_private ip = simde__m512i_to_private(idx);
    simde__m512i_private rp;
    for (int i = 0; i < 8; ++i)
        memcpy(&rp.i64[i], (const char*)base + ip.i64[i] * scale, 8);
    return simde__m512i_from_private(rp);
}
#undef _mm512_cvtepi32_ps
#define _mm512_cvtepi32_ps(a) efs_simde_cvtepi32_ps(a)
#undef _mm512_cvtepi8_epi32
#define _mm512_cvtepi8_epi32(a) efs_simde_widen<int32_t, int8_t, 16>(a)
#undef _mm512_cvtepu8_epi32
#define _mm512_cvtepu8_epi32(a) efs_simde_widen<int32_t, uint8_t, 16>(a)
#undef _mm512_cvtepu8_epi16
#define _mm512_cvtepu8_epi16(a) efs_simde_widen<int16_t, uint8_t, 32>(a)
#undef _mm512_cvtepu16_epi64
#define _mm512_cvtepu16_epi64(a) efs_simde_widen<int64_t, uint16_t, 8>(a)
#undef _mm512_i64gather_epi64
#define _mm512_i64gather_epi64(i, b, s) efs_simde_i64gather_epi64(i, b, s)
// target features of the AVX-512 functions: none beyond AVX2 (SIMDe's code is AVX2)
#define EFS_T512_F "avx2,fma,f16c"
#define EFS_T512_FVL "avx2,fma,f16c"
#define EFS_T512_FVLBW "avx2,fma,f16c"
#define EFS_T512_FVLBW_GFNI "avx2,fma,f16c"
#define EFS_CPU_HAS_512(feature) 1
#else
#define EFS_T512_F "avx512f,avx2,fma,f16c"
#define EFS_T512_FVL "avx512f,avx512vl,avx2,fma,f16c"
#define EFS_T512_FVLBW "avx512f,avx512vl,avx512bw,avx2,fma,f16c"
#define EFS_T512_FVLBW_GFNI "avx512f,avx512vl,avx512bw,gfni,avx2,fma,f16c"
#define EFS_CPU_HAS_512(feature) __builtin_cpu_supports(feature)
#endif
