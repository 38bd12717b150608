// glm5-next's per-token mixing steps in one native call each (see small_ops.h): mHC's pre and
// post mixes around every block, and KDA's short conv. Each replaces 6-12 torch operations on a
// few KB whose dispatch costs more than their work (bench/README.md, GLM-5.3-Flash decode).
#include "small_ops.h"

#include "kern.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <vector>

namespace efs {
namespace {

void check_mix(const at::Tensor& t, const char* what) {
    TORCH_CHECK(t.is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(),
                "expertfs mix ops: ", what, " must be a contiguous float32 CPU tensor");
}

inline float sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }

// o[i] = a * y[i] (a != 0 or y given), then o[i] += c_k * s_k[i] for each of the m rows s_k.
#if defined(__x86_64__) || defined(__i386__)
__attribute__((target_clones("avx2", "default")))
#endif
void mix_row(float* o, float a, const float* y, const float* c, int64_t cstride,
             const float* s, int64_t m, int64_t D) {
    if (y != nullptr) {
        for (int64_t d = 0; d < D; ++d) o[d] = a * y[d];
    } else {
        for (int64_t d = 0; d < D; ++d) o[d] = 0.0f;
    }
    for (int64_t k = 0; k < m; ++k) {
        const float ck = c[k * cstride];
        const float* sk = s + k * D;
        for (int64_t d = 0; d < D; ++d) o[d] += ck * sk[d];
    }
}

// y[c] = sum_j window[c, j] w[c, j] + x[c] w[c, K - 1], the window shifted to take x[c]; the
// common width (KDA's d_conv of 4) with its loops unrolled.
template <int KT>
inline __attribute__((always_inline)) void conv_rows_t(const float* x, const float* w, float* win,
                                                        float* y, int64_t C, int64_t K) {
    const int64_t k = KT > 0 ? KT : K;
    for (int64_t c = 0; c < C; ++c) {
        const float* wc = w + c * k;
        float* hc = win + c * (k - 1);
        float acc = 0.0f;
        for (int64_t j = 0; j < k - 1; ++j) acc += hc[j] * wc[j];
        acc += x[c] * wc[k - 1];
        for (int64_t j = 0; j + 1 < k - 1; ++j) hc[j] = hc[j + 1];
        if (k > 1) hc[k - 2] = x[c];
        y[c] = acc;
    }
}

#if defined(__x86_64__) || defined(__i386__)
__attribute__((target_clones("avx2", "default")))
#endif
void conv_rows(const float* x, const float* w, float* win, float* y, int64_t C, int64_t K) {
    if (K == 4)
        conv_rows_t<4>(x, w, win, y, C, K);
    else
        conv_rows_t<0>(x, w, win, y, C, K);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> hc_pre(const at::Tensor& streams,
                                                      const at::Tensor& fn, const at::Tensor& base,
                                                      const at::Tensor& scales, int64_t iters,
                                                      double eps, double rms_eps) {
    check_mix(streams, "streams");
    check_mix(fn, "fn");
    check_mix(base, "base");
    check_mix(scales, "scales");
    TORCH_CHECK(streams.dim() == 3 && streams.size(0) == 1 && streams.size(1) > 0,
                "expertfs mix ops: hc_pre takes one token's streams [1, n, D]");
    const int64_t n = streams.size(1), D = streams.size(2), M = (2 + n) * n, nd = n * D;
    TORCH_CHECK(fn.dim() == 2 && fn.size(0) == M && fn.size(1) == nd && base.numel() == M &&
                scales.numel() == M, "expertfs mix ops: hc_pre needs fn [(2 + n) n, n D] and "
                "base, scales of (2 + n) n for ", n, " streams of ", D);
    const float* s = streams.data_ptr<float>();
    std::vector<float> xn((size_t)nd), lin((size_t)M);
    const float r = rms_scale(s, nd, rms_eps);
    for (int64_t i = 0; i < nd; ++i) xn[i] = s[i] * r;                // rms_norm's y = x * r
    {
        pybind11::gil_scoped_release nogil;
        rows_dot(fn.data_ptr<float>(), xn.data(), lin.data(), M, nd);
    }
    const float *bp = base.data_ptr<float>(), *sp = scales.data_ptr<float>();
    const at::TensorOptions f32 = streams.options();
    at::Tensor pre = at::empty({1, n}, f32), post = at::empty({1, n}, f32);
    at::Tensor comb = at::empty({1, n, n}, f32), x = at::empty({1, D}, f32);
    float *pp = pre.data_ptr<float>(), *qp = post.data_ptr<float>(), *cp = comb.data_ptr<float>();
    for (int64_t i = 0; i < M; ++i) {
        const float m = bp[i] + lin[i] * sp[i];                     // addcmul(base, lin, scales)
        if (i < n)
            pp[i] = sigmoid(m) + (float)eps;
        else if (i < 2 * n)
            qp[i - n] = sigmoid(m) * 2.0f;
        else
            cp[i - 2 * n] = m;
    }
    sinkhorn_(comb, iters, eps);
    mix_row(x.data_ptr<float>(), 0.0f, nullptr, pp, 1, s, n, D);
    return {x, post, comb};
}

at::Tensor hc_post(const at::Tensor& y, const at::Tensor& streams, const at::Tensor& post,
                   const at::Tensor& comb) {
    check_mix(y, "y");
    check_mix(streams, "streams");
    check_mix(post, "post");
    check_mix(comb, "comb");
    TORCH_CHECK(streams.dim() == 3 && streams.size(0) == 1, "expertfs mix ops: hc_post takes "
                "one token's streams [1, n, D]");
    const int64_t n = streams.size(1), D = streams.size(2);
    TORCH_CHECK(y.numel() == D && post.numel() == n && comb.numel() == n * n,
                "expertfs mix ops: hc_post needs y [1, D], post [1, n] and comb [1, n, n]");
    at::Tensor out = at::empty({1, n, D}, streams.options());
    const float *yp = y.data_ptr<float>(), *s = streams.data_ptr<float>();
    const float *pp = post.data_ptr<float>(), *cp = comb.data_ptr<float>();
    float* o = out.data_ptr<float>();
    for (int64_t j = 0; j < n; ++j) mix_row(o + j * D, pp[j], yp, cp + j, n, s, n, D);
    return out;
}

at::Tensor conv_step_(const at::Tensor& x, const at::Tensor& w, at::Tensor& window) {
    check_mix(x, "x");
    check_mix(w, "conv weight");
    check_mix(window, "conv window");
    TORCH_CHECK(w.dim() == 2 && w.size(1) >= 1, "expertfs mix ops: conv_step_ needs w [C, K]");
    const int64_t C = w.size(0), K = w.size(1);
    TORCH_CHECK(x.numel() == C && window.dim() == 2 && window.size(0) == C &&
                window.size(1) == K - 1, "expertfs mix ops: conv_step_ needs x of ", C,
                " values and a window [", C, ", ", K - 1, "]");
    at::Tensor y = at::empty({1, C}, x.options());
    float* yp = y.data_ptr<float>();
    conv_rows(x.data_ptr<float>(), w.data_ptr<float>(), window.data_ptr<float>(), yp, C, K);
    if (isa_avx2()) {
        avx2_silu(yp, C);
    } else {
        for (int64_t c = 0; c < C; ++c) yp[c] = yp[c] / (1.0f + std::exp(-yp[c]));
    }
    return y;
}

}  // namespace efs
