// Torch binding of the native kernels: activation preparation, the parallel row drivers and
// the one-call MoE layer (all selected experts' gate+up, SiLU*up, and the weighted down sum).
//
// Threads: the kernels' own pool (pool.h), as many threads as torch.get_num_threads(), row
// chunks pulled from an atomic counter; the caller never waits for a worker that has not
// claimed work (robust on shared, oversubscribed CPUs, where torch's OpenMP barriers were
// slower with 2 threads than 1). Every output row is computed by one thread in a fixed order,
// so results do not depend on the thread count. The GIL is released while computing.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <pthread.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/silu.h>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "kern.h"
#include "pool.h"
#include "small_ops.h"
#include "avx512_emulated.h"     // EFS_CPU_HAS_512

namespace efs {
namespace {

// ISA tiers: each uses its own kernels where it has them and the tier below otherwise.
enum Isa { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };

int detect_isa() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (avx2_compiled() && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c")) {
        if (avx512_compiled() && EFS_CPU_HAS_512("avx512f") &&
            EFS_CPU_HAS_512("avx512vl"))
            return ISA_AVX512;
        return ISA_AVX2;
    }
#endif
    return ISA_SCALAR;
}

const int g_best = detect_isa();
int g_isa = g_best;

// The IQ types' AVX-512 unit also needs AVX512BW (byte and word lanes).
bool detect_bw() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    return g_best >= ISA_AVX512 && EFS_CPU_HAS_512("avx512bw");
#else
    return false;
#endif
}
const bool g_bw = detect_bw();

// q8 mode's panel product needs AVX512-VNNI (vpdpbusd); not in the emulated build.
bool detect_vnni() {
#if (defined(__x86_64__) || defined(__i386__)) && !defined(EFS_EMULATE_AVX512)
    __builtin_cpu_init();
    return g_bw && __builtin_cpu_supports("avx512vnni");
#else
    return false;
#endif
}
const bool g_vnni = detect_vnni();

// ... or, at the AVX2 tier, AVX-VNNI (the same product in 256-bit vectors).
bool detect_avxvnni() {
#if (defined(__x86_64__) || defined(__i386__)) && !defined(EFS_EMULATE_AVX512) && \
    EFS_AVXVNNI_TARGET
    __builtin_cpu_init();
    return g_best >= ISA_AVX2 && __builtin_cpu_supports("avxvnni");
#else
    return false;
#endif
}
const bool g_avxvnni = detect_avxvnni();

// Exact mode's panel product on AMX where the CPU has it and the OS grants the tile state (not
// in the emulated build); g_amx_on: in use (set_amx).
bool detect_amx() {
#if (defined(__x86_64__) || defined(__i386__)) && !defined(EFS_EMULATE_AVX512)
    return g_bw && amx_enable();
#else
    return false;
#endif
}
const bool g_amx = detect_amx();
// EXPERTFS_AMX=0 leaves it off (the float panel's numerics and speed, for comparisons).
bool g_amx_on = g_amx && [] {
    const char* e = getenv("EXPERTFS_AMX");
    return !(e && strcmp(e, "0") == 0);
}();

// Exact Q6_K's AVX-512 kernel decodes by GFNI where the CPU has it (kern_k_avx512.cpp);
// g_gfni_on: in use (set_gfni: off runs the form for CPUs without it, for tests).
const bool g_gfni = g_bw && EFS_CPU_HAS_512("gfni");

RowsFn rows_fn(int type, int mode) {
    RowsFn f = g_isa >= ISA_AVX512 ? avx512_rows(type, mode) : nullptr;
    if (!f && g_isa >= ISA_AVX512 && g_bw) f = avx512_iq_rows(type, mode);
    if (!f && g_isa >= ISA_AVX2) f = avx2_rows(type, mode);
    return f ? f : scalar_rows(type, mode);
}

// The AVX-512 exact kernels' activation orders (kern.h exact_layouts): its bit, the columns it
// needs a multiple of, its permutation (from x, or from xp), its XPrep field and the fewest
// tokens of a batch its kernels read it for.
struct Order {
    int bit;
    int64_t chunk;
    void (*perm)(const float*, float*, int64_t);
    bool from_xp;
    const float* XPrep::*field;
    int min_tokens;
};
constexpr Order ORDERS[] = {{X_XZ, 128, perm128, false, &XPrep::xz, 1},
                            {X_XH, 128, perm_h64, true, &XPrep::xh, 1},
                            {X_XQ, 256, perm_q2, false, &XPrep::xq, 1},
                            {X_XI, 128, perm_iq4, false, &XPrep::xi, 1},
                            {X_XG, 256, perm_g32, false, &XPrep::xg, XG_FROM_TOKENS}};
constexpr int N_ORDERS = (int)(sizeof(ORDERS) / sizeof(ORDERS[0]));

// Prepared activations for `nt` vectors of `cols` floats in one format; owns its memory.
struct Prep {
    std::vector<float> f;
    std::vector<Q8K> q8k;
    std::vector<QX8> qx8;
    std::vector<XPrep> xs;

    // `layouts`: the exact_layouts bits of the types the activations will meet (exact mode
    // on AVX-512 builds only those).
    void make(const float* x, int64_t xstride, int nt, int64_t cols, int fmt, int layouts) {
        xs.assign(nt, XPrep{nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                            nullptr, nullptr, nullptr});
        if (fmt == X_EXACT) {
            // Per token [xp | the AVX-512 orders wanted (ORDERS) | s16 | s32], each token's
            // block and each order starting on a 64-byte boundary when cols % 32 == 0: a
            // 512-bit load of a vector that is not 64-byte aligned spans two cache lines.
            int64_t off[N_ORDERS], os = cols;
            for (int k = 0; k < N_ORDERS; ++k) {
                const Order& o = ORDERS[k];
                const bool on = g_isa >= ISA_AVX512 && cols % o.chunk == 0 &&
                                (layouts & o.bit) && nt >= o.min_tokens;
                off[k] = on ? os : -1;
                os += on ? cols : 0;
            }
            const int64_t per = (os + cols / 16 + cols / 32 + 15) / 16 * 16;
            f.resize((size_t)(per * nt + 16));
            float* f0 = f.data();
            f0 += (16 - ((uintptr_t)f0 / sizeof(float)) % 16) % 16;   // to the next 64 bytes
            for (int t = 0; t < nt; ++t) {
                const float* xt = x + t * xstride;
                float* base = f0 + t * per;
                float* sb = base + os;
                xs[t].x = xt;
                if (cols % 32 == 0) {
                    perm32(xt, base, cols);
                    xs[t].xp = base;
                }
                sums16(xt, sb, sb + cols / 16, cols);
                xs[t].s16 = sb;
                xs[t].s32 = sb + cols / 16;
                for (int k = 0; k < N_ORDERS; ++k) {
                    if (off[k] < 0) continue;
                    ORDERS[k].perm(ORDERS[k].from_xp ? base : xt, base + off[k], cols);
                    xs[t].*ORDERS[k].field = base + off[k];
                }
            }
        } else if (fmt == X_Q8K) {
            const int64_t nb = cols / 256;
            q8k.resize((size_t)(nb * nt));
            for (int t = 0; t < nt; ++t) {
                if (g_isa >= ISA_AVX2)
                    avx2_quantize_q8k(x + t * xstride, q8k.data() + t * nb, cols);
                else
                    quantize_q8k(x + t * xstride, q8k.data() + t * nb, cols);
                xs[t].q = q8k.data() + t * nb;
            }
        } else if (fmt == X_Q8_0 || fmt == X_Q8_1) {
            const int64_t nb = cols / 32;
            qx8.resize((size_t)(nb * nt));
            for (int t = 0; t < nt; ++t) {
                if (g_isa >= ISA_AVX2)
                    avx2_quantize_qx8(x + t * xstride, qx8.data() + t * nb, cols, fmt == X_Q8_1);
                else
                    quantize_qx8(x + t * xstride, qx8.data() + t * nb, cols, fmt == X_Q8_1);
                xs[t].q = qx8.data() + t * nb;
            }
        } else {                                        // X_F16R / X_BF16R
            f.resize((size_t)(cols * nt));
            for (int t = 0; t < nt; ++t) {
                float* o = f.data() + t * cols;
                if (fmt == X_F16R)
                    round_f16(x + t * xstride, o, cols);
                else
                    round_bf16(x + t * xstride, o, cols);
                xs[t].x = o;
            }
        }
    }
};

int act_format(int type, int mode) { return mode == 0 ? (int)X_EXACT : q8_format(type); }

// The kernels' worker pool (pool.h), sized from torch's thread count (torch.set_num_threads)
// and replaced when that changes; a caller holds its pool while using it. After fork() the
// child starts afresh: the parent's pool (whose threads do not exist in the child) is leaked
// and the lock re-made.
std::mutex g_pool_m;
std::shared_ptr<Pool> g_pool;
int64_t g_spin_us = 50;
int g_threads = 0;                      // 0: torch.get_num_threads()

void after_fork_child() {
    new (&g_pool_m) std::mutex();
    auto* leak = new std::shared_ptr<Pool>();
    leak->swap(g_pool);
}

std::shared_ptr<Pool> pool_for(int nth) {
    static const bool hooked = [] {
        pthread_atfork(nullptr, nullptr, after_fork_child);
        return true;
    }();
    (void)hooked;
    std::lock_guard<std::mutex> g(g_pool_m);
    if (!g_pool || g_pool->workers() != nth - 1) g_pool = std::make_shared<Pool>(nth - 1, g_spin_us);
    return g_pool;
}

// Runs f(chunk) for chunk in [0, n) on the calling thread and the pool's workers.
template <class F>
void par_chunks(int64_t n, const F& f) {
    const int nth = g_threads > 0 ? g_threads : at::get_num_threads();
    if (nth <= 1 || n <= 1) {
        for (int64_t c = 0; c < n; ++c) f(c);
        return;
    }
    pool_for(nth)->run(n, [](void* ctx, int64_t c) { (*static_cast<const F*>(ctx))(c); },
                       const_cast<void*>(static_cast<const void*>(&f)));
}

// Rows per chunk: a quarter of a thread's share, so each chunk streams a long contiguous run of
// rows (a chunk's start costs the hardware prefetcher and the kernels' software prefetch
// cursor their stream; chunks of ~64K weights, sized for the shared counter's cost, streamed
// and decoded measurably slower: bench/README.md, native kernels) while a delayed thread is
// still made up for (4 chunks per thread); an even count where there are rows for it (the
// several-token kernels take rows in pairs).
int64_t rows_per_chunk(int64_t rows) {
    const int64_t nth = g_threads > 0 ? g_threads : at::get_num_threads();
    int64_t r = rows / (4 * nth);
    if (r < 2) r = rows >= 2 ? 2 : 1;
    return r + (r & 1 && rows > r);
}

const TypeInfo* check_type(int64_t type, int64_t cols, int64_t mode) {
    const TypeInfo* ti = type_info((int)type);
    TORCH_CHECK(ti != nullptr, "expertfs kernels: unsupported ggml type ", type);
    TORCH_CHECK(mode == 0 || mode == 1, "expertfs kernels: mode must be 0 (exact) or 1 (q8)");
    TORCH_CHECK(cols > 0 && cols % ti->block == 0, "expertfs kernels: ", cols,
                " columns are not a whole number of blocks of ", ti->block);
    if (mode == 1 && q8_format((int)type) == X_Q8K)
        TORCH_CHECK(cols % 256 == 0, "expertfs kernels: q8 mode needs 256-element rows");
    return ti;
}

void check_raw(const at::Tensor& raw, int64_t rows, int64_t row_bytes, const char* what) {
    TORCH_CHECK(raw.device().is_cpu() && raw.scalar_type() == at::kByte && raw.is_contiguous(),
                "expertfs kernels: ", what, " must be a contiguous uint8 CPU tensor");
    TORCH_CHECK(raw.numel() == rows * row_bytes, "expertfs kernels: ", what, " has ",
                raw.numel(), " bytes, expected ", rows, " x ", row_bytes);
}

at::Tensor check_x(const at::Tensor& x, int64_t cols) {
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                x.size(1) == cols, "expertfs kernels: x must be a float32 CPU [T, ", cols, "]");
    return x.contiguous();
}

// y [nt, rows] = x [nt, cols] @ W.T with W ggml bytes (rows x rb), through the type's rows
// kernel on the pool; checked and the GIL released by the caller.
void matvec_into(const float* x, int nt, const uint8_t* W, int64_t rb, RowsFn fn, int type,
                 int64_t rows, int64_t cols, int64_t mode, float* yp) {
    Prep p;
    p.make(x, cols, nt, cols, act_format(type, (int)mode), exact_layouts(type));
    const int64_t rc = rows_per_chunk(rows);
    const XPrep* xs = p.xs.data();
    par_chunks((rows + rc - 1) / rc, [&](int64_t c) {
        const int64_t r0 = c * rc, r1 = r0 + rc < rows ? r0 + rc : rows;
        fn(W, rb, r0, r1, cols, xs, nt, yp, rows, 1.f, 0);
    });
}

// y [T, rows] = x [T, cols] @ W.T with W the ggml bytes `raw` (rows x row_bytes).
at::Tensor matvec(const at::Tensor& x_, const at::Tensor& raw, int64_t type, int64_t rows,
                  int64_t cols, int64_t mode) {
    const TypeInfo* ti = check_type(type, cols, mode);
    const int64_t rb = cols / ti->block * ti->bytes;
    check_raw(raw, rows, rb, "weight");
    const at::Tensor x = check_x(x_, cols);
    const int nt = (int)x.size(0);
    at::Tensor y = at::empty({nt, rows}, x.options());
    if (nt == 0 || rows == 0) return y;
    const RowsFn fn = rows_fn((int)type, (int)mode);
    TORCH_CHECK(fn != nullptr, "expertfs kernels: no kernel for type ", type);
    pybind11::gil_scoped_release nogil;
    matvec_into(x.data_ptr<float>(), nt, raw.data_ptr<uint8_t>(), rb, fn, (int)type, rows, cols,
                mode, y.data_ptr<float>());
    return y;
}

bool qgemm_available() { return g_isa >= ISA_AVX2 && qgemm_compiled(); }

// Rows a pool task of a panel product takes: runs of panels (`panel` rows each), at least 4
// per thread where the rows allow (a delayed thread is made up for), at most 8 panels (their
// sums stay in the L2 cache).
int64_t panel_run(int64_t rows, int64_t panel) {
    const int nth = g_threads > 0 ? g_threads : at::get_num_threads();
    int64_t per = (rows + panel - 1) / panel / (4 * nth);
    per = per < 1 ? 1 : per > 8 ? 8 : per;
    return per * panel;
}

// Whether exact mode's wide products run on AMX now: the CPU has it, it is on, the kernels run
// at the AVX-512 tier.
bool amx_in_use() { return g_isa >= ISA_AVX512 && g_amx_on; }

// The AMX product for `type` in rows of `cols` weights where it is in use, or nullptr.
QgemmAmxFn qgemm_amx_fn(int64_t type, int64_t cols) {
    return amx_in_use() ? amx_qgemm((int)type, cols) : nullptr;
}

// The AMX product into yp [nt, rows]: the tokens prepared once (a tile of 16 a pool task), then
// runs of 32-row panels on the pool.
void qgemm_amx_into(QgemmAmxFn fn, const float* xp, int64_t nt, const uint8_t* W, int64_t rb,
                    int64_t rows, int64_t cols, float* yp) {
    const int64_t tp = (nt + 15) / 16 * 16;
    std::unique_ptr<uint32_t[]> xb(new uint32_t[(size_t)(3 * tp * cols / 2)]);
    std::unique_ptr<float[]> xs(new float[(size_t)(cols / 16 * tp)]);
    par_chunks(tp / 16, [&](int64_t j) { amx_prepare(xp, nt, cols, j, xb.get(), xs.get()); });
    const int64_t run = panel_run(rows, 32);
    par_chunks((rows + run - 1) / run, [&](int64_t i) {
        const int64_t r0 = i * run, r1 = r0 + run < rows ? r0 + run : rows;
        fn(W, rb, r0, r1, xb.get(), xs.get(), nt, cols, yp, rows);
    });
}

// qgemm's product into yp [nt, rows] (the caller checks and releases the GIL): on AMX where
// there is a product for the type, else the float panel.
void qgemm_into(const float* xp, int64_t nt, const uint8_t* W, int64_t rb, int64_t type,
                int64_t rows, int64_t cols, float* yp) {
    if (const QgemmAmxFn amx = qgemm_amx_fn(type, cols))
        return qgemm_amx_into(amx, xp, nt, W, rb, rows, cols, yp);
    const bool z = g_isa >= ISA_AVX512;
    const int64_t lanes = z ? QGEMM_LANES_AVX512 : QGEMM_LANES_AVX2;
    const int64_t tp = (nt + lanes - 1) / lanes * lanes;
    std::unique_ptr<float[]> xt(new float[(size_t)(cols * tp)]);
    float* xtp = xt.get();
    for (int64_t k0 = 0; k0 < cols; k0 += 64) {             // a block of XT stays in L1
        const int64_t k1 = k0 + 64 < cols ? k0 + 64 : cols;
        for (int64_t k = k0; k < k1; ++k)
            for (int64_t t = nt; t < tp; ++t) xtp[k * tp + t] = 0.f;
        for (int64_t t = 0; t < nt; ++t)
            for (int64_t k = k0; k < k1; ++k) xtp[k * tp + t] = xp[t * cols + k];
    }
    const int64_t run = panel_run(rows, QGEMM_PANEL);
    par_chunks((rows + run - 1) / run, [&](int64_t i) {
        thread_local std::vector<float> panel, sums;
        const int64_t need = QGEMM_PANEL * qgemm_panel_stride(qgemm_kb(cols, tp));
        if ((int64_t)panel.size() < need) panel.resize(need);
        if ((int64_t)sums.size() < run * tp) sums.resize(run * tp);
        const int64_t r0 = i * run, r1 = r0 + run < rows ? r0 + run : rows;
        (z ? avx512_qgemm_rows : avx2_qgemm_rows)((int)type, W, rb, r0, r1, cols, xtp, tp, nt,
                                                  panel.data(), sums.data(), yp, rows);
    });
}

// q8 mode's panel product for `type` on this CPU at the ISA in use (AVX-512 VNNI, else
// AVX-VNNI at the AVX2 tier), or nullptr.
QgemmQ8Fn qgemm_q8_fn(int64_t type) {
    if (g_isa >= ISA_AVX512 && g_vnni) return avx512_qgemm_q8((int)type);
    return g_isa >= ISA_AVX2 && g_avxvnni ? avxvnni_qgemm_q8((int)type) : nullptr;
}

// ... and for a matrix of `cols` columns: whole panels of 256 weights, or for the blocks-of-32
// types under AVX-512 VNNI any multiple of 32 (a last panel of fewer blocks).
QgemmQ8Fn qgemm_q8_fn(int64_t type, int64_t cols) {
    if (cols % 256 == 0) return qgemm_q8_fn(type);
    const bool b32 = cols % 32 == 0 && q8_format((int)type) != X_Q8K;
    return b32 && g_isa >= ISA_AVX512 && g_vnni ? avx512_qgemm_q8((int)type) : nullptr;
}

// The q8 panel product into yp [nt, rows] (the caller checks, finds fn and releases the GIL):
// the tokens quantized to Q8_K as the q8 row kernels take them, then runs of 32-row panels on
// the pool.
void qgemm_q8_into(QgemmQ8Fn fn, int64_t type, const float* xp, int64_t nt, const uint8_t* W,
                   int64_t rb, int64_t rows, int64_t cols, float* yp) {
    Prep p;
    const int fmt = q8_format((int)type);
    p.make(xp, cols, (int)nt, cols, fmt, 0);
    const void* x = fmt == X_Q8K ? (const void*)p.q8k.data() : (const void*)p.qx8.data();
    std::vector<int32_t> xsum;                  // blocks of 32: each block's sum of its bytes
    if (fmt != X_Q8K) {
        xsum.resize(p.qx8.size());
        for (size_t b = 0; b < xsum.size(); ++b) {
            int32_t sum = 0;
            for (int k = 0; k < 32; ++k) sum += p.qx8[b].qs[k];
            xsum[b] = sum;
        }
    }
    const int64_t run = panel_run(rows, 32);
    par_chunks((rows + run - 1) / run, [&](int64_t i) {
        thread_local std::vector<float> c;
        if ((int64_t)c.size() < 32 * nt) c.resize(32 * nt);
        const int64_t r0 = i * run, r1 = r0 + run < rows ? r0 + run : rows;
        fn(W, rb, r0, r1, x, xsum.data(), nt, cols, c.data(), yp, rows);
    });
}

// A wide product into yp [nt, rows] (the caller checks and releases the GIL): in q8 mode
// (`mode` 1) through the integer panel product where this CPU, type and row length have one,
// else through the exact panel product.
void wide_into(const float* xp, int64_t nt, const uint8_t* W, int64_t rb, int64_t type,
               int64_t rows, int64_t cols, int64_t mode, float* yp) {
    const QgemmQ8Fn q8 = mode == 1 ? qgemm_q8_fn(type, cols) : nullptr;
    if (q8)
        qgemm_q8_into(q8, type, xp, nt, W, rb, rows, cols, yp);
    else
        qgemm_into(xp, nt, W, rb, type, rows, cols, yp);
}

// y[T, rows] = x[T, cols] @ W.T for many tokens: each panel of rows decoded once into this
// thread's scratch, then multiplied by every token (wide_into: qgemm.cpp's float panel in exact
// mode's numerics, the dequantized floats and float32 sums; in q8 mode qgemm_q8.cpp's integer
// panel where there is one). Undefined under the portable kernels (no AVX2): the caller takes
// the wide path.
at::Tensor qgemm(const at::Tensor& x_, const at::Tensor& raw, int64_t type, int64_t rows,
                 int64_t cols, int64_t mode) {
    if (!qgemm_available()) return at::Tensor();
    const TypeInfo* ti = check_type(type, cols, 0);
    const int64_t rb = cols / ti->block * ti->bytes;
    check_raw(raw, rows, rb, "weight");
    const at::Tensor x = check_x(x_, cols);
    const int64_t nt = x.size(0);
    at::Tensor y = at::empty({nt, rows}, x.options());
    if (nt == 0 || rows == 0) return y;
    pybind11::gil_scoped_release nogil;
    wide_into(x.data_ptr<float>(), nt, raw.data_ptr<uint8_t>(), rb, type, rows, cols, mode,
              y.data_ptr<float>());
    return y;
}

// The two phases of one decode step through n experts, shared by moe, moe_hidden and
// moe_down_rows / moe_combine so that a layer computed in parts (resident experts while the
// others load) gives bit-identical results to one call.

// An expert's bias rows (gpt-oss's ffn_{gate,up,down}_exps.bias): one float32 pointer per
// expert, or none at all.
using Biases = std::vector<const float*>;

static void add_bias(float* y, const float* b, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) y[r] = y[r] + b[r];
}

// Phase 1: h[e] = silu(gate_e x) * up_e x, written into h (n * ff floats); limit > 0:
// llama.cpp's swiglu_clamp, silu(min(gate, limit)) * clamp(up, -limit, limit); alpha > 0:
// gpt-oss's swiglu_oai (silu_mul). Bias rows bg/bu (empty: none) are added to the products
// before the activation. Rows are independent, so the result does not depend on which
// experts share the call.
void hidden_phase(const float* xp, int64_t D, int64_t n, int64_t ff,
                  const std::vector<const uint8_t*>& G, const std::vector<const uint8_t*>& U,
                  int64_t rbg, int64_t rbu, int64_t tg, int64_t tu, int64_t mode, float* h,
                  float limit, float alpha = 0.f, const Biases& bg = {},
                  const Biases& bu = {}) {
    const RowsFn fg = rows_fn((int)tg, (int)mode), fu = rows_fn((int)tu, (int)mode);
    TORCH_CHECK(fg && fu, "expertfs kernels: no kernel for these types");
    pybind11::gil_scoped_release nogil;
    Prep px, pxu;
    const int fmt_g = act_format((int)tg, (int)mode), fmt_u = act_format((int)tu, (int)mode);
    const int lg = exact_layouts((int)tg), lu = exact_layouts((int)tu);
    px.make(xp, D, 1, D, fmt_g, fmt_u == fmt_g ? lg | lu : lg);
    const XPrep* xg = px.xs.data();
    const XPrep* xu = xg;
    if (fmt_u != fmt_g) {
        pxu.make(xp, D, 1, D, fmt_u, lu);
        xu = pxu.xs.data();
    }
    std::vector<float> u((size_t)(n * ff));
    // Chunks start at multiples of 8 rows of an expert: the SiLU's vector / scalar split of a
    // row (8 at a time, then a tail) then depends on the row alone, not on which experts
    // share the call (which sets the chunk size).
    const int64_t rc = (rows_per_chunk(n * ff) + 7) / 8 * 8;
    const int64_t per_e = (ff + rc - 1) / rc;
    par_chunks(n * per_e, [&](int64_t c) {
        const int64_t e = c / per_e, r0 = (c % per_e) * rc;
        const int64_t r1 = r0 + rc < ff ? r0 + rc : ff;
        float* ge = h + e * ff;
        float* ue = u.data() + e * ff;
        fg(G[e], rbg, r0, r1, D, xg, 1, ge, 0, 1.f, 0);
        fu(U[e], rbu, r0, r1, D, xu, 1, ue, 0, 1.f, 0);
        if (!bg.empty()) add_bias(ge, bg[e], r0, r1);
        if (!bu.empty()) add_bias(ue, bu[e], r0, r1);
        if (g_isa >= ISA_AVX2)
            avx2_silu_mul(ge + r0, ue + r0, r1 - r0, limit, alpha);
        else
            silu_mul(ge + r0, ue + r0, r1 - r0, limit, alpha);
    });
}

// Phase 2, in two steps every path shares: the unscaled rows v[e][r] = down_e[r] . h[e] of
// each expert (independent of which experts share the call), then y[r] = sum_e w[e] v[e][r]
// with the experts added in order. So a layer whose resident experts' rows are computed while
// the others load (moe_down_rows twice, moe_combine) equals the one-call product bit for bit.
struct DownPrep {
    RowsFn fd = nullptr;
    std::vector<Prep> ph;
    const Biases& bd;                  // each expert's down bias (empty: none)
    DownPrep(const float* h, int64_t n, int64_t ff, int64_t td, int64_t mode, const Biases& b)
        : fd(rows_fn((int)td, (int)mode)), ph((size_t)n), bd(b) {
        TORCH_CHECK(fd, "expertfs kernels: no kernel for these types");
        const int fmt_d = act_format((int)td, (int)mode);
        for (int64_t e = 0; e < n; ++e)
            ph[e].make(h + e * ff, ff, 1, ff, fmt_d, exact_layouts((int)td));
    }
    void rows(int64_t e, const uint8_t* W, int64_t rbd, int64_t r0, int64_t r1, int64_t ff,
              float* v) const {
        fd(W, rbd, r0, r1, ff, ph[e].xs.data(), 1, v, 0, 1.f, 0);
        if (!bd.empty()) add_bias(v, bd[e], r0, r1);
    }
};

// y[r] = sum_j w[j] v_j[r] for r in [r0, r1), v_j = rows[j], added in order. One machine code
// for the sum whatever the caller, so its rounding is the same everywhere.
__attribute__((noinline)) void combine_rows(const float* const* rows, int64_t n, const float* w,
                                            int64_t r0, int64_t r1, float* y) {
    for (int64_t r = r0; r < r1; ++r) {
        float s = w[0] * rows[0][r];
        for (int64_t j = 1; j < n; ++j) s = s + w[j] * rows[j][r];
        y[r] = s;
    }
}

// Phase 2 into v (n * D floats): each expert's rows, then, when `wp` is given, their sum into
// yp row chunk by row chunk (while the chunk's rows are in cache).
void down_phase(const float* h, int64_t n, int64_t ff, int64_t D,
                const std::vector<const uint8_t*>& Dn, int64_t rbd, int64_t td, int64_t mode,
                float* v, const float* wp = nullptr, float* yp = nullptr,
                const Biases& bd = {}) {
    pybind11::gil_scoped_release nogil;
    const DownPrep dp(h, n, ff, td, mode, bd);
    std::vector<const float*> rows((size_t)n);
    for (int64_t e = 0; e < n; ++e) rows[e] = v + e * D;
    const int64_t rd = rows_per_chunk(D);
    if (!wp && n >= 16 && rd < 64) {   // many small matrices (MLA's heads): a chunk of them
        const int64_t per = (n + 7) / 8;       // whole, not each cut into chunks of a few rows
        par_chunks((n + per - 1) / per, [&](int64_t c) {
            for (int64_t e = c * per; e < n && e < (c + 1) * per; ++e)
                dp.rows(e, Dn[e], rbd, 0, D, ff, v + e * D);
        });
        return;
    }
    par_chunks((D + rd - 1) / rd, [&](int64_t c) {
        const int64_t r0 = c * rd, r1 = r0 + rd < D ? r0 + rd : D;
        for (int64_t e = 0; e < n; ++e) dp.rows(e, Dn[e], rbd, r0, r1, ff, v + e * D);
        if (wp) combine_rows(rows.data(), n, wp, r0, r1, yp);
    });
}

// The down tensors' pointers after checking type and sizes; *rbd: bytes per row.
std::vector<const uint8_t*> check_down(const std::vector<at::Tensor>& down, int64_t D, int64_t ff,
                                       int64_t td, int64_t mode, int64_t* rbd) {
    const TypeInfo* di = check_type(td, ff, mode);
    *rbd = ff / di->block * di->bytes;
    std::vector<const uint8_t*> Dn(down.size());
    for (size_t e = 0; e < down.size(); ++e) {
        check_raw(down[e], D, *rbd, "down");
        Dn[e] = down[e].data_ptr<uint8_t>();
    }
    return Dn;
}

// The float32 pointers of n experts' bias rows of `len` values (none when `b` is empty).
Biases check_bias(const std::vector<at::Tensor>& b, int64_t n, int64_t len, const char* what) {
    Biases out;
    if (b.empty()) return out;
    TORCH_CHECK((int64_t)b.size() == n, "expertfs kernels: one ", what, " bias per expert");
    for (const at::Tensor& t : b) {
        TORCH_CHECK(t.is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                    t.numel() == len, "expertfs kernels: a ", what, " bias must be ", len,
                    " contiguous float32 values");
        out.push_back(t.data_ptr<float>());
    }
    return out;
}

struct Experts {          // checked pointers to n experts' gate, up and down bytes
    int64_t n = 0, D = 0, ff = 0, rbg = 0, rbu = 0, rbd = 0, tu = 0;
    std::vector<const uint8_t*> G, U, Dn;
};

Experts check_experts(const std::vector<at::Tensor>& gate, const std::vector<at::Tensor>& up,
                      const std::vector<at::Tensor>* down, int64_t D, int64_t tg, int64_t tu,
                      int64_t td, int64_t ff, int64_t mode) {
    Experts ex;
    ex.n = (int64_t)gate.size();
    ex.D = D;
    ex.ff = ff;
    TORCH_CHECK(ex.n > 0 && (up.empty() || (int64_t)up.size() == ex.n) &&
                (down == nullptr || (int64_t)down->size() == ex.n),
                "expertfs kernels: gate, up and down must list the same experts");
    const bool fused = up.empty();
    ex.tu = fused ? tg : tu;
    const TypeInfo* gi = check_type(tg, D, mode);
    const TypeInfo* ui = check_type(ex.tu, D, mode);
    ex.rbg = D / gi->block * gi->bytes;
    ex.rbu = D / ui->block * ui->bytes;
    if (down != nullptr) ex.Dn = check_down(*down, D, ff, td, mode, &ex.rbd);
    ex.G.resize(ex.n);
    ex.U.resize(ex.n);
    for (int64_t e = 0; e < ex.n; ++e) {
        check_raw(gate[e], fused ? 2 * ff : ff, ex.rbg, fused ? "gate_up" : "gate");
        if (!fused) check_raw(up[e], ff, ex.rbu, "up");
        ex.G[e] = gate[e].data_ptr<uint8_t>();
        ex.U[e] = fused ? ex.G[e] + ff * ex.rbg : up[e].data_ptr<uint8_t>();
    }
    return ex;
}

// One decode step through n experts: sum_j w[j] * down_j(silu(gate_j x) * up_j x).
// `up` empty: each gate tensor is a fused gate_up (rows [0, ff) gate, [ff, 2 ff) up).
at::Tensor moe(const at::Tensor& x_, const at::Tensor& w_, const std::vector<at::Tensor>& gate,
               const std::vector<at::Tensor>& up, const std::vector<at::Tensor>& down,
               int64_t tg, int64_t tu, int64_t td, int64_t ff, int64_t mode, double limit,
               double alpha, const std::vector<at::Tensor>& gate_b,
               const std::vector<at::Tensor>& up_b, const std::vector<at::Tensor>& down_b) {
    TORCH_CHECK(x_.dim() == 2 && x_.size(0) == 1, "expertfs kernels: moe takes one token");
    const int64_t D = x_.size(1);
    const at::Tensor x = check_x(x_, D);
    const Experts ex = check_experts(gate, up, &down, D, tg, tu, td, ff, mode);
    TORCH_CHECK(w_.numel() == ex.n, "expertfs kernels: one weight per expert expected");
    const at::Tensor w = w_.to(at::kFloat).contiguous();
    const Biases bg = check_bias(gate_b, ex.n, ff, "gate"), bu = check_bias(up_b, ex.n, ff, "up");
    const Biases bd = check_bias(down_b, ex.n, D, "down");
    std::vector<float> h((size_t)(ex.n * ff));
    hidden_phase(x.data_ptr<float>(), D, ex.n, ff, ex.G, ex.U, ex.rbg, ex.rbu, tg, ex.tu, mode,
                 h.data(), (float)limit, (float)alpha, bg, bu);
    at::Tensor y = at::empty({1, D}, x.options());   // the first expert writes, the rest add
    std::unique_ptr<float[]> v(new float[(size_t)(ex.n * D)]);  // every element written
    down_phase(h.data(), ex.n, ff, D, ex.Dn, ex.rbd, td, mode, v.get(), w.data_ptr<float>(),
               y.data_ptr<float>(), bd);
    return y;
}

// Phase 1 alone: [n, ff] float32, h[e] = silu(gate_e x) * up_e x.
at::Tensor moe_hidden(const at::Tensor& x_, const std::vector<at::Tensor>& gate,
                      const std::vector<at::Tensor>& up, int64_t tg, int64_t tu, int64_t ff,
                      int64_t mode, double limit, double alpha,
                      const std::vector<at::Tensor>& gate_b, const std::vector<at::Tensor>& up_b) {
    TORCH_CHECK(x_.dim() == 2 && x_.size(0) == 1, "expertfs kernels: moe_hidden takes one token");
    const int64_t D = x_.size(1);
    const at::Tensor x = check_x(x_, D);
    const Experts ex = check_experts(gate, up, nullptr, D, tg, tu, 0, ff, mode);
    const Biases bg = check_bias(gate_b, ex.n, ff, "gate"), bu = check_bias(up_b, ex.n, ff, "up");
    at::Tensor h = at::empty({ex.n, ff}, x.options());
    hidden_phase(x.data_ptr<float>(), D, ex.n, ff, ex.G, ex.U, ex.rbg, ex.rbu, tg, ex.tu, mode,
                 h.data_ptr<float>(), (float)limit, (float)alpha, bg, bu);
    return h;
}


// Phase 2's first step alone: the unscaled rows v [n, D], v[e] = down_e h[e].
at::Tensor moe_down_rows(const at::Tensor& h_, const std::vector<at::Tensor>& down, int64_t td,
                         int64_t D, int64_t mode, const std::vector<at::Tensor>& down_b) {
    const int64_t n = (int64_t)down.size();
    TORCH_CHECK(n > 0 && h_.dim() == 2 && h_.size(0) == n, "expertfs kernels: moe_down_rows "
                "needs one row of h per expert");
    const int64_t ff = h_.size(1);
    const at::Tensor h = check_x(h_, ff);
    int64_t rbd = 0;
    const std::vector<const uint8_t*> Dn = check_down(down, D, ff, td, mode, &rbd);
    const Biases bd = check_bias(down_b, n, D, "down");
    at::Tensor v = at::empty({n, D}, h.options());
    down_phase(h.data_ptr<float>(), n, ff, D, Dn, rbd, td, mode, v.data_ptr<float>(), nullptr,
               nullptr, bd);
    return v;
}

// Phase 2's second step alone: y [1, D] = sum_j w[j] v[order[j]], added in order (v's rows
// as moe_down_rows gave them, in any order; `order` empty: v's own order).
at::Tensor moe_combine(const at::Tensor& v_, const at::Tensor& w_,
                       const std::vector<int64_t>& order) {
    TORCH_CHECK(v_.dim() == 2 && v_.size(0) > 0, "expertfs kernels: moe_combine takes [n, D]");
    const int64_t m = v_.size(0), D = v_.size(1);
    const int64_t n = order.empty() ? m : (int64_t)order.size();
    const at::Tensor v = check_x(v_, D);
    TORCH_CHECK(w_.numel() == n, "expertfs kernels: one weight per expert expected");
    const at::Tensor w = w_.to(at::kFloat).contiguous();
    std::vector<const float*> rows((size_t)n);
    for (int64_t j = 0; j < n; ++j) {
        const int64_t i = order.empty() ? j : order[j];
        TORCH_CHECK(i >= 0 && i < m, "expertfs kernels: moe_combine order out of range");
        rows[j] = v.data_ptr<float>() + i * D;
    }
    at::Tensor y = at::empty({1, D}, v.options());
    combine_rows(rows.data(), n, w.data_ptr<float>(), 0, D, y.data_ptr<float>());
    return y;
}

// One routed expert over a prompt's share of tokens, in one call: for pair i (its token tok[i]
// of x), out[i] = w[i] * (down(swiglu(gate x, up x)) + down bias), each product through the
// native rows kernel up to `lim` tokens of its type (lim_g, lim_u, lim_d: kernels.max_tokens)
// and through qgemm past it, the activation and the bias additions as torch's own operations
// (runtime.model.ffn.swiglu: clamp, silu or sigmoid, multiply): so each row is the one
// expert_ffn gives, bit for bit, without the Python and the pool's wake-ups between the
// products. `up` empty: `gate` is a fused gate_up (gate rows first). Returns false, writing
// nothing, where a product would need qgemm and this build has none.
bool expert_tokens(const at::Tensor& x_, const at::Tensor& tok_, const at::Tensor& w_,
                   at::Tensor out, const at::Tensor& gate, const std::vector<at::Tensor>& up,
                   const at::Tensor& down, int64_t tg, int64_t tu, int64_t td, int64_t ff,
                   int64_t mode, double limit, double alpha, int64_t lim_g, int64_t lim_u,
                   int64_t lim_d, const std::vector<at::Tensor>& gate_b,
                   const std::vector<at::Tensor>& up_b, const std::vector<at::Tensor>& down_b) {
    const int64_t D = x_.size(-1);
    const at::Tensor x = check_x(x_, D);
    TORCH_CHECK(tok_.dim() == 1 && tok_.scalar_type() == at::kLong, "expertfs kernels: tok "
                "must be int64 [n]");
    const int64_t n = tok_.size(0);
    TORCH_CHECK(w_.numel() == n && out.dim() == 2 && out.size(0) == n && out.size(1) == D &&
                out.scalar_type() == at::kFloat && out.is_contiguous(),
                "expertfs kernels: expert_tokens needs w [n] and a contiguous float32 out [n, D]");
    const at::Tensor tok = tok_.contiguous(), w = w_.to(at::kFloat).contiguous();
    const std::vector<at::Tensor> gl{gate}, dl{down};
    const Experts ex = check_experts(gl, up, &dl, D, tg, tu, td, ff, mode);
    const Biases bg = check_bias(gate_b, 1, ff, "gate"), bu = check_bias(up_b, 1, ff, "up");
    const Biases bd = check_bias(down_b, 1, D, "down");
    const bool fused = up.empty();
    const bool wide_g = n > lim_g, wide_u = !fused && n > lim_u, wide_d = n > lim_d;
    if ((wide_g || wide_u || wide_d) && !qgemm_available()) return false;
    const RowsFn fg = rows_fn((int)tg, (int)mode), fu = rows_fn((int)ex.tu, (int)mode);
    const RowsFn fd = rows_fn((int)td, (int)mode);
    TORCH_CHECK(fg && fu && fd, "expertfs kernels: no kernel for these types");
    if (n == 0) return true;
    const int64_t* tp = tok.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i)
        TORCH_CHECK(tp[i] >= 0 && tp[i] < x.size(0), "expertfs kernels: token out of range");
    const at::TensorOptions f32 = x.options();
    at::Tensor xs = at::empty({n, D}, f32), y;
    at::Tensor gu = at::empty({n, (fused ? 2 : 1) * ff}, f32);
    at::Tensor u = fused ? at::Tensor() : at::empty({n, ff}, f32);
    {
        pybind11::gil_scoped_release nogil;
        const float* xp = x.data_ptr<float>();
        float* xsp = xs.data_ptr<float>();
        for (int64_t i = 0; i < n; ++i) memcpy(xsp + i * D, xp + tp[i] * D, D * sizeof(float));
        const auto product = [&](const uint8_t* W, int64_t rb, RowsFn fn, int64_t type,
                                 int64_t rows, int64_t cols, const float* in, bool wide,
                                 float* o) {
            if (wide)
                wide_into(in, n, W, rb, type, rows, cols, mode, o);
            else
                matvec_into(in, (int)n, W, rb, fn, (int)type, rows, cols, mode, o);
        };
        product(ex.G[0], ex.rbg, fg, tg, (fused ? 2 : 1) * ff, D, xsp, wide_g,
                gu.data_ptr<float>());
        if (!fused) product(ex.U[0], ex.rbu, fu, ex.tu, ff, D, xsp, wide_u, u.data_ptr<float>());
        at::Tensor g = fused ? gu.narrow(1, 0, ff) : gu, uu = fused ? gu.narrow(1, ff, ff) : u;
        if (!bg.empty()) g = g.add(at::from_blob(const_cast<float*>(bg[0]), {ff}, f32));
        if (!bu.empty()) uu = uu.add(at::from_blob(const_cast<float*>(bu[0]), {ff}, f32));
        if (limit > 0) {                                           // ffn.swiglu's order
            g = g.clamp(c10::nullopt, limit);
            uu = uu.clamp(-limit, limit);
        }
        const at::Tensor h = (alpha > 0 ? g.mul(at::sigmoid(g.mul(alpha))).mul(uu.add(1))
                                        : at::silu(g).mul(uu)).contiguous();
        y = at::empty({n, D}, f32);
        product(ex.Dn[0], ex.rbd, fd, td, D, ff, h.data_ptr<float>(), wide_d,
                y.data_ptr<float>());
        if (!bd.empty()) y = y.add(at::from_blob(const_cast<float*>(bd[0]), {D}, f32));
        at::mul_out(out, y, w.unsqueeze(1));
    }
    return true;
}

// W [rows, cols] as float32 from the ggml bytes `raw` (rows x row_bytes) into y (contiguous):
// the weights the exact kernels multiply by, for products too wide for them (dequantize, then
// one matmul).
static void dequant_to(const at::Tensor& raw, int64_t type, int64_t rows, int64_t cols,
                       float* yp) {
    const TypeInfo* ti = check_type(type, cols, 0);
    const int64_t rb = cols / ti->block * ti->bytes;
    check_raw(raw, rows, rb, "weight");
    if (rows == 0) return;
    const uint8_t* W = raw.data_ptr<uint8_t>();
    const int64_t rc = rows_per_chunk(rows);
    pybind11::gil_scoped_release nogil;
    par_chunks((rows + rc - 1) / rc, [&](int64_t c) {
        const int64_t r0 = c * rc, r1 = r0 + rc < rows ? r0 + rc : rows;
        if (!(g_isa >= ISA_AVX2 && avx2_dequant_rows((int)type, W, rb, r0, r1, cols,
                                                     yp + r0 * cols)))
            dequant_rows((int)type, W, rb, r0, r1, cols, yp + r0 * cols);
    });
}

at::Tensor dequant(const at::Tensor& raw, int64_t type, int64_t rows, int64_t cols) {
    at::Tensor y = at::empty({rows, cols}, at::kFloat);
    dequant_to(raw, type, rows, cols, y.data_ptr<float>());
    return y;
}

// dequant into the first rows * cols floats of `out` (contiguous float32 on the CPU, e.g. a
// reused scratch buffer: no fresh pages to fault in and zero per call), as [rows, cols].
at::Tensor dequant_into(const at::Tensor& raw, int64_t type, int64_t rows, int64_t cols,
                        const at::Tensor& out) {
    TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kFloat && out.is_contiguous()
                && out.numel() >= rows * cols, "dequant_into: out must be a contiguous float32 "
                "CPU tensor of at least rows * cols elements");
    at::Tensor y = out.view({-1}).narrow(0, 0, rows * cols).view({rows, cols});
    dequant_to(raw, type, rows, cols, y.data_ptr<float>());
    return y;
}

// The activations as the q8 mode sees them, dequantized (for tests): [T, cols] float32.
at::Tensor act_dequant(const at::Tensor& x_, int64_t type) {
    const int64_t cols = x_.size(1);
    check_type(type, cols, 1);
    const at::Tensor x = check_x(x_, cols);
    const int nt = (int)x.size(0);
    const int fmt = q8_format((int)type);
    Prep p;
    p.make(x.data_ptr<float>(), cols, nt, cols, fmt, 0);
    at::Tensor y = at::empty({nt, cols}, x.options());
    float* o = y.data_ptr<float>();
    for (int t = 0; t < nt; ++t, o += cols) {
        if (fmt == X_Q8K) {
            const Q8K* q = (const Q8K*)p.xs[t].q;
            for (int64_t i = 0; i < cols; ++i) o[i] = q[i / 256].d * q[i / 256].qs[i % 256];
        } else if (fmt == X_Q8_0 || fmt == X_Q8_1) {
            const QX8* q = (const QX8*)p.xs[t].q;
            for (int64_t i = 0; i < cols; ++i) o[i] = q[i / 32].d * q[i / 32].qs[i % 32];
        } else {
            std::memcpy(o, p.xs[t].x, sizeof(float) * cols);
        }
    }
    return y;
}

// Q8_K blocks as bytes (llama.cpp's block_q8_K), for tests against an independent quantizer.
at::Tensor quantize_q8k_bytes(const at::Tensor& x_) {
    const int64_t cols = x_.size(1);
    TORCH_CHECK(cols % 256 == 0, "expertfs kernels: Q8_K needs 256-element rows");
    const at::Tensor x = check_x(x_, cols);
    const int64_t nb = cols / 256, nt = x.size(0);
    at::Tensor y = at::empty({nt, nb * (int64_t)sizeof(Q8K)}, x.options().dtype(at::kByte));
    for (int64_t t = 0; t < nt; ++t) {
        Q8K* o = (Q8K*)(y.data_ptr<uint8_t>() + t * nb * sizeof(Q8K));
        if (g_isa >= ISA_AVX2)
            avx2_quantize_q8k(x.data_ptr<float>() + t * cols, o, cols);
        else
            quantize_q8k(x.data_ptr<float>() + t * cols, o, cols);
    }
    return y;
}

std::string isa_name(int isa) {
    return isa == ISA_AVX512 ? "avx512" : isa == ISA_AVX2 ? "avx2" : "scalar";
}

std::string set_isa(const std::string& name) {
    if (name == "best") {
        g_isa = g_best;
    } else if (name == "scalar") {
        g_isa = ISA_SCALAR;
    } else if (name == "avx2") {
        TORCH_CHECK(g_best >= ISA_AVX2, "expertfs kernels: this CPU (or build) has no "
                    "AVX2+FMA+F16C");
        g_isa = ISA_AVX2;
    } else if (name == "avx512") {
        TORCH_CHECK(g_best >= ISA_AVX512, "expertfs kernels: this CPU (or build) has no "
                    "AVX-512 F+VL");
        g_isa = ISA_AVX512;
    } else {
        TORCH_CHECK(false, "expertfs kernels: unknown isa '", name,
                    "' (scalar, avx2, avx512, best)");
    }
    return isa_name(g_isa);
}

// Exact mode's AMX panel product on or off; gives the setting it replaces (to restore it).
bool set_amx(bool on) {
    TORCH_CHECK(!on || g_amx, "expertfs kernels: this CPU (or OS, or build) has no AMX-BF16");
    const bool was = g_amx_on;
    g_amx_on = on;
    return was;
}

// What the kernels are told of the CPU beyond its features (kernels/cpu.py, at load): whether
// it executes 512-bit operations as two 256-bit halves (a Zen 4), which the float panel's
// token tails follow (qgemm.cpp). Not set: a full-width CPU's choices, the same results.
void set_cpu(bool splits_512) { g_splits_512 = splits_512; }

// Exact Q6_K's GFNI decoder on or off; gives the setting it replaces (to restore it).
bool set_gfni(bool on) {
    TORCH_CHECK(!on || g_gfni, "expertfs kernels: this CPU (or build) has no GFNI");
    const bool was = g_gfni_on;
    g_gfni_on = on;
    return was;
}

int64_t set_spin_us(int64_t us) {
    TORCH_CHECK(us >= 0, "expertfs kernels: spin time must be >= 0");
    std::shared_ptr<Pool> old;
    {
        std::lock_guard<std::mutex> g(g_pool_m);
        g_spin_us = us;
        old.swap(g_pool);                 // rebuilt with the new setting on next use
    }
    pybind11::gil_scoped_release nogil;   // joining the old workers
    old.reset();
    return us;
}

// One of the lattice IQ types' tables from gguf-py (kern.h IqTables), as raw bytes.
bool set_iq_table_t(const std::string& name, const at::Tensor& t) {
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.element_size() == 1,
                "expertfs kernels: table ", name, " must be a contiguous 1-byte CPU tensor");
    const char* err = set_iq_table(name.c_str(), (const uint8_t*)t.data_ptr(), t.numel());
    TORCH_CHECK(err == nullptr, "expertfs kernels: table ", name, ": ", err ? err : "");
    return g_iq.ok;
}

int64_t set_threads(int64_t n) {
    TORCH_CHECK(n >= 0, "expertfs kernels: thread count must be >= 0");
    g_threads = (int)n;
    return n;
}

// The ISA the kernels run now (what info()["isa"] says, without building the whole dict: the
// native token limits are looked up per product).
std::string isa() { return isa_name(g_isa); }

pybind11::dict info() {
    pybind11::dict d;
    d["isa"] = isa_name(g_isa);
    d["best_isa"] = isa_name(g_best);
    d["avx2_compiled"] = avx2_compiled();
    d["avx512_compiled"] = avx512_compiled();
#ifdef EFS_EMULATE_AVX512
    d["avx512_emulated"] = true;     // SIMDe's emulation (avx512_emulated.h): tests, not speed
#else
    d["avx512_emulated"] = false;
#endif
    d["spin_us"] = g_spin_us;
    d["threads"] = g_threads > 0 ? g_threads : at::get_num_threads();
    pybind11::list types;
    static const int all[] = {T_F16, T_BF16, T_Q4_0, T_Q4_1, T_Q5_0, T_Q5_1, T_Q8_0, T_Q2_K,
                              T_Q3_K, T_Q4_K, T_Q5_K, T_Q6_K, T_IQ4_XS, T_MXFP4, T_IQ4_NL,
                              T_IQ2_XXS, T_IQ2_XS, T_IQ2_S, T_IQ3_XXS, T_IQ3_S, T_IQ1_S, T_IQ1_M,
                              T_TQ1_0, T_TQ2_0};
    for (int t : all)
        if (type_info(t) != nullptr) types.append(t);
    d["types"] = types;
    pybind11::list ze, zq;              // the types with AVX-512 IQ kernels in use here
    for (int t : all) {
        if (g_bw && avx512_iq_rows(t, 0) != nullptr) ze.append(t);
        if (g_bw && avx512_iq_rows(t, 1) != nullptr) zq.append(t);
    }
    d["avx512_iq_exact_types"] = ze;
    d["avx512_iq_q8_types"] = zq;
    pybind11::list ke, kq;              // the K-quants' AVX-512 kernels in use here
    for (int t : all) {
        if (g_bw && avx512_k_rows(t, 0) != nullptr) ke.append(t);
        if (g_bw && avx512_k_rows(t, 1) != nullptr) kq.append(t);
    }
    d["avx512_k_exact_types"] = ke;
    d["avx512_k_q8_types"] = kq;
    pybind11::list qp;                  // q8 mode's integer panel product at the ISA in use
    for (int t : all)
        if (qgemm_q8_fn(t) != nullptr) qp.append(t);
    d["q8_panel_types"] = qp;
    d["avx512_vnni"] = g_vnni;
    d["avx_vnni"] = g_avxvnni;
    d["amx"] = g_amx;                   // exact mode's AMX panel product: the CPU has it
    d["gfni"] = g_gfni;                 // exact Q6_K's GFNI decoder: the CPU has it
    pybind11::list ap;                  // ... and the types it takes at the ISA in use now
    for (int t : all)
        if (qgemm_amx_fn(t, 256) != nullptr) ap.append(t);
    d["amx_types"] = ap;
    d["iq_tables"] = g_iq.ok;
    d["splits_512"] = g_splits_512;     // as set_cpu was told
    return d;
}

}  // namespace

bool g_gfni_on = g_gfni;                  // kern.h
bool g_splits_512 = false;                // kern.h (set_cpu)

void run_parallel(int64_t n, void (*fn)(void*, int64_t), void* ctx) {
    par_chunks(n, [&](int64_t c) { fn(ctx, c); });
}

bool isa_avx2() { return g_isa >= ISA_AVX2; }

}  // namespace efs

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "expertfs native CPU matrix-vector kernels over ggml blocks";
    m.def("matvec", &efs::matvec, "y[T, rows] = x[T, cols] @ W.T from ggml bytes",
          pybind11::arg("x"), pybind11::arg("raw"), pybind11::arg("type"),
          pybind11::arg("rows"), pybind11::arg("cols"), pybind11::arg("mode"));
    m.def("qgemm", &efs::qgemm, "y[T, rows] = x[T, cols] @ W.T, many tokens (AVX2 or AVX-512; "
          "mode 1: q8, through the integer panel where there is one)",
          pybind11::arg("x"), pybind11::arg("raw"), pybind11::arg("type"),
          pybind11::arg("rows"), pybind11::arg("cols"), pybind11::arg("mode") = 0);
    m.def("moe", &efs::moe, "one decode step through a layer's selected experts",
          pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("gate"), pybind11::arg("up"),
          pybind11::arg("down"), pybind11::arg("tg"), pybind11::arg("tu"),
          pybind11::arg("td"), pybind11::arg("ff"), pybind11::arg("mode"),
          pybind11::arg("limit") = 0.0, pybind11::arg("alpha") = 0.0,
          pybind11::arg("gate_b") = std::vector<at::Tensor>(),
          pybind11::arg("up_b") = std::vector<at::Tensor>(),
          pybind11::arg("down_b") = std::vector<at::Tensor>());
    m.def("expert_tokens", &efs::expert_tokens, "one expert over its tokens of a prompt, "
          "weighted, into out", pybind11::arg("x"), pybind11::arg("tok"), pybind11::arg("w"),
          pybind11::arg("out"), pybind11::arg("gate"), pybind11::arg("up"),
          pybind11::arg("down"), pybind11::arg("tg"), pybind11::arg("tu"), pybind11::arg("td"),
          pybind11::arg("ff"), pybind11::arg("mode"), pybind11::arg("limit"),
          pybind11::arg("alpha"), pybind11::arg("lim_g"), pybind11::arg("lim_u"),
          pybind11::arg("lim_d"), pybind11::arg("gate_b") = std::vector<at::Tensor>(),
          pybind11::arg("up_b") = std::vector<at::Tensor>(),
          pybind11::arg("down_b") = std::vector<at::Tensor>());
    m.def("moe_hidden", &efs::moe_hidden, "phase 1 of moe: silu(gate x) * up x per expert",
          pybind11::arg("x"), pybind11::arg("gate"), pybind11::arg("up"), pybind11::arg("tg"),
          pybind11::arg("tu"), pybind11::arg("ff"), pybind11::arg("mode"),
          pybind11::arg("limit") = 0.0, pybind11::arg("alpha") = 0.0,
          pybind11::arg("gate_b") = std::vector<at::Tensor>(),
          pybind11::arg("up_b") = std::vector<at::Tensor>());
    m.def("moe_down_rows", &efs::moe_down_rows, "phase 2's unscaled rows down_e h[e], [n, D]",
          pybind11::arg("h"), pybind11::arg("down"), pybind11::arg("td"), pybind11::arg("D"),
          pybind11::arg("mode"), pybind11::arg("down_b") = std::vector<at::Tensor>());
    m.def("moe_combine", &efs::moe_combine, "phase 2's weighted sum of moe_down_rows' rows",
          pybind11::arg("v"), pybind11::arg("w"), pybind11::arg("order"));
    m.def("act_dequant", &efs::act_dequant, "q8-mode activations, dequantized");
    m.def("dequant", &efs::dequant, "W [rows, cols] float32 from ggml bytes",
          pybind11::arg("raw"), pybind11::arg("type"), pybind11::arg("rows"),
          pybind11::arg("cols"));
    m.def("dequant_into", &efs::dequant_into, "dequant into out's first rows * cols floats",
          pybind11::arg("raw"), pybind11::arg("type"), pybind11::arg("rows"),
          pybind11::arg("cols"), pybind11::arg("out"));
    m.def("quantize_q8k_bytes", &efs::quantize_q8k_bytes, "Q8_K blocks of x as bytes");
    m.def("set_isa", &efs::set_isa, "force the kernel ISA: scalar, avx2, avx512 or best");
    m.def("amx", &efs::amx_in_use, "whether exact mode's wide products run on AMX now (the CPU "
          "has it, it is on, the kernels run at the AVX-512 tier)");
    m.def("set_cpu", &efs::set_cpu, "what the kernels follow of the CPU: splits_512",
          pybind11::arg("splits_512"));
    m.def("set_gfni", &efs::set_gfni, "exact Q6_K's GFNI decoder on or off (where the CPU "
          "has GFNI); returns the setting it replaces");
    m.def("set_amx", &efs::set_amx, "exact mode's AMX panel product on or off (where the CPU "
          "has AMX-BF16); returns the setting it replaces");
    m.def("info", &efs::info, "ISA in use, best ISA, supported type ids, pool spin time");
    m.def("isa", &efs::isa, "the ISA in use: scalar, avx2 or avx512");
    m.def("set_spin_us", &efs::set_spin_us, "how long idle pool workers spin before sleeping");
    m.def("rms_norm", &efs::rms_norm, "RMSNorm over the last dim (float32, CPU)",
          pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("eps"));
    m.def("norm_rope_", &efs::norm_rope_, "per-head RMSNorm (optional) and RoPE, in place",
          pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("eps"), pybind11::arg("norm"),
          pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("n_rot"),
          pybind11::arg("neox"));
    m.def("attn_decode", &efs::attn_decode, "one token's attention over the KV cache, GQA",
          pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("kc"),
          pybind11::arg("vc"), pybind11::arg("p0"), pybind11::arg("scale"));
    m.def("kda_step_", &efs::kda_step_, "one token of the gated delta rule, state in place",
          pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("g"),
          pybind11::arg("beta"), pybind11::arg("S"));
    m.def("sinkhorn_", &efs::sinkhorn_, "mHC's Sinkhorn normalisation, in place",
          pybind11::arg("c"), pybind11::arg("iters"), pybind11::arg("eps"));
    m.def("hc_pre", &efs::hc_pre, "mHC's pre mix of one token: (x, post, comb)",
          pybind11::arg("streams"), pybind11::arg("fn"), pybind11::arg("base"),
          pybind11::arg("scales"), pybind11::arg("iters"), pybind11::arg("eps"),
          pybind11::arg("rms_eps"));
    m.def("hc_post", &efs::hc_post, "mHC's post mix of one token: the new streams",
          pybind11::arg("y"), pybind11::arg("streams"), pybind11::arg("post"),
          pybind11::arg("comb"));
    m.def("kda_token_", &efs::kda_token_, "one token of a KDA layer after its conv, state in "
          "place", pybind11::arg("qkv"), pybind11::arg("f"), pybind11::arg("gate"),
          pybind11::arg("beta"), pybind11::arg("dt_bias"), pybind11::arg("a"),
          pybind11::arg("has_lb"), pybind11::arg("lb"), pybind11::arg("o_norm"),
          pybind11::arg("rms_eps"), pybind11::arg("l2_eps"), pybind11::arg("S"));
    m.def("conv_step_", &efs::conv_step_, "one token of KDA's short conv + SiLU, window in place",
          pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("window"));
    m.def("route", &efs::route, "one token's expert ids and weights",
          pybind11::arg("x"), pybind11::arg("W"), pybind11::arg("bias"), pybind11::arg("k"),
          pybind11::arg("sigmoid"), pybind11::arg("norm_w"), pybind11::arg("w_min"),
          pybind11::arg("w_scale"), pybind11::arg("n_group"), pybind11::arg("n_group_used"));
    m.def("set_iq_table", &efs::set_iq_table_t, "one lattice IQ table (gguf-py's, as bytes)",
          pybind11::arg("name"), pybind11::arg("data"));
    m.def("set_threads", &efs::set_threads, "threads of the kernels (0: torch.get_num_threads())");
}
