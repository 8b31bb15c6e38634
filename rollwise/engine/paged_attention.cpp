// Paged attention reading keys and values in place from the block pool. The torch path in
// attention.py gathers every sequence's blocks into a padded copy before SDPA; for a few queries per
// sequence that copy moves more memory than the attention reads. Here keys are read where they
// lie, in partitions of whole blocks (flash-decoding: each partition keeps its max score and sum;
// a query's partitions are combined at the end), by tiles of up to 16 queries of a sequence that
// share each key's loads (prefill chunks run as fast as SDPA's tiles). Each query sees its
// sequence's first `prefix` keys and, of the next 64, those its mask names (tree drafts: the
// ancestors). What a query computes depends only on the keys it sees, in an order fixed by the
// source, not by its tile or batch, so a row gives the same bits in a prefill chunk, a decode step
// or a draft chain: seeded sampling stays reproducible with prefix caching and chunked prefill.
// attention.py's torch path is the test oracle.
#include <iterator>
#include <type_traits>
#include <vector>

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

// The same for head sizes of C x 16 floats, written with explicit 16-float vectors (GCC vector
// extensions: zmm on x86-64-v4, pairs of ymm on v3) so that the order of every sum is the code's,
// not the compiler's:
// - q . k: each of the 16 lanes sums its C products in order (one multiply, then multiply-adds),
//   then the 16 lanes are added as a tree (lane j + lane j+8, then + 4, + 2, + 1). The trees of 16
//   keys run together, as a transpose-and-add of their 16 vectors: about 3 instructions a key
//   instead of a horizontal sum each (the loop above: ~8).
// - p v: each (query, head) pair's accumulator, added to in key order (in registers over each
//   block of 16 keys).
// A pair's arithmetic is this code's whatever tile or group it falls in (the tests check the bits
// of rows alone, in chunks and in draft chains), so rows agree bit for bit across batches as above.

// sums[t] = the lane tree of x[t], for 16 vectors
ROLLWISE_INLINE v16 tree_sums(v16* x) {
    constexpr i16v lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    constexpr i16v hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    constexpr i16v lo4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    constexpr i16v hi4 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    constexpr i16v lo2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    constexpr i16v hi2 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    constexpr i16v lo1 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    constexpr i16v hi1 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    // 16 vectors of one key each -> 8 of two keys' 8 partials -> 4 of four keys' 4 -> 2 of eight
    // keys' 2 -> one of sixteen sums, keys in order
    for (int i = 0; i < 8; ++i)
        x[i] = __builtin_shuffle(x[2 * i], x[2 * i + 1], lo8) + __builtin_shuffle(x[2 * i], x[2 * i + 1], hi8);
    for (int i = 0; i < 4; ++i)
        x[i] = __builtin_shuffle(x[2 * i], x[2 * i + 1], lo4) + __builtin_shuffle(x[2 * i], x[2 * i + 1], hi4);
    for (int i = 0; i < 2; ++i)
        x[i] = __builtin_shuffle(x[2 * i], x[2 * i + 1], lo2) + __builtin_shuffle(x[2 * i], x[2 * i + 1], hi2);
    return __builtin_shuffle(x[0], x[1], lo1) + __builtin_shuffle(x[0], x[1], hi1);
}

constexpr int64_t kTile = 16;  // queries per work item (the vector kernel)

// What a tile of queries needs: their rows of q, what each sees, and where each one's partials go.
struct Tile {
    const float* q;  // [T, H, d]
    const int64_t *rows, *prefix, *end, *first;
    const uint64_t* masks;
    int64_t i0, i1, p;  // queries i0 .. i1 - 1 (one sequence), partition p
};

// One (query, head) pair of a tile: the query's q row for the head, the pair's scores for the
// partition, how many of the partition's keys the query reads, what it sees.
struct Query {
    const float* q;
    float* scores;
    int64_t keys, prefix;
    uint64_t mask;
    bool sees(int64_t t) const { return t < prefix || ((mask >> (t - prefix)) & 1); }
};

// Scores of NQ pairs for the 16 keys from b (partition-relative; key t0 + b + j): each key's C
// vectors are loaded once for the NQ pairs. Every pair's q . k is the same sequence of operations
// whatever NQ (a multiply, then multiply-adds in order, then the lane tree).
template <int C, int NQ>
ROLLWISE_INLINE void scores_block(const Query* u, const float* __restrict kc, const int64_t* __restrict off, int kvd,
                                  int64_t t0, int64_t b, int64_t n, float scale) {
    const int nk = int(std::min<int64_t>(16, n - b));
    v16 qv[NQ][C], x[NQ][16];
    for (int r = 0; r < NQ; ++r)
        for (int c = 0; c < C; ++c) qv[r][c] = load16(u[r].q + 16 * c);
    for (int j = 0; j < 16; ++j) {
        if (j >= nk) {
            for (int r = 0; r < NQ; ++r) x[r][j] = v16{};
            continue;
        }
        const float* k = kc + off[b + j] + kvd;
        v16 kv[C];
        for (int c = 0; c < C; ++c) kv[c] = load16(k + 16 * c);
        for (int r = 0; r < NQ; ++r) {
            v16 s = qv[r][0] * kv[0];
            for (int c = 1; c < C; ++c) s += qv[r][c] * kv[c];
            x[r][j] = s;
        }
    }
    for (int r = 0; r < NQ; ++r) {
        const v16 sums = tree_sums(x[r]) * scale;
        const int mine = int(std::min<int64_t>(nk, u[r].keys - b));
        if (mine == 16 && t0 + b + 16 <= u[r].prefix) {  // all 16 seen (most of a causal chunk): one store
            std::memcpy(u[r].scores + b, &sums, sizeof sums);
            continue;
        }
        for (int j = 0; j < mine; ++j) u[r].scores[b + j] = u[r].sees(t0 + b + j) ? sums[j] : -INFINITY;
    }
}

// acc[r] += p v over the 16 keys from b, for NQ pairs, each in key order; a key all NQ see (the
// common case) loads its value once for them.
template <int C, int NQ>
ROLLWISE_INLINE void values_block(const Query* u, float* const* acc, const float* __restrict vc,
                                  const int64_t* __restrict off, int kvd, int64_t t0, int64_t b, int64_t n) {
    const int nk = int(std::min<int64_t>(16, n - b));
    int64_t all = t0 + b + nk;  // keys before this all NQ see and read
    for (int r = 0; r < NQ; ++r) all = std::min({all, u[r].prefix, t0 + u[r].keys});
    v16 a[NQ][C];
    for (int r = 0; r < NQ; ++r)
        for (int c = 0; c < C; ++c) a[r][c] = load16(acc[r] + 16 * c);
    for (int j = 0; j < nk; ++j) {
        const int64_t t = t0 + b + j;
        const float* v = vc + off[b + j] + kvd;
        if (t < all) {
            v16 vv[C];
            for (int c = 0; c < C; ++c) vv[c] = load16(v + 16 * c);
            for (int r = 0; r < NQ; ++r) {
                const float p = u[r].scores[b + j];
                for (int c = 0; c < C; ++c) a[r][c] += p * vv[c];
            }
        } else {
            for (int r = 0; r < NQ; ++r) {  // a hidden key's value may be anything, NaN included: skipped
                if (t >= t0 + u[r].keys || !u[r].sees(t)) continue;
                const float p = u[r].scores[b + j];
                for (int c = 0; c < C; ++c) a[r][c] += p * load16(v + 16 * c);
            }
        }
    }
    for (int r = 0; r < NQ; ++r) std::memcpy(acc[r], a[r], sizeof a[r]);
}

// Queries i0 .. i1 - 1 of one sequence against partition [t0, t0 + part) of its keys, every head, for
// head sizes of C x 16 floats: scores, softmax, values, each over blocks of 16 keys. For each kv
// head, its (query, head) pairs (the tile's queries times the g heads it serves) go in groups of G
// that share each key's loads: one at a time, a decode is bound by its loads from L2. Writes each
// pair's max score, sum and unnormalized output for the partition, as attend_part. u: scratch of
// (i1 - i0) * g entries; scores: of as many rows of `part` floats.
template <int C>
ROLLWISE_CLONES void attend_tile_v(const Tile& tl, int H, int g, const float* __restrict kc,
                                   const float* __restrict vc, int64_t row, const int64_t* __restrict table,
                                   int64_t part, int64_t bs, float scale, float* __restrict acc, float* __restrict m,
                                   float* __restrict z, float* __restrict scores, int64_t* __restrict off,
                                   Query* __restrict u, float** __restrict ak) {
    constexpr int d = 16 * C, G = C <= 2 ? 8 : C <= 4 ? 4 : 2;  // G x C accumulators stay in registers
    const int64_t t0 = tl.p * part, ne = (tl.i1 - tl.i0) * g;
    int64_t n = 0;  // keys of the partition any query of the tile reads
    for (int64_t i = tl.i0; i < tl.i1; ++i) n = std::max(n, std::min(tl.end[i], t0 + part) - t0);
    for (int64_t t = t0, base = 0, left = 0; t < t0 + n; ++t, --left) {  // each key's pool row, once
        if (left == 0) base = table[t / bs] * bs - t, left = bs;
        off[t - t0] = (base + t) * row;
    }
    for (int kh = 0; kh < H / g; ++kh) {
        const int kvd = kh * d;
        for (int64_t e = 0; e < ne; ++e) {  // (query, head) pairs, query by query
            const int64_t i = tl.i0 + e / g, h = kh * g + e % g, k = (tl.first[i] + tl.p) * H + h;
            u[e] = {tl.q + (tl.rows[i] * H + h) * d, scores + e * part, std::min(tl.end[i], t0 + part) - t0,
                    tl.prefix[i], tl.masks[i]};
            ak[e] = acc + k * d;
        }
        for (int64_t b = 0; b < n; b += 16) {
            int64_t e = 0;  // in groups of G, then 2, then 1
            for (; e + G <= ne; e += G) scores_block<C, G>(u + e, kc, off, kvd, t0, b, n, scale);
            for (; e + 2 <= ne; e += 2) scores_block<C, 2>(u + e, kc, off, kvd, t0, b, n, scale);
            for (; e < ne; ++e) scores_block<C, 1>(u + e, kc, off, kvd, t0, b, n, scale);
        }
        for (int64_t e = 0; e < ne; ++e) {  // softmax over the partition, per pair
            const int64_t ni = u[e].keys, k = (ak[e] - acc) / d;
            float* sh = u[e].scores;
            const float mh = max_of(sh, ni);
            float zh = 0.f;
            if (mh != -INFINITY) {
                for (int64_t t = 0; t < ni; ++t) sh[t] = exp_clamped(sh[t] - mh);
                for (int64_t t = std::max(u[e].prefix, t0); t < t0 + ni; ++t)  // hidden new keys: exactly 0
                    if (!u[e].sees(t)) sh[t - t0] = 0.f;
                v16 zv = {};  // the sum as 16 lanes, then lane by lane
                int64_t t = 0;
                for (; t + 16 <= ni; t += 16) zv += load16(sh + t);
                for (int j = 0; j < 16; ++j) zh += zv[j];
                for (; t < ni; ++t) zh += sh[t];
            } else {
                u[e].keys = 0;  // sees nothing here: weight 0 when partitions are combined
            }
            m[k] = mh;
            z[k] = zh;
            std::fill(ak[e], ak[e] + d, 0.f);
        }
        for (int64_t b = 0; b < n; b += 16) {
            int64_t e = 0;
            for (; e + G <= ne; e += G) values_block<C, G>(u + e, ak + e, vc, off, kvd, t0, b, n);
            for (; e + 2 <= ne; e += 2) values_block<C, 2>(u + e, ak + e, vc, off, kvd, t0, b, n);
            for (; e < ne; ++e) values_block<C, 1>(u + e, ak + e, vc, off, kvd, t0, b, n);
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
// attention.py derives it from the machine's measured linear policy.
void paged_attention(const f32& q, const f32& k_cache, const f32& v_cache, const i64& block_tables, const i64& rows_a,
                     const i64& seqs_a, const i64& prefix_a, const i64& masks_a, f32& out, int64_t block_size,
                     double scale, int64_t parallel_pairs) {
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
#pragma omp for schedule(dynamic)
        for (int64_t w = 0; w < W; ++w) {
            const Tile& tl = items[w];
            const int64_t* table = bt + seqs[tl.i0] * nb;
            const auto vector_tile = [&](auto c) {  // c: C as a type
                attend_tile_v<decltype(c)::value>(tl, h, g, kp, vp, Hkv * D, table, part, block_size, sc,
                                                  acc.data(), mx.data(), tot.data(), scores.data(), offsets.data(),
                                                  tile_pairs.data(), pair_acc.data());
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
