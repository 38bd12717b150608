// The decode step's row-wise operations (see small_ops.h), with the numerics of the torch
// code they replace (runtime/model/rope.py, attention.py, router.py): RMSNorm scales x by a
// float32 rsqrt of the mean square (summed here in double, torch sums in float32: the two
// agree within float rounding) and then multiplies by the weight; the rotation computes
// a*cos - b*sin and b*cos + a*sin with each product rounded (the build has -ffp-contract=off),
// as torch's elementwise ops do; attention and the router's product sum in float32 in their
// own order (FMAs in the AVX2 attention path), within float rounding of torch's.
#include "small_ops.h"

#include "kern.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace efs {

void norm_row(const float* x, float* y, const float* w, int64_t d, double eps) {
    double s = 0.0;
    for (int64_t i = 0; i < d; ++i) s += (double)x[i] * (double)x[i];
    const float mean = (float)(s / (double)d);
    const float r = 1.0f / std::sqrt(mean + (float)eps);
    if (w) {
        for (int64_t i = 0; i < d; ++i) y[i] = (x[i] * r) * w[i];
    } else {
        for (int64_t i = 0; i < d; ++i) y[i] = x[i] * r;
    }
}

void check_f32(const at::Tensor& t, const char* op, const char* what) {
    TORCH_CHECK(t.is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(),
                "expertfs kernels: ", op, " needs ", what, " as a contiguous float32 CPU tensor");
}

namespace {

const float* weight_of(const c10::optional<at::Tensor>& w, int64_t d) {
    if (!w.has_value() || !w->defined()) return nullptr;
    TORCH_CHECK(w->is_cpu() && w->scalar_type() == at::kFloat && w->is_contiguous() &&
                w->numel() == d, "expertfs small ops: norm weight must be ", d,
                " contiguous float32 values on the CPU");
    return w->data_ptr<float>();
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& w, double eps) {
    TORCH_CHECK(x.is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() >= 1,
                "expertfs small ops: rms_norm takes a contiguous float32 CPU tensor");
    const int64_t d = x.size(-1);
    const float* wp = weight_of(w, d);
    at::Tensor y = at::empty_like(x);
    const float* xp = x.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const int64_t rows = d ? x.numel() / d : 0;
    for (int64_t r = 0; r < rows; ++r) norm_row(xp + r * d, yp + r * d, wp, d, eps);
    return y;
}

void norm_rope_(at::Tensor& x, const c10::optional<at::Tensor>& w, double eps, bool norm,
                const at::Tensor& cos, const at::Tensor& sin, int64_t n_rot, bool neox) {
    TORCH_CHECK(x.is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 3,
                "expertfs small ops: norm_rope_ takes a contiguous float32 CPU [T, H, D] tensor");
    const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = n_rot / 2;
    TORCH_CHECK(n_rot % 2 == 0 && n_rot <= D, "expertfs small ops: n_rot ", n_rot,
                " must be even and at most the head size ", D);
    for (const at::Tensor* t : {&cos, &sin})
        TORCH_CHECK(t->is_cpu() && t->scalar_type() == at::kFloat && t->size(0) == T &&
                    t->size(-1) == half && t->stride(-1) == 1,
                    "expertfs small ops: cos/sin must be float32 CPU rows of n_rot/2 per token");
    TORCH_CHECK(cos.stride(0) == sin.stride(0), "expertfs small ops: cos/sin strides differ");
    const float* wp = norm ? weight_of(w, D) : nullptr;
    const int64_t ts = cos.stride(0);
    float* xp = x.data_ptr<float>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t) {
        const float* c = cp + t * ts;
        const float* s = sp + t * ts;
        for (int64_t h = 0; h < H; ++h) {
            float* v = xp + (t * H + h) * D;
            if (norm) norm_row(v, v, wp, D, eps);
            if (neox) {
                for (int64_t i = 0; i < half; ++i) {
                    const float a = v[i], b = v[i + half];
                    v[i] = a * c[i] - b * s[i];
                    v[i + half] = b * c[i] + a * s[i];
                }
            } else {
                for (int64_t i = 0; i < half; ++i) {
                    const float a = v[2 * i], b = v[2 * i + 1];
                    v[2 * i] = a * c[i] - b * s[i];
                    v[2 * i + 1] = b * c[i] + a * s[i];
                }
            }
        }
    }
}

namespace {

// Eight independent partial sums, so the compiler vectorizes without reassociating.
inline __attribute__((always_inline)) float dot8(const float* a, const float* b, int64_t n) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; ++i) s += a[i] * b[i];
    return s;
}

inline __attribute__((always_inline)) void axpy(float* y, float a, const float* x, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

struct AttnJob {
    AttnArgs a;
    int64_t heads_per_chunk;
};

// A task: a few heads. With AVX2+FMA the kernels' unit does it (kern_avx2.cpp); the portable
// path goes one head after another, positions inner.
void attn_heads(void* ctx, int64_t chunk) {
    const AttnJob& J = *static_cast<const AttnJob*>(ctx);
    const AttnArgs& A = J.a;
    std::vector<float> p((size_t)A.S);
    const int64_t h0 = chunk * J.heads_per_chunk, h1 = std::min(A.H, h0 + J.heads_per_chunk);
    if (isa_avx2()) {
        avx2_attn_heads(A, h0, h1, p.data());
        return;
    }
    const int64_t group = A.H / A.K;
    for (int64_t h = h0; h < h1; ++h) {
        const int64_t g = h / group;
        const float* qh = A.q + h * A.D;
        const float* kg = A.kc + g * A.cap * A.D;
        const float* vg = A.vc + g * A.cap * A.Dv;
        float m = -INFINITY;
        for (int64_t j = 0; j < A.S; ++j) {
            p[j] = dot8(qh, kg + j * A.D, A.D) * A.scale;
            m = std::max(m, p[j]);
        }
        float sum = 0.0f;
        for (int64_t j = 0; j < A.S; ++j) {
            p[j] = std::exp(p[j] - m);
            sum += p[j];
        }
        float* oh = A.o + h * A.Dv;
        std::memset(oh, 0, sizeof(float) * A.Dv);
        const float inv = 1.0f / sum;
        for (int64_t j = 0; j < A.S; ++j) axpy(oh, p[j] * inv, vg + j * A.Dv, A.Dv);
    }
}

#if defined(__x86_64__) || defined(__i386__)
__attribute__((target_clones("avx2", "default")))   // 8-wide on AVX2 CPUs, chosen at load
#endif
void logits_rows(const float* W, const float* x, float* out, int64_t E, int64_t D) {
    for (int64_t e = 0; e < E; ++e) out[e] = dot8(W + e * D, x, D);
}

// rows_dot (the router's logits, mHC's mixes) in chunks of rows over the pool (a router matrix of 288 x 4096 floats is
// 4.7 MB, more than one core reads at its best), each row's dot product as logits_rows's.
struct LogitsJob {
    const float *W, *x;
    float* out;
    int64_t E, D, per;
};
void logits_chunk(void* ctx, int64_t c) {
    const LogitsJob& J = *static_cast<const LogitsJob*>(ctx);
    const int64_t e0 = c * J.per, e1 = std::min(J.E, e0 + J.per);
    if (e0 < e1) logits_rows(J.W + e0 * J.D, J.x, J.out + e0, e1 - e0, J.D);
}

struct KDAJob {
    const float *q, *k, *v, *g, *beta;
    float *S, *o;
    float* scratch;            // Dk + 2 Dv floats per head: e, kv, d
    int64_t Dk, Dv;
};

// One head of kda_step_: the products with S in one pass, the update in a second (the head's
// Dk x Dv state is then in cache), each row of S axpy'd in order.
#if defined(__x86_64__) || defined(__i386__)
__attribute__((target_clones("avx2", "default")))
#endif
void kda_head(void* ctx, int64_t h) {
    const KDAJob& J = *static_cast<const KDAJob*>(ctx);
    const int64_t Dk = J.Dk, Dv = J.Dv;
    const float *q = J.q + h * Dk, *k = J.k + h * Dk, *g = J.g + h * Dk, *v = J.v + h * Dv;
    float* S = J.S + h * Dk * Dv;
    float* o = J.o + h * Dv;
    float* e = J.scratch + h * (Dk + 2 * Dv);
    float* kv = e + Dk;
    float* d = kv + Dv;
    std::memset(kv, 0, sizeof(float) * Dv);
    float qk = 0.0f;
    for (int64_t i = 0; i < Dk; ++i) {
        e[i] = std::exp(g[i]);
        qk += q[i] * k[i];
    }
    std::memset(o, 0, sizeof(float) * Dv);
    for (int64_t i = 0; i < Dk; ++i) {
        const float ke = k[i] * e[i], qe = q[i] * e[i];
        const float* row = S + i * Dv;
        for (int64_t j = 0; j < Dv; ++j) {
            kv[j] += ke * row[j];
            o[j] += qe * row[j];
        }
    }
    const float b = J.beta[h];
    for (int64_t j = 0; j < Dv; ++j) {
        d[j] = (v[j] - kv[j]) * b;
        o[j] += qk * d[j];
    }
    for (int64_t i = 0; i < Dk; ++i) {
        const float ei = e[i], ki = k[i];
        float* row = S + i * Dv;
        for (int64_t j = 0; j < Dv; ++j) row[j] = row[j] * ei + ki * d[j];
    }
}

}  // namespace

void rows_dot(const float* W, const float* x, float* out, int64_t E, int64_t D) {
    // one chunk where the matrix is small (the pool's wake-up would cost more)
    const int64_t chunks = E * D < (1 << 18) ? 1 : 4;
    LogitsJob job{W, x, out, E, D, (E + chunks - 1) / chunks};
    run_parallel(chunks, logits_chunk, &job);
}

std::tuple<at::Tensor, at::Tensor> route(const at::Tensor& x, const at::Tensor& W,
                                         const c10::optional<at::Tensor>& bias, int64_t k,
                                         bool sigmoid, bool norm_w, double w_min,
                                         double w_scale, int64_t n_group, int64_t n_group_used) {
    check_f32(x, "route", "x");
    check_f32(W, "route", "the router weight");
    const int64_t E = W.size(0), D = W.size(1);
    TORCH_CHECK(W.dim() == 2 && x.numel() == D && k >= 1 && k <= E,
                "expertfs small ops: route takes x [1, D], W [E, D] and 1 <= k <= E");
    const int64_t G = std::max<int64_t>(1, n_group);
    TORCH_CHECK(E % G == 0 && (G == 1 || (E / G >= 2 && n_group_used >= 1 &&
                n_group_used <= G && k <= n_group_used * (E / G))),
                "expertfs small ops: route's groups must split E evenly, at least 2 experts "
                "each, and keep room for k");
    const float* bp = weight_of(bias, E);
    std::vector<float> probs((size_t)E), sel((size_t)E);
    {
        pybind11::gil_scoped_release nogil;
        rows_dot(W.data_ptr<float>(), x.data_ptr<float>(), probs.data(), E, D);
    }
    if (sigmoid) {
        for (int64_t e = 0; e < E; ++e) probs[e] = 1.0f / (1.0f + std::exp(-probs[e]));
    } else {
        float m = -INFINITY, sum = 0.0f;
        for (int64_t e = 0; e < E; ++e) m = std::max(m, probs[e]);
        for (int64_t e = 0; e < E; ++e) sum += (probs[e] = std::exp(probs[e] - m));
        for (int64_t e = 0; e < E; ++e) probs[e] /= sum;
    }
    for (int64_t e = 0; e < E; ++e) sel[e] = bp ? probs[e] + bp[e] : probs[e];
    if (G > 1) {        // a group's score: its two best sel summed; the best n_group_used stay
        const int64_t per = E / G;
        std::vector<float> score((size_t)G);
        for (int64_t g = 0; g < G; ++g) {
            float a = -INFINITY, b = -INFINITY;
            for (int64_t e = g * per; e < (g + 1) * per; ++e) {
                if (sel[e] > a) {
                    b = a;
                    a = sel[e];
                } else if (sel[e] > b) {
                    b = sel[e];
                }
            }
            score[g] = a + b;
        }
        std::vector<int64_t> groups((size_t)G);
        for (int64_t g = 0; g < G; ++g) groups[g] = g;
        std::partial_sort(groups.begin(), groups.begin() + n_group_used, groups.end(),
                          [&](int64_t a, int64_t b) {
                              return score[a] > score[b] || (score[a] == score[b] && a < b);
                          });
        std::vector<char> keep((size_t)G, 0);
        for (int64_t j = 0; j < n_group_used; ++j) keep[groups[j]] = 1;
        for (int64_t e = 0; e < E; ++e)
            if (!keep[e / per]) sel[e] = -INFINITY;
    }
    std::vector<int64_t> order((size_t)E);
    for (int64_t e = 0; e < E; ++e) order[e] = e;
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t a, int64_t b) {
        return sel[a] > sel[b] || (sel[a] == sel[b] && a < b);
    });
    at::Tensor ids = at::empty({1, k}, x.options().dtype(at::kLong));
    at::Tensor wts = at::empty({1, k}, x.options());
    int64_t* ip = ids.data_ptr<int64_t>();
    float* wp = wts.data_ptr<float>();
    float total = 0.0f;
    for (int64_t j = 0; j < k; ++j) {
        ip[j] = order[j];
        total += (wp[j] = probs[order[j]]);
    }
    const float div = std::max(total, (float)w_min);
    for (int64_t j = 0; j < k; ++j) {
        if (norm_w) wp[j] /= div;
        if (w_scale != 1.0) wp[j] *= (float)w_scale;
    }
    return {ids, wts};
}

at::Tensor attn_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       at::Tensor& kc, at::Tensor& vc, int64_t p0, double scale) {
    check_f32(q, "attn_decode", "q");
    check_f32(k, "attn_decode", "k");
    check_f32(v, "attn_decode", "v");
    check_f32(kc, "attn_decode", "the key cache");
    check_f32(vc, "attn_decode", "the value cache");
    TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && q.size(0) == 1 &&
                k.size(0) == 1 && v.size(0) == 1, "expertfs small ops: attn_decode takes one "
                "token: q [1, H, D], k [1, K, D], v [1, K, Dv]");
    const int64_t H = q.size(1), D = q.size(2), K = k.size(1), Dv = v.size(2);
    TORCH_CHECK(K > 0 && H % K == 0 && k.size(2) == D && v.size(1) == K,
                "expertfs small ops: attn_decode head counts or sizes do not match");
    TORCH_CHECK(kc.dim() == 3 && vc.dim() == 3 && kc.size(0) == K && vc.size(0) == K &&
                kc.size(2) == D && vc.size(2) == Dv && kc.size(1) == vc.size(1) &&
                p0 >= 0 && p0 < kc.size(1), "expertfs small ops: attn_decode caches must be "
                "[K, cap, D] and [K, cap, Dv] with room for position ", p0);
    const int64_t cap = kc.size(1), S = p0 + 1;
    float* kcp = kc.data_ptr<float>();
    float* vcp = vc.data_ptr<float>();
    for (int64_t g = 0; g < K; ++g) {
        std::memcpy(kcp + (g * cap + p0) * D, k.data_ptr<float>() + g * D, sizeof(float) * D);
        std::memcpy(vcp + (g * cap + p0) * Dv, v.data_ptr<float>() + g * Dv, sizeof(float) * Dv);
    }
    at::Tensor o = at::empty({1, H * Dv}, q.options());
    // a chunk of heads per task; one task when the whole job is small (pool wake-up > work)
    const int64_t work = H * S * (D + Dv);
    const int64_t chunks = work < (1 << 16) ? 1 : std::min<int64_t>(H, 8);
    AttnJob job{{q.data_ptr<float>(), kcp, vcp, o.data_ptr<float>(), H, K, D, Dv, cap, S,
                 (float)scale}, (H + chunks - 1) / chunks};
    {
        pybind11::gil_scoped_release nogil;
        run_parallel(chunks, attn_heads, &job);
    }
    return o;
}

at::Tensor kda_step_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& g, const at::Tensor& beta, at::Tensor& S) {
    check_f32(q, "kda_step_", "q");
    check_f32(k, "kda_step_", "k");
    check_f32(v, "kda_step_", "v");
    check_f32(g, "kda_step_", "g");
    check_f32(beta, "kda_step_", "beta");
    check_f32(S, "kda_step_", "the state");
    TORCH_CHECK(S.dim() == 3, "expertfs small ops: kda_step_ state must be [H, Dk, Dv]");
    const int64_t H = S.size(0), Dk = S.size(1), Dv = S.size(2);
    TORCH_CHECK(q.numel() == H * Dk && k.numel() == H * Dk && g.numel() == H * Dk &&
                v.numel() == H * Dv && beta.numel() == H,
                "expertfs small ops: kda_step_ takes one token: q, k, g [H, Dk], v [H, Dv], "
                "beta [H] for a state [H, Dk, Dv]");
    at::Tensor o = at::empty({H, Dv}, S.options());
    std::vector<float> scratch((size_t)(H * (Dk + 2 * Dv)));      // one allocation per call
    KDAJob job{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
               g.data_ptr<float>(), beta.data_ptr<float>(), S.data_ptr<float>(),
               o.data_ptr<float>(), scratch.data(), Dk, Dv};
    {
        pybind11::gil_scoped_release nogil;
        run_parallel(H, kda_head, &job);
    }
    return o;
}

void sinkhorn_(at::Tensor& c, int64_t iters, double eps) {
    TORCH_CHECK(c.is_cpu() && c.scalar_type() == at::kFloat && c.is_contiguous() && c.dim() >= 2 &&
                c.size(-1) == c.size(-2),
                "expertfs small ops: sinkhorn_ needs contiguous float32 CPU [..., n, n]");
    const int64_t n = c.size(-1), B = n ? c.numel() / (n * n) : 0;
    const float e = (float)eps;
    float* p = c.data_ptr<float>();
    std::vector<float> s((size_t)n);
    const auto cols = [&](float* m) {           // each column / (its sum + eps)
        std::fill(s.begin(), s.end(), 0.0f);
        for (int64_t i = 0; i < n; ++i)
            for (int64_t j = 0; j < n; ++j) s[j] += m[i * n + j];
        for (int64_t j = 0; j < n; ++j) s[j] += e;
        for (int64_t i = 0; i < n; ++i)
            for (int64_t j = 0; j < n; ++j) m[i * n + j] /= s[j];
    };
    for (int64_t b = 0; b < B; ++b) {
        float* m = p + b * n * n;
        for (int64_t i = 0; i < n; ++i) {       // row softmax + eps
            float* r = m + i * n;
            const float mx = *std::max_element(r, r + n);
            float sum = 0.0f;
            for (int64_t j = 0; j < n; ++j) sum += (r[j] = std::exp(r[j] - mx));
            for (int64_t j = 0; j < n; ++j) r[j] = r[j] / sum + e;
        }
        cols(m);
        for (int64_t it = 1; it < iters; ++it) {
            for (int64_t i = 0; i < n; ++i) {   // each row / (its sum + eps)
                float* r = m + i * n;
                float sum = 0.0f;
                for (int64_t j = 0; j < n; ++j) sum += r[j];
                sum += e;
                for (int64_t j = 0; j < n; ++j) r[j] /= sum;
            }
            cols(m);
        }
    }
}

}  // namespace efs
