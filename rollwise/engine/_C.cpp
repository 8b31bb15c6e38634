// Paged attention for single-token queries (decode steps), reading keys and values in place from the
// block pool. The Python path in attention.py gathers every sequence's blocks into a padded copy
// before SDPA; at decode that copy moves more memory than the attention itself reads. Here the
// keys are read where they lie, in partitions of whole blocks (flash-decoding: each partition keeps
// its max score and sum, the partitions of a sequence are combined at the end), with no copy.
// attention.py's torch path is the test oracle.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

using f32 = py::array_t<float, py::array::c_style>;
using i64 = py::array_t<int64_t, py::array::c_style>;

// one clone per instruction set, picked at load time: the module is built on the machine that
// runs it, but a wheel or a shared venv may move
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ROLLWISE_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define ROLLWISE_CLONES
#endif

// exp(x) for x <= 0 (softmax after subtracting the max), in a form the compiler vectorizes:
// std::exp is a scalar call per score. Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-7
// polynomial for exp(r), 2^n from the exponent bits. Relative error under 1e-7 for every float in
// [-87, 0] (checked exhaustively against double-precision exp when written).
inline float exp_nonpositive(float x) {
    x = std::max(x, -87.f);  // 2^n stays a normal float; exp(-87) is 0 next to the max's 1
    const float n = std::floor(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const int32_t bits = (int32_t(n) + 127) << 23;
    float two_n;
    std::memcpy(&two_n, &bits, sizeof two_n);
    return (p * r * r + r + 1.f) * two_n;
}

// One partition [t0, t1) of one sequence's keys, every head: reading a key row's heads together
// reads the row whole, in order. q: [H, d] (kv head h serves query heads h*g .. h*g+g-1); key and
// value row r at kc + r * row. Writes per head the max score m, the sum z of exp(score - m) and the
// unnormalized sum acc [H, d] of exp(score - m) * value. scores: scratch of H * (t1 - t0) floats.
ROLLWISE_CLONES
void attend_part(const float* __restrict q, int H, int g, int d, const float* __restrict kc,
                 const float* __restrict vc, int64_t row, const int64_t* __restrict table, int64_t t0, int64_t t1,
                 int64_t bs, float scale, float* __restrict acc, float* __restrict m, float* __restrict z,
                 float* __restrict scores) {
    const int64_t n = t1 - t0;
    for (int64_t t = t0; t < t1; ++t) {
        const float* k = kc + (table[t / bs] * bs + t % bs) * row;
        for (int h = 0; h < H; ++h) {
            const float* qh = q + h * d;
            const float* kh = k + (h / g) * d;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int i = 0; i < d; ++i) s += qh[i] * kh[i];
            scores[h * n + (t - t0)] = s * scale;
        }
    }
    for (int h = 0; h < H; ++h) {
        float* sh = scores + h * n;
        const float mh = *std::max_element(sh, sh + n);
        float zh = 0.f;
#pragma omp simd reduction(+ : zh)
        for (int64_t t = 0; t < n; ++t) {
            sh[t] = exp_nonpositive(sh[t] - mh);
            zh += sh[t];
        }
        m[h] = mh;
        z[h] = zh;
        std::fill(acc + h * d, acc + (h + 1) * d, 0.f);
    }
    for (int64_t t = t0; t < t1; ++t) {
        const float* v = vc + (table[t / bs] * bs + t % bs) * row;
        for (int h = 0; h < H; ++h) {
            const float p = scores[h * n + (t - t0)];
            const float* vh = v + (h / g) * d;
            float* ah = acc + h * d;
#pragma omp simd
            for (int i = 0; i < d; ++i) ah[i] += p * vh[i];
        }
    }
}

constexpr int64_t kPart = 256;  // keys per work item, rounded down to whole blocks
// below this many (key, query head) pairs one thread does the call: waking a sleeping OpenMP
// thread (OMP_WAIT_POLICY=PASSIVE) cost 200-300 us on the 2-core machines this was measured on,
// more than the work (one thread: ~30 ns a pair)
constexpr int64_t kParallelPairs = 65536;

void need(bool ok, const std::string& what) {
    if (!ok) throw std::invalid_argument("paged_decode: " + what);
}

// q, out [T, H, D]; k_cache, v_cache [S, Hkv, D]; block_tables [B, nb]; rows, seq_lens [B].
// Sequence b's query is row rows[b] of q; it attends to its first seq_lens[b] cached tokens (the
// new token's key is already written) and its output goes to row rows[b] of out.
void paged_decode(const f32& q, const f32& k_cache, const f32& v_cache, const i64& block_tables, const i64& rows,
                  const i64& seq_lens, f32& out, int64_t block_size, double scale) {
    need(q.ndim() == 3 && out.ndim() == 3 && k_cache.ndim() == 3 && v_cache.ndim() == 3, "q, out and caches are 3-d");
    const int64_t T = q.shape(0), H = q.shape(1), D = q.shape(2);
    const int64_t S = k_cache.shape(0), Hkv = k_cache.shape(1);
    need(out.shape(0) == T && out.shape(1) == H && out.shape(2) == D, "out has q's shape");
    need(k_cache.shape(2) == D && v_cache.shape(0) == S && v_cache.shape(1) == Hkv && v_cache.shape(2) == D,
         "caches are [S, Hkv, D] alike with q's D");
    need(Hkv > 0 && H % Hkv == 0, "query heads are a multiple of kv heads");
    need(block_size > 0 && S % block_size == 0, "the pool is whole blocks");
    need(block_tables.ndim() == 2 && rows.ndim() == 1 && seq_lens.ndim() == 1, "tables 2-d, rows and lens 1-d");
    const int64_t B = rows.shape(0), nb = block_tables.shape(1);
    need(block_tables.shape(0) == B && seq_lens.shape(0) == B, "one table, row and length per sequence");
    const int64_t* bt = block_tables.data();
    const int64_t* r = rows.data();
    const int64_t* lens = seq_lens.data();
    for (int64_t b = 0; b < B; ++b) {
        need(r[b] >= 0 && r[b] < T, "rows within q");
        need(lens[b] >= 1 && lens[b] <= nb * block_size, "seq_lens within 1..nb * block_size");
        for (int64_t j = 0; j < (lens[b] + block_size - 1) / block_size; ++j)
            need(bt[b * nb + j] >= 0 && bt[b * nb + j] < S / block_size, "block ids within the pool");
    }
    const int g = int(H / Hkv), h = int(H), d = int(D);
    const float* qp = q.data();
    const float* kp = k_cache.data();
    const float* vp = v_cache.data();
    float* op = out.mutable_data();
    const float sc = float(scale);
    // work items: partitions of up to kPart keys (whole blocks), so a few long sequences still
    // keep every thread busy; each sequence's partitions are combined afterwards
    const int64_t part = std::max<int64_t>(1, kPart / block_size) * block_size;
    std::vector<int64_t> first(B + 1, 0);  // sequence b's partitions: first[b] .. first[b + 1] - 1
    for (int64_t b = 0; b < B; ++b) first[b + 1] = first[b] + (lens[b] + part - 1) / part;
    const int64_t P = first[B];
    std::vector<int64_t> seq_of(P);
    for (int64_t b = 0; b < B; ++b) std::fill(seq_of.begin() + first[b], seq_of.begin() + first[b + 1], b);
    std::vector<float> acc(size_t(P) * h * d), mx(size_t(P) * h), tot(size_t(P) * h);
    int64_t pairs = 0;
    for (int64_t b = 0; b < B; ++b) pairs += lens[b] * h;
    py::gil_scoped_release nogil;
#pragma omp parallel if (pairs >= kParallelPairs)
    {
        std::vector<float> scores(size_t(h) * part);
#pragma omp for schedule(dynamic)
        for (int64_t p = 0; p < P; ++p) {
            const int64_t b = seq_of[p], t0 = (p - first[b]) * part, t1 = std::min(lens[b], t0 + part);
            attend_part(qp + r[b] * h * d, h, g, d, kp, vp, Hkv * D, bt + b * nb, t0, t1, block_size, sc,
                        acc.data() + p * h * d, mx.data() + p * h, tot.data() + p * h, scores.data());
        }
#pragma omp for
        for (int64_t b = 0; b < B; ++b) {
            for (int hh = 0; hh < h; ++hh) {
                float top = -INFINITY, total = 0.f;
                for (int64_t p = first[b]; p < first[b + 1]; ++p) top = std::max(top, mx[p * h + hh]);
                float* o = op + (r[b] * h + hh) * d;
                std::fill(o, o + d, 0.f);
                for (int64_t p = first[b]; p < first[b + 1]; ++p) {
                    const float w = std::exp(mx[p * h + hh] - top);
                    total += w * tot[p * h + hh];
                    const float* a = acc.data() + (p * h + hh) * d;
                    for (int i = 0; i < d; ++i) o[i] += w * a[i];
                }
                const float inv = 1.f / total;
                for (int i = 0; i < d; ++i) o[i] *= inv;
            }
        }
    }
}

}  // namespace

PYBIND11_MODULE(_C, m) {
    m.doc() = "Native paged decode attention (see attention.py for the torch path it must match)";
    m.def("paged_decode", &paged_decode, py::arg("q").noconvert(), py::arg("k_cache").noconvert(),
          py::arg("v_cache").noconvert(), py::arg("block_tables").noconvert(), py::arg("rows").noconvert(),
          py::arg("seq_lens").noconvert(), py::arg("out").noconvert(), py::arg("block_size"), py::arg("scale"));
}
