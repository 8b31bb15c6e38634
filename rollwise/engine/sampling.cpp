// Sampling's inverse CDF without the [B, V] float64 cumulative sum: the torch twin, sampler.py's
// inverse_cdf, converts a batch-64 step's probabilities at a 152k vocabulary to 78 MB of float64 and
// scans them (~80 ms on 2 cores); this reads them once (and one block of 256 again) and keeps a
// running sum a block, a few KB a row. It adds in the same order as torch's cumsum (one float64
// accumulator, left to right), so it picks the same token bit for bit: the twin stays its oracle.
#include <vector>

#include "kernels.h"

namespace rollwise {
namespace {

constexpr int64_t kBlock = 256;  // a running sum is kept at the end of every block of the row

// The first token whose running sum exceeds u * total, at most the token where the sum last grew
// (searchsorted(cdf, total): a token of probability 0 is never drawn).
int64_t inverse_cdf_row(const float* p, int64_t V, double u, std::vector<double>& ends) {
    ends.clear();
    double acc = 0.0;
    int64_t last = 0;  // where the running sum last changed; 0 if it never does (searchsorted's answer then)
    for (int64_t s = 0; s < V; s += kBlock) {
        for (int64_t i = s; i < std::min(s + kBlock, V); ++i) {
            const double next = acc + double(p[i]);
            last = next != acc ? i : last;
            acc = next;
        }
        ends.push_back(acc);
    }
    const double target = u * acc;
    int64_t b = 0;  // the first block whose running sum at its end exceeds the target
    while (b < int64_t(ends.size()) && !(ends[b] > target)) ++b;
    if (b == int64_t(ends.size())) return last;  // u * total rounded up to the total
    double run = b ? ends[b - 1] : 0.0;  // the same sums again, from the block's start
    int64_t i = b * kBlock;
    for (; i < V; ++i) {
        run += double(p[i]);
        if (run > target) break;
    }
    return std::min(i, last);
}

}  // namespace

// out[b] = inverse_cdf_row(probs[b], u[b]) for probs [B, V] (unnormalized is fine), u [B] in [0, 1).
// Rows split across threads from two rows: a row is a chain of dependent float64 adds (~0.1-0.2 ms
// at a 152k vocabulary), more than a thread's wake-up.
void inverse_cdf(const f32& probs, const py::array_t<double, py::array::c_style>& u, i64& out) {
    need(probs.ndim() == 2 && u.ndim() == 1 && out.ndim() == 1, "inverse_cdf: probs [B, V], u [B] and out [B]");
    const int64_t B = probs.shape(0), V = probs.shape(1);
    need(u.shape(0) == B && out.shape(0) == B && V > 0, "inverse_cdf: u and out of probs' B rows, V > 0");
    const float* pp = probs.data();
    const double* up = u.data();
    int64_t* op = out.mutable_data();
    py::gil_scoped_release nogil;
#pragma omp parallel if (B >= 2 && B * V >= (1 << 16))
    {
        std::vector<double> ends;
        ends.reserve(V / kBlock + 1);
#pragma omp for
        for (int64_t b = 0; b < B; ++b) op[b] = inverse_cdf_row(pp + b * V, V, up[b], ends);
    }
}

}  // namespace rollwise
