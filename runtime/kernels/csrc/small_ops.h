// Row-wise operations of a decode step done in one native call each (small_ops.cpp): in a
// forward pass that streams hundreds of MB of weights per token, each torch op on a few KB
// runs with cold caches (an RMSNorm of 7 ops measured several times slower after a weight
// product than in a warm loop; see bench/README.md), and a decode step has ~90 of them per
// layer.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <tuple>

namespace efs {

// y = x * rsqrt(mean(x^2) + eps) [* w] over the last dim of a contiguous float32 x.
at::Tensor rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& w, double eps);

// In place on contiguous float32 x [T, H, D]: optionally RMSNorm each head (weights w [D]),
// then rotate its first n_rot dims by position t's angles (cos/sin rows of n_rot/2 floats,
// `tstride` floats apart): NEOX pairs (i, i + n_rot/2), NORM pairs (2i, 2i + 1).
void norm_rope_(at::Tensor& x, const c10::optional<at::Tensor>& w, double eps, bool norm,
                const at::Tensor& cos, const at::Tensor& sin, int64_t n_rot, bool neox);

// One token's attention (decode): writes k [1, K, D] and v [1, K, Dv] at position p0 of the
// caches kc [K, cap, D] and vc [K, cap, Dv], then for each of the H heads of q [1, H, D]
// (query head h reads KV head h / (H / K)) returns softmax(q kᵀ · scale) v over positions
// 0..p0 as [1, H * Dv]. Keys and values are read where they lie: no copy per query head.
at::Tensor attn_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       at::Tensor& kc, at::Tensor& vc, int64_t p0, double scale);

// One token's expert choice, as runtime/model/router.py: logits = W x (W [E, D], x [1, D]);
// probs = softmax or sigmoid (`sigmoid`); sel = probs (+ bias [E] when given, for the choice
// only); with n_group > 1 groups of E / n_group experts, each scored by its two best sel
// summed, only the n_group_used best groups' experts stay (ties to the lower group); the top
// k of sel, best first, ties to the lower id; weights = probs of those, divided by their sum
// (clamped at w_min) when `norm_w`, times `w_scale`. Returns (ids [1, k] int64, weights
// [1, k] float32).
std::tuple<at::Tensor, at::Tensor> route(const at::Tensor& x, const at::Tensor& W,
                                         const c10::optional<at::Tensor>& bias, int64_t k,
                                         bool sigmoid, bool norm_w, double w_min,
                                         double w_scale, int64_t n_group, int64_t n_group_used);

// One token of the gated delta rule (runtime/model/kda.py, delta_rule_step), in place on the
// state S [H, Dk, Dv]: per head, with e = exp g, kv = (k e)ᵀS, d = beta (v - kv),
// o = (q e)ᵀS + (q·k) d, S <- e S + k dᵀ; q, k, g [H, Dk], v [H, Dv], beta [H]. Returns o
// [H, Dv]. One read and one write of S from memory, where the torch ops make three reads.
at::Tensor kda_step_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& g, const at::Tensor& beta, at::Tensor& S);

// mHC's Sinkhorn (runtime/model/mhc.py, sinkhorn) in place on logits [..., n, n]: row softmax
// + eps, a column normalisation, then iters - 1 rounds of row and column normalisation, each
// sum + eps. One call where the torch ops are ~6 per round, each costing more than its work.
void sinkhorn_(at::Tensor& c, int64_t iters, double eps);

// mHC (runtime/model/mhc.py) around a block, one token, float32 (mix_ops.cpp). hc_pre:
// streams [1, n, D] → (x [1, D], post [1, n], comb [1, n, n]): m = base + (fn · RMSNorm(flat
// streams)) * scales (fn [(2 + n) n, n D]); pre = sigmoid(m) + eps and post = 2 sigmoid(m) over
// the first two n mixes; comb = Sinkhorn of the last n n; x = sum_i pre_i stream_i. hc_post:
// out_j = post_j y + sum_i comb[i, j] stream_i, [1, n, D]. Sums in float32 in their own order
// (the mixing product rows_dot's), within float rounding of the torch ops they replace.
std::tuple<at::Tensor, at::Tensor, at::Tensor> hc_pre(const at::Tensor& streams,
                                                      const at::Tensor& fn, const at::Tensor& base,
                                                      const at::Tensor& scales, int64_t iters,
                                                      double eps, double rms_eps);
at::Tensor hc_post(const at::Tensor& y, const at::Tensor& streams, const at::Tensor& post,
                   const at::Tensor& comb);

// One token of KDA's causal depthwise conv + SiLU (runtime/model/kda.py, short_conv): x [C]
// (numel), w [C, K], the window [C, K - 1] of the last K - 1 inputs, shifted in place to take
// x. Returns [1, C] = silu(sum_j window[c, j] w[c, j] + x[c] w[c, K - 1]).
at::Tensor conv_step_(const at::Tensor& x, const at::Tensor& w, at::Tensor& window);

// One token of a KDA layer after its short conv (runtime/model/kda.py, kda_attention), the
// state S [H, Dk, Dk] advanced in place: q, k, v of qkv [3 H Dk] L2-normed per head (q also by
// Dk^-1/2, l2_eps inside the square root); the decay g = lb sigmoid(-a[h] (f + dt_bias)), or
// a[h] softplus(f + dt_bias) when has_lb is false; beta = sigmoid(beta); the delta-rule step
// (kda_step_); then each head's output RMSNormed (o_norm [Dk], rms_eps) and times
// sigmoid(gate). f, gate [H Dk], beta, a [H], dt_bias [H Dk]. Returns [1, H Dk].
at::Tensor kda_token_(const at::Tensor& qkv, const at::Tensor& f, const at::Tensor& gate,
                      const at::Tensor& beta, const at::Tensor& dt_bias, const at::Tensor& a,
                      bool has_lb, double lb, const at::Tensor& o_norm, double rms_eps,
                      double l2_eps, at::Tensor& S);

// out[e] = W[e] . x for the E rows of W [E, D] (float32, 8 partial sums a row), in chunks of
// rows over the pool where W is large (small_ops.cpp; the caller releases the GIL).
void rows_dot(const float* W, const float* x, float* out, int64_t E, int64_t D);

// y = x * rsqrt(mean(x^2) + eps) [* w] over d floats (rms_norm's row; the square sum in
// double); y may be x.
void norm_row(const float* x, float* y, const float* w, int64_t d, double eps);

// The shared argument check: t a contiguous float32 CPU tensor, else an error naming the
// operation and the argument.
void check_f32(const at::Tensor& t, const char* op, const char* what);

// Runs fn(ctx, c) for c in [0, n) on the kernels' pool (ops.cpp).
void run_parallel(int64_t n, void (*fn)(void*, int64_t), void* ctx);

// Whether the kernels run at the AVX2 (+FMA, F16C) tier or above now (ops.cpp; set_isa
// lowers it, so tests reach the portable code too).
bool isa_avx2();

}  // namespace efs
