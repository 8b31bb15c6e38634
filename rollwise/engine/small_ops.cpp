// The small ops of a decoder layer (RMSNorm, SiLU-and-multiply, RoPE), each one pass over its rows;
// their torch twins in models/llama.py are the oracles. In torch each is several kernels, and each
// kernel may wake the OpenMP threads (200-300 us per wake under PASSIVE on 2-core VMs, more than the
// work at decode sizes). Rows split across threads only past kParallelFloats.
#include "kernels.h"

namespace rollwise {
namespace {

constexpr int64_t kParallelFloats = 1 << 18;

// One row of each, cloned per instruction set like the attention (built for the baseline alone,
// exp_clamped's floor is a scalar call).
ROLLWISE_CLONES void rms_norm_row(const float* __restrict x, const float* __restrict w, float e, int64_t D,
                                  float* __restrict out) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < D; ++i) ss += x[i] * x[i];
    const float inv = 1.f / std::sqrt(ss / float(D) + e);
#pragma omp simd
    for (int64_t i = 0; i < D; ++i) out[i] = x[i] * inv * w[i];
}

ROLLWISE_CLONES void silu_and_mul_row(const float* __restrict gate, const float* __restrict up, int64_t I,
                                      float* __restrict out) {
#pragma omp simd
    for (int64_t i = 0; i < I; ++i) out[i] = gate[i] / (1.f + exp_clamped(-gate[i])) * up[i];
}

// One row's heads rotated in place (rotate-half RoPE, Llama's and Qwen's layout): for i < D/2,
// (x[i], x[i + D/2]) <- (x[i] cos[i] - x[i + D/2] sin[i], x[i + D/2] cos[i + D/2] + x[i] sin[i + D/2]).
ROLLWISE_CLONES void rope_row(float* __restrict x, const float* __restrict cos, const float* __restrict sin,
                              int64_t heads, int64_t D) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < heads; ++h, x += D) {
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
            const float a = x[i], b = x[i + half];
            x[i] = a * cos[i] - b * sin[i];
            x[i + half] = b * cos[i + half] + a * sin[i + half];
        }
    }
}

}  // namespace

// Rotary embedding in place: heads `heads` of size D from column c0 of every row of x [T, W] (q's
// and k's heads side by side in the fused projection), row t at cos[t], sin[t] ([T, D]). The torch
// twin is models/llama.py's apply_rope.
void rope_(f32& x, int64_t c0, int64_t heads, const f32& cos, const f32& sin) {
    need(x.ndim() == 2 && cos.ndim() == 2 && sin.ndim() == 2, "rope_: x, cos and sin 2-d");
    const int64_t T = x.shape(0), W = x.shape(1), D = cos.shape(1);
    need(cos.shape(0) == T && sin.shape(0) == T && sin.shape(1) == D, "rope_: cos and sin [T, D] for x's T rows");
    need(D > 0 && D % 2 == 0 && c0 >= 0 && heads >= 0 && c0 + heads * D <= W,
         "rope_: even D, heads within x's columns");
    float* xp = x.mutable_data();
    const float *cp = cos.data(), *sp = sin.data();
    py::gil_scoped_release nogil;
#pragma omp parallel if (T * heads * D >= kParallelFloats)
    {
        FlushDenormals ftz;
#pragma omp for
        for (int64_t t = 0; t < T; ++t) rope_row(xp + t * W + c0, cp + t * D, sp + t * D, heads, D);
    }
}

// out = x / sqrt(mean(x^2) + eps) * w, row by row; x, out [N, D], w [D] (F.rms_norm's math).
void rms_norm(const f32& x, const f32& w, double eps, f32& out) {
    need(x.ndim() == 2 && out.ndim() == 2 && w.ndim() == 1, "rms_norm: x and out 2-d, w 1-d");
    const int64_t N = x.shape(0), D = x.shape(1);
    need(out.shape(0) == N && out.shape(1) == D && w.shape(0) == D, "rms_norm: out like x, w of x's width");
    const float *xp = x.data(), *wp = w.data();
    float* op = out.mutable_data();
    const float e = float(eps);
    py::gil_scoped_release nogil;
#pragma omp parallel if (N * D >= kParallelFloats)
    {
        FlushDenormals ftz;
#pragma omp for
        for (int64_t n = 0; n < N; ++n) rms_norm_row(xp + n * D, wp, e, D, op + n * D);
    }
}

// out = silu(x[:, :I]) * x[:, I:]; x [N, 2I] (gate, then up, as the fused projection lays them out).
void silu_and_mul(const f32& x, f32& out) {
    need(x.ndim() == 2 && out.ndim() == 2 && x.shape(1) % 2 == 0, "silu_and_mul: x [N, 2I] and out 2-d");
    const int64_t N = x.shape(0), I = x.shape(1) / 2;
    need(out.shape(0) == N && out.shape(1) == I, "silu_and_mul: out [N, I]");
    const float* xp = x.data();
    float* op = out.mutable_data();
    py::gil_scoped_release nogil;
#pragma omp parallel if (N * I >= kParallelFloats)
    {
        FlushDenormals ftz;
#pragma omp for
        for (int64_t n = 0; n < N; ++n) silu_and_mul_row(xp + n * 2 * I, xp + n * 2 * I + I, I, op + n * I);
    }
}

}  // namespace rollwise
