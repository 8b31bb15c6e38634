// What the engine's native kernels share (paged_attention.cpp, small_ops.cpp, sampling.cpp; bound to
// Python in _C.cpp): the instruction-set clones, the denormal flush, a vectorizable exp, 16-float vectors.
#pragma once
#include <pybind11/numpy.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

namespace rollwise {

namespace py = pybind11;
using f32 = py::array_t<float, py::array::c_style>;
using i64 = py::array_t<int64_t, py::array::c_style>;

// one clone per instruction set, picked at load time: the module is built on the machine that
// runs it, but a wheel or a shared venv may move
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ROLLWISE_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define ROLLWISE_CLONES
#endif
// what a clone calls must be inlined into it: a call out runs the baseline instruction set
#define ROLLWISE_INLINE inline __attribute__((always_inline))

// Denormals flushed to zero (MXCSR's FTZ and DAZ) while a kernel runs, per thread (the register is
// per thread), restored after. A denormal operand or result costs a microcode assist of ~100 cycles
// per lane; vectorized code computes both sides of a select, and SiLU's side for a clamped exp
// (x / (1 + e^88)) is denormal for every |x| < 1: the kernel ran 8x slower than with the flush.
// Values under 1.2e-38 become 0, far below what a softmax weight or an activation can carry.
struct FlushDenormals {
#if defined(__SSE__)
    unsigned saved = _mm_getcsr();
    FlushDenormals() { _mm_setcsr(saved | 0x8040); }
    ~FlushDenormals() { _mm_setcsr(saved); }
#endif
};

// 16 floats (GCC vector extensions: zmm on x86-64-v4, pairs of ymm on v3), operations in the
// source's order
typedef float v16 __attribute__((vector_size(64)));
typedef int i16v __attribute__((vector_size(64)));

ROLLWISE_INLINE v16 load16(const float* p) {
    v16 v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

// exp(x) in a form the compiler vectorizes (std::exp is a scalar call), for a float or for 16 at once
// (v16: the same operations lane by lane, so the same bits as the float form): Cephes' expf.
// x = n ln2 + r, |r| <= ln2 / 2, a degree-7 polynomial for exp(r), 2^n from the exponent bits; x is
// clamped to [-87, 88], where 2^n stays a normal float (exp(-87) is 1.6e-38, exp(88) 1.7e38).
// Relative error under 1e-7 for every float in [-87, 88] (checked exhaustively against
// double-precision exp when written).
ROLLWISE_INLINE float splat(float, float c) { return c; }
ROLLWISE_INLINE v16 splat(v16, float c) { return v16{} + c; }
ROLLWISE_INLINE float clamp_exp(float x) { return std::min(std::max(x, -87.f), 88.f); }
ROLLWISE_INLINE v16 clamp_exp(v16 x) {  // as std::max, then std::min, lane by lane
    const v16 lo = splat(x, -87.f), hi = splat(x, 88.f);  // (a compare with a scalar runs lane by lane)
    x = x < lo ? lo : x;
    return hi < x ? hi : x;
}
ROLLWISE_INLINE float floor_of(float x) { return std::floor(x); }
ROLLWISE_INLINE v16 floor_of(v16 x) {  // exact for |x| < 2^31, as std::floor
    const v16 t = __builtin_convertvector(__builtin_convertvector(x, i16v), v16);  // toward zero
    return x < t ? t - 1.f : t;
}
ROLLWISE_INLINE float pow2_of(float n) {  // 2^n for a whole n in [-126, 127]
    const int32_t bits = (int32_t(n) + 127) << 23;
    float out;
    std::memcpy(&out, &bits, sizeof out);
    return out;
}
ROLLWISE_INLINE v16 pow2_of(v16 n) { return (v16)((__builtin_convertvector(n, i16v) + 127) << 23); }

template <typename T>
ROLLWISE_INLINE T exp_clamped(T x) {
    x = clamp_exp(x);
    const T n = floor_of(x * 1.44269504088896341f + 0.5f);
    const T r = x - n * 0.693359375f + n * 2.12194440e-4f;
    T p = splat(x, 1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    return (p * r * r + r + 1.f) * pow2_of(n);
}

// max of x[0 .. n), -inf if n == 0, 16 lanes at a time (std::max_element is one dependent compare a
// float; a max is exact in any order)
ROLLWISE_INLINE float max_of(const float* x, int64_t n) {
    v16 mv = v16{} - INFINITY;
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) {
        const v16 xv = load16(x + t);
        mv = xv > mv ? xv : mv;
    }
    float mx = -INFINITY;
    for (int j = 0; j < 16; ++j) mx = std::max(mx, mv[j]);
    for (; t < n; ++t) mx = std::max(mx, x[t]);
    return mx;
}

// Head sizes the attention's vector kernel takes (C x 16 floats); the loop kernel takes the rest. One
// list: paged_attention.cpp instantiates and dispatches from it, _C.cpp exports it as
// _C.VECTOR_HEAD_SIZES (the engine's default, attention.py).
template <int... D>
struct HeadSizes {
    static constexpr int values[] = {D...};
};
using VectorHeadSizes = HeadSizes<32, 64, 128>;

inline void need(bool ok, const std::string& what) {
    if (!ok) throw std::invalid_argument(what);
}

// The entry points (paged_attention.cpp, small_ops.cpp, sampling.cpp), with their contracts there.
void paged_attention(const f32& q, const f32& k_cache, const f32& v_cache, const i64& block_tables, const i64& rows,
                     const i64& seqs, const i64& prefix, const i64& masks, f32& out, int64_t block_size, double scale,
                     int64_t parallel_pairs, bool lanes);
void rms_norm(const f32& x, const f32& w, double eps, f32& out);
void silu_and_mul(const f32& x, f32& out);
void rope_(f32& x, int64_t c0, int64_t heads, const f32& cos, const f32& sin);
void inverse_cdf(const f32& probs, const py::array_t<double, py::array::c_style>& u, i64& out);

}  // namespace rollwise
