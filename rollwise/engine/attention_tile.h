// The attention's vector kernel, for head sizes of C x 16 floats (paged_attention.cpp dispatches to
// it; its contract is there).
#pragma once
#include <vector>

#include "kernels.h"

namespace rollwise {
namespace {

// Written with explicit 16-float vectors (GCC vector extensions: zmm on x86-64-v4, pairs of ymm on
// v3) so that the order of every sum is the code's, not the compiler's:
// - q . k: each of the 16 lanes sums its C products in order (one multiply, then multiply-adds),
//   then the 16 lanes are added as a tree (lane j + lane j+8, then + 4, + 2, + 1). The trees of 16
//   keys run together, as a transpose-and-add of their 16 vectors: about 3 instructions a key
//   instead of a horizontal sum each (the loop kernel: ~8).
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
// partition (in lanes: its block's, [part][16]), how many of the partition's keys the query reads,
// what it sees.
struct Query {
    const float* q;
    float* scores;
    int64_t keys, prefix;
    uint64_t mask;
    bool sees(int64_t t) const { return t < prefix || ((mask >> (t - prefix)) & 1); }
    // key t of the partition from t0 is one it reads and sees
    bool reads(int64_t t, int64_t t0) const { return t < keys && sees(t0 + t); }
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

// The same scores and softmax for 16 pairs at once (a prefill tile's), pair j in lane j of every
// vector, with each pair's arithmetic the same as above lane by lane: a lane sum P_l (q[l] k[l], then
// + q[16 + l] k[16 + l], ... in order) is a multiply-add of a row of the pairs' transposed q by
// element l of the key, and the tree's adds (P_l + P_l+8, then + 4, + 2, + 1) are vector adds: no
// shuffles. Scores lie at step 16 (key t of lane j at st[16 t + j]). The tests check the bits against
// decode rows, which run the per-pair code.

// Node (l, W) of the lane tree for K keys: the lane sum P_l at W = 16, else node (l, 2W) + node (l + W, 2W).
// qt: the pairs' q rows transposed, [d][16]; k[r]: key r's row.
template <int C, int K, int W>
ROLLWISE_INLINE void lane_tree(const float* __restrict qt, const float* const* k, int l, v16* out) {
    if constexpr (W == 16) {
        const v16 q0 = load16(qt + 16 * l);
        for (int r = 0; r < K; ++r) out[r] = q0 * k[r][l];
        for (int c = 1; c < C; ++c) {
            const v16 qc = load16(qt + 16 * (16 * c + l));
            for (int r = 0; r < K; ++r) out[r] += qc * k[r][16 * c + l];
        }
    } else {
        v16 hi[K];
        lane_tree<C, K, 2 * W>(qt, k, l, out);
        lane_tree<C, K, 2 * W>(qt, k, l + W, hi);
        for (int r = 0; r < K; ++r) out[r] += hi[r];
    }
}

// Scores of 16 pairs u[0 .. 16) for the 16 keys from b into st, as scores_block writes them: -inf
// where a pair does not read or see the key.
template <int C>
ROLLWISE_INLINE void scores_lanes(const Query* u, const float* __restrict qt, float* __restrict st,
                                  const float* __restrict kc, const int64_t* __restrict off, int kvd, int64_t t0,
                                  int64_t b, int64_t n, float scale) {
    constexpr int K = 4;  // keys at a time: 4 x 4 tree nodes and C rows of qt stay in registers
    int64_t seen = t0 + n;  // keys before this all 16 see
    for (int j = 0; j < 16; ++j) seen = std::min(seen, u[j].prefix);
    const int64_t e = std::min(b + 16, n);
    for (int64_t t = b; t < e; t += K) {
        const float* k[K];
        for (int r = 0; r < K; ++r) k[r] = kc + off[std::min(t + r, e - 1)] + kvd;
        v16 s[K];
        lane_tree<C, K, 1>(qt, k, 0, s);
        for (int r = 0; r < K && t + r < e; ++r) {
            v16 x = s[r] * scale;
            if (t0 + t + r >= seen)
                for (int j = 0; j < 16; ++j)
                    if (!u[j].reads(t + r, t0)) x[j] = -INFINITY;
            std::memcpy(st + 16 * (t + r), &x, sizeof x);
        }
    }
}

// Their softmax over the partition (keys [0, n)), as attend_tile_v's loop computes it pair by pair:
// st's scores become weights (exactly 0 for a key hidden from a pair); returns each pair's max score
// and sum, and a pair that sees no key here reads none (keys = 0, sum 0).
ROLLWISE_INLINE void softmax_lanes(Query* u, float* __restrict st, int64_t t0, int64_t n, v16& mx, v16& zs) {
    v16 ni, lo;  // per pair: the keys it reads, and where its sum's whole blocks of 16 end
    int64_t seen = t0 + n, tail = n;
    for (int j = 0; j < 16; ++j) {
        ni[j] = float(u[j].keys), lo[j] = float(u[j].keys / 16 * 16);
        seen = std::min(seen, u[j].prefix), tail = std::min(tail, u[j].keys / 16 * 16);
    }
    const v16 none = v16{} - INFINITY;  // (one compare per select: two and-ed run lane by lane)
    mx = none;
    for (int64_t t = 0; t < n; ++t) {
        const v16 tv = v16{} + float(t), x = tv < ni ? load16(st + 16 * t) : none;
        mx = x > mx ? x : mx;
    }
    for (int64_t t = 0; t < n; ++t) {
        const v16 tv = v16{} + float(t), x = exp_clamped(load16(st + 16 * t) - mx);
        v16 w = tv < ni ? x : v16{};
        if (t0 + t >= seen)  // hidden new keys: exactly 0
            for (int j = 0; j < 16; ++j)
                if (!u[j].reads(t, t0)) w[j] = 0.f;
        std::memcpy(st + 16 * t, &w, sizeof w);
    }
    v16 zl[16] = {};  // the sum as 16 lanes of keys over whole blocks, then lane by lane, then the rest
    for (int64_t b = 0; b + 16 <= n; b += 16) {
        const auto whole = v16{} + float(b + 16) <= ni;
        for (int j = 0; j < 16; ++j) zl[j] = whole ? zl[j] + load16(st + 16 * (b + j)) : zl[j];
    }
    zs = v16{};
    for (int j = 0; j < 16; ++j) zs += zl[j];
    for (int64_t t = tail; t < n; ++t) {
        const v16 tv = v16{} + float(t);
        const v16 w = tv < ni ? load16(st + 16 * t) : v16{};
        zs = tv >= lo ? zs + w : zs;
    }
    for (int j = 0; j < 16; ++j)
        if (mx[j] == -INFINITY) zs[j] = 0.f, u[j].keys = 0;  // sees nothing here: weight 0 when combined
}

// Their outputs for the partition (keys [0, n), weights in st) into acc[j], as values_block adds them
// (each pair's sum in key order, one multiply-add a key, keys a pair does not see skipped), with the
// pairs in lanes: a vector of 16 weights times element i of the value, for 16 elements at a time.
template <int C>
ROLLWISE_INLINE void values_lanes(const Query* u, float* const* acc, const float* __restrict st,
                                  const float* __restrict vc, const int64_t* __restrict off, int kvd, int64_t t0,
                                  int64_t n) {
    int64_t all = t0 + n;  // keys before this all 16 see and read
    for (int j = 0; j < 16; ++j) all = std::min({all, u[j].prefix, t0 + u[j].keys});
    for (int c = 0; c < 16 * C; c += 16) {
        v16 a[16] = {};  // a[i]: element c + i of the 16 outputs
        int64_t t = 0;
        for (; t0 + t < all; ++t) {
            const v16 w = load16(st + 16 * t);
            const float* v = vc + off[t] + kvd + c;
            for (int i = 0; i < 16; ++i) a[i] += w * v[i];
        }
        for (; t < n; ++t) {
            i16v on;
            for (int j = 0; j < 16; ++j) on[j] = u[j].reads(t, t0) ? -1 : 0;
            const v16 w = load16(st + 16 * t);
            const float* v = vc + off[t] + kvd + c;
            for (int i = 0; i < 16; ++i) a[i] = on ? a[i] + w * v[i] : a[i];  // a hidden value may be NaN
        }
        for (int i = 0; i < 16; ++i)
            for (int j = 0; j < 16; ++j) acc[j][c + i] = a[i][j];
    }
}

// Queries i0 .. i1 - 1 of one sequence against partition [t0, t0 + part) of its keys, every head, for
// head sizes of C x 16 floats: scores, softmax, values, each over blocks of 16 keys. For each kv
// head, its (query, head) pairs (the tile's queries times the g heads it serves) go in groups of G
// that share each key's loads: one at a time, a decode is bound by its loads from L2; a prefill
// tile's go 16 at a time in the lanes of a vector (scores_lanes), the rest in groups. Writes each
// pair's max score, sum and unnormalized output for the partition, as attend_part. u: scratch of
// (i1 - i0) * g entries; scores: of as many rows of `part` floats; qt: of as many rows of d floats.
// lanes false: every pair in groups (the same bits).
template <int C>
ROLLWISE_CLONES void attend_tile_v(const Tile& tl, int H, int g, const float* __restrict kc,
                                   const float* __restrict vc, int64_t row, const int64_t* __restrict table,
                                   int64_t part, int64_t bs, float scale, float* __restrict acc, float* __restrict m,
                                   float* __restrict z, float* __restrict scores, int64_t* __restrict off,
                                   Query* __restrict u, float** __restrict ak, float* __restrict qt, bool lanes) {
    constexpr int d = 16 * C, G = C <= 2 ? 8 : C <= 4 ? 4 : 2;  // G x C accumulators stay in registers
    const int64_t t0 = tl.p * part, ne = (tl.i1 - tl.i0) * g, nv = lanes ? ne / 16 * 16 : 0;  // nv pairs in lanes
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
            const bool lane = e < nv;
            u[e] = {tl.q + (tl.rows[i] * H + h) * d, scores + (lane ? e / 16 * 16 : e) * part,
                    std::min(tl.end[i], t0 + part) - t0, tl.prefix[i], tl.masks[i]};
            ak[e] = acc + k * d;
            if (lane)
                for (int c = 0; c < d; ++c) qt[(e / 16 * d + c) * 16 + e % 16] = u[e].q[c];
        }
        for (int64_t b = 0; b < n; b += 16) {
            for (int64_t e = 0; e < nv; e += 16)
                scores_lanes<C>(u + e, qt + e * d, u[e].scores, kc, off, kvd, t0, b, n, scale);
            int64_t e = nv;  // in groups of G, then 2, then 1
            for (; e + G <= ne; e += G) scores_block<C, G>(u + e, kc, off, kvd, t0, b, n, scale);
            for (; e + 2 <= ne; e += 2) scores_block<C, 2>(u + e, kc, off, kvd, t0, b, n, scale);
            for (; e < ne; ++e) scores_block<C, 1>(u + e, kc, off, kvd, t0, b, n, scale);
        }
        for (int64_t e = 0; e < nv; e += 16) {
            v16 mv, zv;
            softmax_lanes(u + e, u[e].scores, t0, n, mv, zv);
            for (int j = 0; j < 16; ++j) {  // (values_lanes writes the outputs whole: no zero fill)
                const int64_t k = (ak[e + j] - acc) / d;
                m[k] = mv[j], z[k] = zv[j];
            }
        }
        for (int64_t e = nv; e < ne; ++e) {  // softmax over the partition, per pair
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
        for (int64_t e = 0; e < nv; e += 16) values_lanes<C>(u + e, ak + e, u[e].scores, vc, off, kvd, t0, n);
        for (int64_t b = 0; b < n; b += 16) {
            int64_t e = nv;
            for (; e + G <= ne; e += G) values_block<C, G>(u + e, ak + e, vc, off, kvd, t0, b, n);
            for (; e + 2 <= ne; e += 2) values_block<C, 2>(u + e, ak + e, vc, off, kvd, t0, b, n);
            for (; e < ne; ++e) values_block<C, 1>(u + e, ak + e, vc, off, kvd, t0, b, n);
        }
    }
}

}  // namespace
}  // namespace rollwise
