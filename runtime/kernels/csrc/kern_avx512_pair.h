// The AVX-512 (F, VL, BW) units' two-rows-per-vector form (kern_k_avx512.cpp, whose comment
// describes it; kern_iq_avx512.cpp): lanes 0..7 of a vector are row r's AVX2 lanes, lanes
// 8..15 row r + 1's, so each half computes what the AVX2 kernel computes for its row. Included
// only by those units, inside an anonymous namespace, as kern_avx2_util.h.
#pragma once

#include "avx512_emulated.h"
#include "kern_avx2_util.h"

#define EFS_Z __attribute__((target(EFS_T512_FVLBW)))
#define EFS_ZI __attribute__((target(EFS_T512_FVLBW), \
                              always_inline)) inline
// the same with GFNI (its caller checks EFS_CPU_HAS_512("gfni"))
#define EFS_ZG __attribute__((target(EFS_T512_FVLBW_GFNI)))
#define EFS_ZGI __attribute__((target(EFS_T512_FVLBW_GFNI), always_inline)) inline

namespace efs {
namespace {

EFS_ZI __m512i ld2(const uint8_t* p0, const uint8_t* p1) {      // [32 bytes at p0 | at p1]
    return _mm512_inserti64x4(_mm512_castsi256_si512(loadu256(p0)), loadu256(p1), 1);
}

EFS_ZI __m512 ps2(__m256 a, __m256 b) {                          // [a | b]
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(a)),
                                               _mm256_castps_pd(b), 1));
}

EFS_ZI __m256 lo8(__m512 a) { return _mm512_castps512_ps256(a); }
EFS_ZI __m256 hi8(__m512 a) {
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
}

EFS_ZI float hsum_halves(__m512 a) {                            // hsum(lo8(a) + hi8(a))
    return hsum(_mm256_add_ps(lo8(a), hi8(a)));
}

EFS_ZI __m512 bc8(const float* p) {                              // [p[0..7] | p[0..7]]
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd((const double*)p)));
}

EFS_ZI __m512 halves(const float* lo, const float* hi) {         // [*lo x 8 | *hi x 8]
    return ps2(_mm256_broadcast_ss(lo), _mm256_broadcast_ss(hi));
}

// The AVX2 kernel's result for each half: hsum(a0 + a1) - hsum(am).
template <int NT, bool MIN>
EFS_ZI void put2(Out out, int64_t r, const __m512* a0, const __m512* a1, const __m512* am) {
    for (int t = 0; t < NT; ++t) {
        float v0 = hsum(_mm256_add_ps(lo8(a0[t]), lo8(a1[t])));
        float v1 = hsum(_mm256_add_ps(hi8(a0[t]), hi8(a1[t])));
        if (MIN) {
            v0 = v0 - hsum(lo8(am[t]));
            v1 = v1 - hsum(hi8(am[t]));
        }
        out.put(t, r, v0);
        out.put(t, r + 1, v1);
    }
}

}  // namespace
}  // namespace efs
