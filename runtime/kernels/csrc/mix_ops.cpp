// glm5-next's per-token mixing steps in one native call each (see small_ops.h): mHC's pre and
// post mixes around every block, KDA's short conv and the rest of a KDA layer's token around
// its delta-rule step. Each replaces 6-20 torch operations on a few KB whose dispatch costs
// more than their work (bench/README.md, GLM-5.3-Flash decode).
#include "small_ops.h"

#include "kern.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <cstring>
#include <initializer_list>
#include <vector>

namespace efs {
namespace {

inline float sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }

// x[i] = (x[i] if silu, else 1) / (1 + exp(-x[i])) over n floats in place: the AVX2 exp where
// the kernels run at that tier.
void act_(float* x, int64_t n, bool silu) {
    if (isa_avx2()) {
        (silu ? avx2_silu : avx2_sigmoid)(x, n);
        return;
    }
    for (int64_t i = 0; i < n; ++i) x[i] = (silu ? x[i] : 1.0f) / (1.0f + std::exp(-x[i]));
}

// o[i] = a * y[i] (0 where y is null), then o[i] += c_k * s_k[i] for each of the m rows s_k.
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

// Each of the n rows of d floats of x divided by sqrt(its sum of squares + eps), into y.
void l2_rows(const float* x, float* y, int64_t n, int64_t d, float eps) {
    for (int64_t r = 0; r < n; ++r) {
        const float* xr = x + r * d;
        float ss = 0.0f;
        for (int64_t i = 0; i < d; ++i) ss += xr[i] * xr[i];
        const float den = std::sqrt(ss + eps);
        for (int64_t i = 0; i < d; ++i) y[r * d + i] = xr[i] / den;
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
    check_f32(streams, "hc_pre", "streams");
    check_f32(fn, "hc_pre", "fn");
    check_f32(base, "hc_pre", "base");
    check_f32(scales, "hc_pre", "scales");
    TORCH_CHECK(streams.dim() == 3 && streams.size(0) == 1 && streams.size(1) > 0,
                "expertfs mix ops: hc_pre takes one token's streams [1, n, D]");
    const int64_t n = streams.size(1), D = streams.size(2), M = (2 + n) * n, nd = n * D;
    TORCH_CHECK(fn.dim() == 2 && fn.size(0) == M && fn.size(1) == nd && base.numel() == M &&
                scales.numel() == M, "expertfs mix ops: hc_pre needs fn [(2 + n) n, n D] and "
                "base, scales of (2 + n) n for ", n, " streams of ", D);
    const float* s = streams.data_ptr<float>();
    std::vector<float> xn((size_t)nd), lin((size_t)M);
    norm_row(s, xn.data(), nullptr, nd, rms_eps);                    // rms_norm(flat, None)
    {
        pybind11::gil_scoped_release nogil;
        rows_dot(fn.data_ptr<float>(), xn.data(), lin.data(), M, nd);
    }
    const float *bp = base.data_ptr<float>(), *sp = scales.data_ptr<float>();
    const at::TensorOptions f32 = streams.options();
    std::vector<float> pre((size_t)n);                              // used here only
    at::Tensor post = at::empty({1, n}, f32);
    at::Tensor comb = at::empty({1, n, n}, f32), x = at::empty({1, D}, f32);
    float *pp = pre.data(), *qp = post.data_ptr<float>(), *cp = comb.data_ptr<float>();
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
    check_f32(y, "hc_post", "y");
    check_f32(streams, "hc_post", "streams");
    check_f32(post, "hc_post", "post");
    check_f32(comb, "hc_post", "comb");
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

at::Tensor kda_token_(const at::Tensor& qkv, const at::Tensor& f, const at::Tensor& gate,
                      const at::Tensor& beta, const at::Tensor& dt_bias, const at::Tensor& a,
                      bool has_lb, double lb, const at::Tensor& o_norm, double rms_eps,
                      double l2_eps, at::Tensor& S) {
    for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{
             &qkv, &f, &gate, &beta, &dt_bias, &a, &o_norm, &S})
        check_f32(*t, "kda_token_", "each tensor");
    TORCH_CHECK(S.dim() == 3 && S.size(1) == S.size(2), "expertfs mix ops: kda_token_ needs a "
                "state [H, Dk, Dk]");
    const int64_t H = S.size(0), Dk = S.size(1), HD = H * Dk;
    TORCH_CHECK(qkv.numel() == 3 * HD && f.numel() == HD && gate.numel() == HD &&
                dt_bias.numel() == HD && beta.numel() == H && a.numel() == H &&
                o_norm.numel() == Dk, "expertfs mix ops: kda_token_ takes one token: qkv [3 H ",
                "Dk], f, gate, dt_bias [H Dk], beta, a [H], o_norm [Dk] for a state [", H, ", ",
                Dk, ", ", Dk, "]");
    const float* x = qkv.data_ptr<float>();
    std::vector<float> buf((size_t)(3 * HD + H));
    float *qn = buf.data(), *kn = qn + HD, *g = kn + HD, *bt = g + HD;
    l2_rows(x, qn, H, Dk, (float)l2_eps);
    const float qs = (float)std::pow((double)Dk, -0.5);
    for (int64_t i = 0; i < HD; ++i) qn[i] *= qs;                 // l2_norm(q).mul_(Dk^-1/2)
    l2_rows(x + HD, kn, H, Dk, (float)l2_eps);
    const float *fp = f.data_ptr<float>(), *db = dt_bias.data_ptr<float>();
    const float* ap = a.data_ptr<float>();
    for (int64_t h = 0; h < H; ++h)
        for (int64_t i = h * Dk; i < (h + 1) * Dk; ++i) {
            const float t = fp[i] + db[i];
            g[i] = has_lb ? -ap[h] * t : t;
        }
    if (has_lb) {
        act_(g, HD, false);
        for (int64_t i = 0; i < HD; ++i) g[i] *= (float)lb;
    } else {                                   // a softplus(t), torch's threshold of 20
        for (int64_t i = 0; i < HD; ++i)
            g[i] = ap[i / Dk] * (g[i] > 20.0f ? g[i] : std::log1p(std::exp(g[i])));
    }
    std::memcpy(bt, beta.data_ptr<float>(), sizeof(float) * H);
    act_(bt, H, false);
    const at::TensorOptions f32 = S.options();
    at::Tensor o = kda_step_(at::from_blob(qn, {H, Dk}, f32), at::from_blob(kn, {H, Dk}, f32),
                             at::from_blob(const_cast<float*>(x + 2 * HD), {H, Dk}, f32),
                             at::from_blob(g, {H, Dk}, f32), at::from_blob(bt, {H}, f32), S);
    std::vector<float> sg(gate.data_ptr<float>(), gate.data_ptr<float>() + HD);
    act_(sg.data(), HD, false);
    at::Tensor out = at::empty({1, HD}, f32);
    const float *op = o.data_ptr<float>(), *wn = o_norm.data_ptr<float>();
    float* yp = out.data_ptr<float>();
    for (int64_t h = 0; h < H; ++h)                        // rms_norm(o, o_norm) * sigmoid(gate)
        norm_row(op + h * Dk, yp + h * Dk, wn, Dk, rms_eps);
    for (int64_t i = 0; i < HD; ++i) yp[i] *= sg[i];
    return out;
}

at::Tensor conv_step_(const at::Tensor& x, const at::Tensor& w, at::Tensor& window) {
    check_f32(x, "conv_step_", "x");
    check_f32(w, "conv_step_", "the conv weight");
    check_f32(window, "conv_step_", "the conv window");
    TORCH_CHECK(w.dim() == 2 && w.size(1) >= 1, "expertfs mix ops: conv_step_ needs w [C, K]");
    const int64_t C = w.size(0), K = w.size(1);
    TORCH_CHECK(x.numel() == C && window.dim() == 2 && window.size(0) == C &&
                window.size(1) == K - 1, "expertfs mix ops: conv_step_ needs x of ", C,
                " values and a window [", C, ", ", K - 1, "]");
    at::Tensor y = at::empty({1, C}, x.options());
    float* yp = y.data_ptr<float>();
    conv_rows(x.data_ptr<float>(), w.data_ptr<float>(), window.data_ptr<float>(), yp, C, K);
    act_(yp, C, true);
    return y;
}

}  // namespace efs
