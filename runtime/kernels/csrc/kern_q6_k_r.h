// The exact Q6_K one-row kernel (kern_k_avx512.cpp's ex_q6_k_r, whose comment describes it),
// included there twice, with no include guard: EFS_Q6R_NAME compiled with EFS_Q6R_ATTR and
// decoded by EFS_Q6R_DEC, once with Q6Row for any AVX-512 BW CPU and once with Q6RowGF and
// GFNI, so that neither build carries an instruction its CPU may lack.
template <int NT, int R>
EFS_Q6R_ATTR void EFS_Q6R_NAME(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1,
                               int64_t cols, const XPrep* xs, Out out) {
    const int64_t nb = cols / 256;
    const float* xh[NT];
    for (int t = 0; t < NT; ++t) xh[t] = xs[t].xh;
    const EFS_Q6R_DEC dec;
    const __m512i o32 = _mm512_set1_epi8(32);
    __m512i mk[4];
    byte_shuffles(3, mk);                            // u8f<SIGNED>'s
    const __m512i quad = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    RowCursor<R> rc(W, rb, r0);
    const uint8_t* const* b = rc.b;
    int64_t r = r0;
    for (; r + R <= r1; r += R) {
        rc.at(W, rb, r);
        __m512 acc[R][NT];
        for (int j = 0; j < R; ++j)
            for (int t = 0; t < NT; ++t) acc[j][t] = _mm512_setzero_ps();
        for (int64_t i = 0; i < nb; ++i) {
            rc.prefetch(210);
            __m512 S[R];                  // the block's 16 scales times d (and 2^-24), exact
            for (int j = 0; j < R; ++j) {
                const __m512i sc = _mm512_cvtepi8_epi32(loadu128(b[j] + 192));
                S[j] = _mm512_mul_ps(_mm512_set1_ps(f16(b[j] + 208) * unit<SIGNED>()),
                                     _mm512_cvtepi32_ps(sc));
            }
            for (int h = 0; h < 2; ++h) {
                __m512i q[R][2];
                for (int j = 0; j < R; ++j) {
                    dec.planes(b[j], h, q[j]);
                    if constexpr (!EFS_Q6R_DEC::SIGNED) {
                        q[j][0] = _mm512_sub_epi8(q[j][0], o32);
                        q[j][1] = _mm512_sub_epi8(q[j][1], o32);
                    }
                }
                for (int p = 0; p < 2; ++p) {
                    __m512 w[R][4], sc[R];
                    const __m512i idx = _mm512_add_epi32(quad, _mm512_set1_epi32(8 * h + 4 * p));
                    for (int j = 0; j < R; ++j) {
                        for (int k = 0; k < 4; ++k)
                            w[j][k] = _mm512_cvtepi32_ps(_mm512_shuffle_epi8(q[j][p], mk[k]));
                        sc[j] = _mm512_permutexvar_ps(idx, S[j]);
                    }
                    const int64_t o = 256 * i + 128 * h + 64 * p;
                    for (int t = 0; t < NT; ++t) {
                        const float* x = xh[t] + o;
                        const __m512 x0 = _mm512_load_ps(x), x1 = _mm512_load_ps(x + 16);
                        const __m512 x2 = _mm512_load_ps(x + 32), x3 = _mm512_load_ps(x + 48);
                        for (int j = 0; j < R; ++j) {
                            __m512 a = _mm512_mul_ps(w[j][0], x0);
                            a = _mm512_fmadd_ps(w[j][1], x1, a);
                            a = _mm512_fmadd_ps(w[j][2], x2, a);
                            a = _mm512_fmadd_ps(w[j][3], x3, a);
                            acc[j][t] = _mm512_fmadd_ps(a, sc[j], acc[j][t]);
                        }
                    }
                }
            }
            rc.step(210);
        }
        for (int j = 0; j < R; ++j)
            for (int t = 0; t < NT; ++t)
                out.put(t, r + j, hsum_halves(acc[j][t]));
    }
    if (R == 2 && r < r1) EFS_Q6R_NAME<NT, 1>(W, rb, r, r1, cols, xs, out);
}
