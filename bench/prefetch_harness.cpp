// Software prefetch variants for the AVX2 exact one-token products (bench/README.md, "Native
// kernels"): the Q8_0 and Q6_K loops of runtime/kernels/csrc (the same unpack and float
// products, activations unpermuted), two threads taking row chunks from a shared counter as the
// kernels' pool does, over a set of matrices larger than the last-level cache (cold, as in
// decode). The variants alternate round by round; medians of the rounds, in GB/s of weights.
//   burst-row    the whole next row prefetched at each row's start (the kernels before 36b7900)
//   none         no software prefetch
//   blk+N        per block, the lines N bytes ahead
//   trkN         a cursor N bytes ahead, advanced block by block (what the kernels do now);
//                "-burst": started at the chunk's first byte rather than N past it
//   rowburst / halfburst (Q8_0): the cursor advanced once per row / half row
// Build and run (type 8 = Q8_0, 6 = Q6_K; rows cols matrices rounds):
//   g++ -O3 -mavx2 -mfma -mf16c -pthread bench/prefetch_harness.cpp -o /tmp/pfh
//   /tmp/pfh 8 2048 4096 80 15 && /tmp/pfh 6 2048 4096 80 15
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <stdio.h>
#include <stdlib.h>
#include <vector>
#include <thread>
#include <atomic>
#include <chrono>
#include <algorithm>
#define TI __attribute__((always_inline)) inline
static TI float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s)); s = _mm_add_ss(s, _mm_movehdup_ps(s)); return _mm_cvtss_f32(s);
}
static TI float f16(const uint8_t* p) { uint16_t h; memcpy(&h, p, 2); return _cvtsh_ss(h); }
static TI __m256i loadu256(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
static TI void u8f(__m256i v, __m256 moff, __m256* w) {
    const __m256i z = _mm256_setzero_si256(); const __m256i mg = _mm256_set1_epi16(0x4B00);
    const __m256i lo = _mm256_unpacklo_epi8(v, z), hi = _mm256_unpackhi_epi8(v, z);
    w[0] = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(lo, mg)), moff);
    w[1] = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(lo, mg)), moff);
    w[2] = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(hi, mg)), moff);
    w[3] = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(hi, mg)), moff);
}
static TI void grp(__m256i v, __m256 moff, const float* x, __m256 scale, __m256& acc) {
    __m256 w[4]; u8f(v, moff, w);
    __m256 a = _mm256_mul_ps(w[0], _mm256_loadu_ps(x));
    a = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(x + 8), a);
    a = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(x + 16), a);
    a = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(x + 24), a);
    acc = _mm256_fmadd_ps(a, scale, acc);
}
// MODE 0: row-ahead burst (current); 1: none; 2: per-block stream prefetch DIST bytes ahead; 3: per block 2 rows ahead burst-free
template <int MODE, int DIST>
void q8_rows(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols, const float* x, float* y) {
    const int64_t nb = cols / 32; const __m256 moff = _mm256_set1_ps(8388608.f + 128.f);
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    const char* pfp = (const char*)(W + r0 * rb) + (MODE == 3 ? DIST : 0);
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* b = W + r * rb;
        if (MODE == 0) { const uint8_t* p = b + rb; for (int64_t o = 0; o < rb; o += 64) _mm_prefetch((const char*)p + o, _MM_HINT_T0); }
        if (MODE == 5) { const char* tt = (const char*)b + rb + DIST; while (pfp < tt) { _mm_prefetch(pfp, _MM_HINT_T0); pfp += 64; } }
        if (MODE == 6) { const char* tt = (const char*)b + rb / 2 + DIST; while (pfp < tt) { _mm_prefetch(pfp, _MM_HINT_T0); pfp += 64; } }
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        for (int64_t i = 0; i < nb; i += 2, b += 68) {
            if (MODE == 6 && i == nb / 2) { const char* tt = (const char*)b + rb / 2 + DIST; while (pfp < tt) { _mm_prefetch(pfp, _MM_HINT_T0); pfp += 64; } }
            if (MODE == 2) { _mm_prefetch((const char*)b + DIST, _MM_HINT_T0); _mm_prefetch((const char*)b + DIST + 64, _MM_HINT_T0); }
            if (MODE >= 3) { const char* tt = (const char*)b + DIST + 68; while (pfp < tt) { _mm_prefetch(pfp, _MM_HINT_T0); pfp += 64; } }
            grp(_mm256_xor_si256(loadu256(b + 2), flip), moff, x + 32 * i, _mm256_set1_ps(f16(b)), a0);
            grp(_mm256_xor_si256(loadu256(b + 36), flip), moff, x + 32 * i + 32, _mm256_set1_ps(f16(b + 34)), a1);
        }
        y[r] = hsum(_mm256_add_ps(a0, a1));
    }
}
template <int MODE, int DIST>
void q6_rows(const uint8_t* W, int64_t rb, int64_t r0, int64_t r1, int64_t cols, const float* x, float* y) {
    const int64_t nb = cols / 256;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    const __m256 moff = _mm256_set1_ps(8388608.f + 32.f);
    const char* pfp = (const char*)(W + r0 * rb) + (MODE == 3 ? DIST : 0);
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* b = W + r * rb;
        if (MODE == 0) { const uint8_t* p = b + rb; for (int64_t o = 0; o < rb; o += 64) _mm_prefetch((const char*)p + o, _MM_HINT_T0); }
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        for (int64_t i = 0; i < nb; ++i, b += 210) {
            if (MODE == 2) for (int k = 0; k < 4; ++k) _mm_prefetch((const char*)b + DIST + 64 * k, _MM_HINT_T0);
            if (MODE >= 3) { const char* tt = (const char*)b + DIST + 210; while (pfp < tt) { _mm_prefetch(pfp, _MM_HINT_T0); pfp += 64; } }
            const __m256 d = _mm256_set1_ps(f16(b + 208));
            __m256 S[2];
            S[0] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(b + 192)))));
            S[1] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(b + 200)))));
            for (int h = 0; h < 2; ++h) {
                const __m256i A = loadu256(b + 64 * h), B = loadu256(b + 64 * h + 32), QH = loadu256(b + 128 + 32 * h);
                const __m256i q0 = _mm256_or_si256(_mm256_and_si256(A, m4), _mm256_and_si256(_mm256_slli_epi16(QH, 4), m30));
                const __m256i q1 = _mm256_or_si256(_mm256_and_si256(B, m4), _mm256_and_si256(_mm256_slli_epi16(QH, 2), m30));
                const __m256i q2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(A, 4), m4), _mm256_and_si256(QH, m30));
                const __m256i q3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(B, 4), m4), _mm256_and_si256(_mm256_srli_epi16(QH, 2), m30));
                const float* xo = x + 256 * i + 128 * h;
                #define PS(s, p) _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(2*p,2*p,2*p,2*p,2*p+1,2*p+1,2*p+1,2*p+1))
                grp(q0, moff, xo, PS(S[h], 0), a0); grp(q1, moff, xo + 32, PS(S[h], 1), a1);
                grp(q2, moff, xo + 64, PS(S[h], 2), a0); grp(q3, moff, xo + 96, PS(S[h], 3), a1);
            }
        }
        y[r] = hsum(_mm256_add_ps(a0, a1));
    }
}
typedef void (*Fn)(const uint8_t*, int64_t, int64_t, int64_t, int64_t, const float*, float*);
struct Pool {
    std::atomic<int> gen{0}, done{0}; std::atomic<int64_t> next{0};
    Fn fn; const uint8_t* W; int64_t rb, rows, cols, rc; const float* x; float* y; bool stop = false;
    std::thread th;
    void work() { for (;;) { int64_t c = next.fetch_add(1); int64_t r0 = c * rc; if (r0 >= rows) break; fn(W, rb, r0, std::min(rows, r0 + rc), cols, x, y); } }
    void start() { th = std::thread([this] { int g = 0; for (;;) { while (gen.load() == g) {} g = gen.load(); if (stop) return; work(); done.fetch_add(1); } }); }
    void run(Fn f, const uint8_t* w, int64_t rb_, int64_t rows_, int64_t cols_, const float* x_, float* y_, int64_t rc_) {
        fn = f; W = w; rb = rb_; rows = rows_; cols = cols_; x = x_; y = y_; rc = rc_; next = 0; done = 0;
        gen.fetch_add(1); work(); while (done.load() < 1) {}
    }
};
int main(int argc, char** argv) {
    int type = atoi(argv[1]);   // 8 or 6
    int64_t rows = atoi(argv[2]), cols = atoi(argv[3]); int nmat = atoi(argv[4]); int rounds = atoi(argv[5]);
    int64_t rb = type == 8 ? cols / 32 * 34 : cols / 256 * 210;
    std::vector<uint8_t*> mats;
    for (int m = 0; m < nmat; ++m) {
        uint8_t* p = (uint8_t*)aligned_alloc(4096, (rows * rb + 4095) / 4096 * 4096 + 8192);
        for (int64_t i = 0; i < rows * rb + 8192; ++i) p[i] = (uint8_t)(rand() & 0x3f);
        // sane f16 scales
        if (type == 8) for (int64_t i = 0; i < rows * rb; i += 34) { p[i] = 0; p[i + 1] = 0x20; }
        else for (int64_t i = 0; i < rows * rb; i += 210) { p[i + 208] = 0; p[i + 209] = 0x20; }
        mats.push_back(p);
    }
    std::vector<float> x(cols, 0.5f), y(rows);
    Pool pool; pool.start();
    std::vector<std::pair<const char*, Fn>> vs;
    if (type == 8) vs = {{"burst-row", q8_rows<0, 0>}, {"none", q8_rows<1, 0>}, {"blk+1K", q8_rows<2, 1024>}, {"blk+2K", q8_rows<2, 2048>}, {"blk+4K", q8_rows<2, 4096>}, {"blk+8K", q8_rows<2, 8192>}, {"trk3K", q8_rows<3, 3072>}, {"trk3K-burst", q8_rows<4, 3072>}, {"rowburst3K", q8_rows<5, 3072>}, {"halfburst3K", q8_rows<6, 3072>}};
    else vs = {{"burst-row", q6_rows<0, 0>}, {"none", q6_rows<1, 0>}, {"blk+1K", q6_rows<2, 1024>}, {"blk+2K", q6_rows<2, 2048>}, {"blk+4K", q6_rows<2, 4096>}, {"blk+8K", q6_rows<2, 8192>}, {"trk3K", q6_rows<3, 3072>}, {"trk3K-burst", q6_rows<4, 3072>}};
    int64_t rc = std::max<int64_t>(2, 65536 / cols);
    std::vector<std::vector<double>> t(vs.size());
    for (int r = 0; r < rounds; ++r)
        for (size_t v = 0; v < vs.size(); ++v) {
            auto t0 = std::chrono::steady_clock::now();
            for (int m = 0; m < nmat; ++m) pool.run(vs[v].second, mats[m], rb, rows, cols, x.data(), y.data(), rc);
            t[v].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        }
    double bytes = (double)rows * rb * nmat;
    for (size_t v = 0; v < vs.size(); ++v) { auto s = t[v]; std::sort(s.begin(), s.end()); printf("%-10s %6.2f GB/s  %6.2f Gw/s\n", vs[v].first, bytes / s[s.size() / 2] / 1e9, (double)rows * cols * nmat / s[s.size() / 2] / 1e9); }
    pool.stop = true; pool.gen.fetch_add(1); pool.th.join();
}
