// Paged attention reading keys and values in place from the block pool. The torch path in
// attention.py gathers every sequence's blocks into a padded copy before SDPA; for a few queries per
// sequence that copy moves more memory than the attention reads. Here keys are read where they
// lie, in partitions of whole blocks (flash-decoding: each partition keeps its max score and sum;
// a query's partitions are combined at the end), by tiles of up to 16 queries of a sequence that
// share each key's loads (a prefill tile's (query, head) pairs 16 at a time in a vector's lanes,
// attention_tile.h: faster than SDPA on long chunks, 2026-12-07). Each query sees its
// sequence's first `prefix` keys and, of the next 64, those its mask names (tree drafts: the
// ancestors). What a query computes depends only on the keys it sees, in an order fixed by the
// source, not by its tile or batch, so a row gives the same bits in a prefill chunk, a decode step
// or a draft chain: seeded sampling stays reproducible with prefix caching and chunked prefill.
// attention.py's torch path is the test oracle.
#include <iterator>
#include <type_traits>
#include <vector>

#include "attention_tile.h"
#include "kernels.h"

namespace rollwise {
namespace {

// q . k over d floats
ROLLWISE_INLINE float dot(const float* __restrict q, const float* __restrict k, int d) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < d; ++i) s += q[i] * k[i];
    return s;
}

// The loop kernel, for head sizes other than 32, 64 and 128 (attend_tile_v below takes those): one
// partition [t0, t1) of one sequence's keys for one query, every head; reading a key row's heads
// together reads the row whole, in order. q: [H, d] (kv head h serves query heads h*g .. h*g+g-1);
// key and value row r at kc + r * row. Keys from `prefix` on are visible only where `mask` has
// their bit (key prefix + i: bit i). Writes per head the max score m (-inf if no key is visible),
// the sum z of exp(score - m) and the unnormalized sum acc [H, d] of exp(score - m) * value.
// scores: scratch of H * (t1 - t0) floats.
ROLLWISE_CLONES void attend_part(const float* __restrict q, int H, int g, int d, const float* __restrict kc,
                                 const float* __restrict vc, int64_t row, const int64_t* __restrict table,
                                 int64_t t0, int64_t t1, int64_t prefix, uint64_t mask, int64_t bs, float scale,
                                 float* __restrict acc, float* __restrict m, float* __restrict z,
                                 float* __restrict scores) {
    const int64_t n = t1 - t0;
    // key t's pool row: base + t within its block (t0 starts a block: partitions are whole blocks)
    for (int64_t t = t0, base = 0, left = 0; t < t1; ++t, --left) {
        if (left == 0) base = table[t / bs] * bs - t, left = bs;  // one division per block, not per key
        const bool seen = t < prefix || ((mask >> (t - prefix)) & 1);
        if (!seen) {
            for (int h = 0; h < H; ++h) scores[h * n + (t - t0)] = -INFINITY;
            continue;
        }
        const float* k = kc + (base + t) * row;
        for (int kv = 0, h = 0; kv < H / g; ++kv) {
            const float* kh = k + kv * d;
            for (int j = 0; j < g; ++j, ++h) scores[h * n + (t - t0)] = dot(q + h * d, kh, d) * scale;
        }
    }
    for (int h = 0; h < H; ++h) {
        float* sh = scores + h * n;
        const float mh = max_of(sh, n);
        float zh = 0.f;
        if (mh == -INFINITY) {  // nothing visible here: weight 0 when partitions are combined
            std::fill(sh, sh + n, 0.f);
        } else {
            for (int64_t t = 0; t < n; ++t) sh[t] = exp_clamped(sh[t] - mh);
            for (int64_t t = std::max(prefix, t0); t < t1; ++t)  // hidden new keys: exactly 0, not exp(-87)
                if (!((mask >> (t - prefix)) & 1)) sh[t - t0] = 0.f;
#pragma omp simd reduction(+ : zh)
            for (int64_t t = 0; t < n; ++t) zh += sh[t];
        }
        m[h] = mh;
        z[h] = zh;
        std::fill(acc + h * d, acc + (h + 1) * d, 0.f);
    }
    for (int64_t t = t0, base = 0, left = 0; t < t1; ++t, --left) {
        if (left == 0) base = table[t / bs] * bs - t, left = bs;
        if (!(t < prefix || ((mask >> (t - prefix)) & 1))) continue;
        const float* v = vc + (base + t) * row;
        for (int kv = 0, h = 0; kv < H / g; ++kv) {
            const float* vh = v + kv * d;
            for (int j = 0; j < g; ++j, ++h) {
                const float p = scores[h * n + (t - t0)];
                float* ah = acc + h * d;
#pragma omp simd
                for (int i = 0; i < d; ++i) ah[i] += p * vh[i];
            }
        }
    }
}

constexpr int64_t kPart = 256;  // keys per work item, rounded down to whole blocks

// Calls f(std::integral_constant<int, d / 16>) if d is one of the list's head sizes (the vector
// kernel's C as a type, one instantiation per size); false if none.
template <typename F, int... D>
bool with_vector_kernel(HeadSizes<D...>, int d, F&& f) {
    return ((d == D && (f(std::integral_constant<int, D / 16>{}), true)) || ...);
}

// Keys a query reads: its first `prefix` and, of the next 64, up to the last its mask names.
inline int64_t keys_end(int64_t prefix, uint64_t mask) { return prefix + (mask ? 64 - __builtin_clzll(mask) : 0); }

}  // namespace

// q, out [T, H, D]; k_cache, v_cache [S, Hkv, D]; block_tables [B, nb]; rows, seqs, prefix, masks
// [R]. Query i is row rows[i] of q, of sequence seqs[i] (non-decreasing); it sees that sequence's
// first prefix[i] cached keys (the step's new keys already written) and, of the next 64, those
// in masks[i] (causal rows: prefix = position + 1, mask 0; tree drafts: the ancestors); its
// output goes to row rows[i] of out. A query's result depends only on what it sees, not on the
// rest of the batch or the threads: runs that compute a row in different batches agree bit for bit.
// Below parallel_pairs (key, query head) pairs one thread does the call: waking a sleeping OpenMP
// thread (OMP_WAIT_POLICY=PASSIVE) can cost more than the work (one thread: 5-20 ns a pair);
// attention.py derives it from the machine's measured linear policy. lanes: a prefill tile's pairs
// 16 at a time in a vector's lanes (attention_tile.h); false: pair by pair, the same bits.
void paged_attention(const f32& q, const f32& k_cache, const f32& v_cache, const i64& block_tables, const i64& rows_a,
                     const i64& seqs_a, const i64& prefix_a, const i64& masks_a, f32& out, int64_t block_size,
                     double scale, int64_t parallel_pairs, bool lanes) {
    const auto check = [](bool ok, const std::string& what) { need(ok, "paged_attention: " + what); };
    check(q.ndim() == 3 && out.ndim() == 3 && k_cache.ndim() == 3 && v_cache.ndim() == 3, "q, out and caches are 3-d");
    const int64_t T = q.shape(0), H = q.shape(1), D = q.shape(2);
    const int64_t S = k_cache.shape(0), Hkv = k_cache.shape(1);
    check(out.shape(0) == T && out.shape(1) == H && out.shape(2) == D, "out has q's shape");
    check(k_cache.shape(2) == D && v_cache.shape(0) == S && v_cache.shape(1) == Hkv && v_cache.shape(2) == D,
          "caches are [S, Hkv, D] alike with q's D");
    check(Hkv > 0 && H % Hkv == 0, "query heads are a multiple of kv heads");
    check(block_size > 0 && S % block_size == 0, "the pool is whole blocks");
    check(block_tables.ndim() == 2 && rows_a.ndim() == 1 && seqs_a.ndim() == 1 && prefix_a.ndim() == 1 &&
          masks_a.ndim() == 1, "tables 2-d, the rest 1-d");
    const int64_t B = block_tables.shape(0), nb = block_tables.shape(1), R = rows_a.shape(0);
    check(seqs_a.shape(0) == R && prefix_a.shape(0) == R && masks_a.shape(0) == R,
          "one row, sequence, prefix and mask per query");
    const int64_t *bt = block_tables.data(), *rows = rows_a.data(), *seqs = seqs_a.data(), *prefix = prefix_a.data();
    const uint64_t* masks = reinterpret_cast<const uint64_t*>(masks_a.data());
    std::vector<int64_t> end(R), seq_end(B, 0);
    int64_t pairs = 0;  // (key, query head) pairs: the work
    for (int64_t i = 0; i < R; ++i) {
        check(rows[i] >= 0 && rows[i] < T, "rows within q");
        check(seqs[i] >= 0 && seqs[i] < B && (i == 0 || seqs[i] >= seqs[i - 1]), "seqs within tables, non-decreasing");
        check(prefix[i] >= 0, "prefix >= 0");
        end[i] = keys_end(prefix[i], masks[i]);
        check(end[i] >= 1, "every query sees a key");
        check(end[i] <= nb * block_size, "keys within the block table");
        seq_end[seqs[i]] = std::max(seq_end[seqs[i]], end[i]);
        pairs += end[i] * H;
    }
    for (int64_t b = 0; b < B; ++b)
        for (int64_t j = 0; j < (seq_end[b] + block_size - 1) / block_size; ++j)
            check(bt[b * nb + j] >= 0 && bt[b * nb + j] < S / block_size, "block ids within the pool");
    const int g = int(H / Hkv), h = int(H), d = int(D);
    // work items: (tile of up to kTile queries of one sequence, partition of up to kPart keys, whole
    // blocks, from key 0), ordered sequence by sequence, partition by partition, so a sequence's
    // queries read a partition while it is cached
    const int64_t part = std::max<int64_t>(1, kPart / block_size) * block_size;
    std::vector<int64_t> first(R + 1, 0);  // query i's partials: first[i] .. first[i + 1] - 1
    for (int64_t i = 0; i < R; ++i) first[i + 1] = first[i] + (end[i] + part - 1) / part;
    const float *qp = q.data(), *kp = k_cache.data(), *vp = v_cache.data();
    // head sizes 32, 64 and 128 (most models) take the vector kernel, in tiles; others the loop kernel
    const auto& vec = VectorHeadSizes::values;
    const int64_t tile = std::count(std::begin(vec), std::end(vec), d) ? kTile : 1;
    std::vector<Tile> items;
    for (int64_t s0 = 0; s0 < R;) {
        int64_t s1 = s0;
        while (s1 < R && seqs[s1] == seqs[s0]) ++s1;
        for (int64_t p = 0; p * part < seq_end[seqs[s0]]; ++p)
            for (int64_t i = s0; i < s1;) {
                if (p >= first[i + 1] - first[i]) { ++i; continue; }
                int64_t j = i + 1;  // a run of queries that read partition p
                while (j < s1 && j - i < tile && p < first[j + 1] - first[j]) ++j;
                items.push_back({qp, rows, prefix, end.data(), first.data(), masks, i, j, p});
                i = j;
            }
        s0 = s1;
    }
    const int64_t P = first[R], W = int64_t(items.size());
    std::vector<float> acc(size_t(P) * h * d), mx(size_t(P) * h), tot(size_t(P) * h);
    float* op = out.mutable_data();
    const float sc = float(scale);
    py::gil_scoped_release nogil;
#pragma omp parallel if (pairs >= parallel_pairs)
    {
        FlushDenormals ftz;
        std::vector<float> scores(size_t(std::max<int64_t>(h, tile * g)) * part);
        std::vector<int64_t> offsets(part);
        std::vector<Query> tile_pairs(size_t(tile * g));
        std::vector<float*> pair_acc(size_t(tile * g));
        std::vector<float> q_lanes(size_t(tile * g * d));
#pragma omp for schedule(dynamic)
        for (int64_t w = 0; w < W; ++w) {
            const Tile& tl = items[w];
            const int64_t* table = bt + seqs[tl.i0] * nb;
            const auto vector_tile = [&](auto c) {  // c: C as a type
                attend_tile_v<decltype(c)::value>(tl, h, g, kp, vp, Hkv * D, table, part, block_size, sc,
                                                  acc.data(), mx.data(), tot.data(), scores.data(), offsets.data(),
                                                  tile_pairs.data(), pair_acc.data(), q_lanes.data(), lanes);
            };
            if (!with_vector_kernel(VectorHeadSizes{}, d, vector_tile)) {
                const int64_t i = tl.i0, t0 = tl.p * part, k = first[i] + tl.p;
                attend_part(qp + rows[i] * h * d, h, g, d, kp, vp, Hkv * D, table, t0, std::min(end[i], t0 + part),
                            prefix[i], masks[i], block_size, sc, acc.data() + k * h * d, mx.data() + k * h,
                            tot.data() + k * h, scores.data());
            }
        }
#pragma omp for
        for (int64_t i = 0; i < R; ++i) {
            for (int hh = 0; hh < h; ++hh) {
                float top = -INFINITY, total = 0.f;
                for (int64_t k = first[i]; k < first[i + 1]; ++k) top = std::max(top, mx[k * h + hh]);
                float* o = op + (rows[i] * h + hh) * d;
                std::fill(o, o + d, 0.f);
                for (int64_t k = first[i]; k < first[i + 1]; ++k) {
                    const float w = std::exp(mx[k * h + hh] - top);  // 0 for a partition it sees none of
                    total += w * tot[k * h + hh];
                    const float* a = acc.data() + (k * h + hh) * d;
                    for (int j = 0; j < d; ++j) o[j] += w * a[j];
                }
                const float inv = 1.f / total;
                for (int j = 0; j < d; ++j) o[j] *= inv;
            }
        }
    }
}

}  // namespace rollwise
