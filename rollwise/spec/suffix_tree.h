// The depth-limited suffix tree of rollwise.spec (the Python file suffix_tree.py is its oracle).
//
// The tree is the trie of every substring of up to max_depth tokens, with occurrence counts, stored
// path-compressed: a record holds a run of trie positions that have one child each and the same
// count, and spells its label out of a stored sequence that contains the whole path from the root
// (a record is 40 bytes whatever its length: the tau-bench text has 7.5 trie positions per token at
// depth 24 but 0.68 records, 61 bytes per token in all against 292 uncompressed). Occurrences of a sequence's suffixes always end at record ends (a
// position where one ends has a higher count than its child), so appending a token moves each of
// them one record down: into a child whose first position is split off if longer, or by growing a
// leaf only it passes through. A record whose only child has its count is merged into the child.
// Records refer to each other by index in one arena and are reused; children form a doubly linked
// sibling list, and a record with many children also indexes them in one shared hash map
// (parent, token) -> child. Each record keeps its most frequent child, so a chain draft costs O(1)
// per token, and appending a token O(max_depth).
#pragma once
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <queue>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace py = pybind11;

namespace rollwise_spec {

constexpr int32_t kIndexThreshold = 8;  // records with more children are indexed in the hash map

struct Node {
    int32_t token = -1, count = 0, parent = -1, best = -1;  // token: the label's first
    int32_t first = -1, next = -1, prev = -1;  // first child; siblings
    int32_t store = -1, end = 0;  // the label is stores_[store].toks[end - (depth - parent's depth), end)
    int16_t depth = 0;  // of the label's last position
    int16_t num_kids = 0;  // saturates at kIndexThreshold + 1 once indexed
};

struct Store {  // a sequence's tokens, kept while a record spells its label from them
    std::vector<int32_t> toks;
    int32_t refs = 0;
    bool live = false;  // the sequence is still in the tree
};

struct Draft {
    std::vector<int32_t> tokens, parents;
    std::vector<double> probs;
    double score = 0.0;
    int match_len = 0;
    std::tuple<std::vector<int32_t>, std::vector<int32_t>, std::vector<double>, double, int> tuple() const {
        return {tokens, parents, probs, score, match_len};
    }
};

inline uint64_t edge_key(int32_t parent, int32_t token) { return ((uint64_t)(uint32_t)parent << 32) | (uint32_t)token; }

class SuffixTree {
  public:
    explicit SuffixTree(int max_depth) : max_depth_(max_depth) {
        if (max_depth < 1 || max_depth > 32767) throw std::invalid_argument("max_depth must be in [1, 32767]");
        nodes_.emplace_back();  // the root
    }

    int max_depth() const { return max_depth_; }
    int64_t num_nodes() const { return num_nodes_; }  // trie positions (the uncompressed tree's nodes)
    int64_t num_records() const { return (int64_t)nodes_.size() - 1 - (int64_t)free_.size(); }
    int64_t num_stores() const { return (int64_t)(stores_.size() - free_stores_.size()); }  // live + still spelling
    bool has_seq(int64_t id) const { return seqs_.count(id) > 0; }

    void append(int64_t seq_id, const std::vector<int32_t>& tokens) {
        auto it = seqs_.find(seq_id);
        if (it == seqs_.end()) it = seqs_.emplace(seq_id, new_store()).first;
        const int32_t s = it->second;
        auto& active = active_[seq_id];
        std::vector<int32_t> next;
        for (int32_t t : tokens) {
            stores_[s].toks.push_back(t);
            next.clear();
            advance(0, t, s, next);
            for (int32_t n : active) advance(n, t, s, next);
            nodes_[0].count += 1;
            active.swap(next);
        }
    }

    void remove(int64_t seq_id) {
        auto it = seqs_.find(seq_id);
        if (it == seqs_.end()) return;
        const int32_t s = it->second;
        seqs_.erase(it);
        active_.erase(seq_id);
        const std::vector<int32_t>& seq = stores_[s].toks;
        const size_t n = seq.size();
        std::vector<int32_t> dead, lowered;
        std::unordered_set<int32_t> touched;
        for (size_t i = 0; i < n; ++i) {  // every suffix ends at a record end: whole records lose one
            int32_t node = 0;
            size_t j = i;
            const size_t stop = std::min(n, i + (size_t)max_depth_);
            while (j < stop) {
                const int32_t c = child(node, seq[j]);
                j += nodes_[c].depth - nodes_[node].depth;
                if (--nodes_[c].count == 0) dead.push_back(c);
                else lowered.push_back(c);
                touched.insert(node);
                node = c;
            }
        }
        nodes_[0].count -= (int32_t)n;
        for (int32_t d : dead) {  // a dead record's subtree is dead too: detach the topmost ones only
            const int32_t p = nodes_[d].parent;  // -1 once freed with an ancestor's subtree
            if (p == 0 || (p > 0 && nodes_[p].count > 0)) {
                drop_child(p, d);
                free_subtree(d);
            }
        }
        for (int32_t p : touched)
            if (alive(p)) rescan(p);
        for (int32_t x : touched) merge_down(x);
        for (int32_t x : lowered) merge_down(x);
        stores_[s].live = false;
        release(s, 0);
    }

    // drafting and the integrity check: suffix_tree_read.h
    Draft speculate(const std::vector<int32_t>& context, int max_spec, double alpha, double offset, double min_prob,
                    bool tree) const;
    void check_integrity() const;
    py::dict path_counts() const;  // every trie position, as the uncompressed tree has them

    size_t memory_bytes() const {
        size_t b = nodes_.capacity() * sizeof(Node) + free_.capacity() * 4 + index_.size() * 32 +
                   index_.bucket_count() * 8 + stores_.capacity() * sizeof(Store);
        for (auto& st : stores_) b += st.toks.capacity() * 4;
        for (auto& kv : active_) b += kv.second.capacity() * 4 + 64;
        return b + seqs_.size() * 32;
    }

  private:
    struct Pos {  // a trie position: the record holding it and its depth
        int32_t node, depth;
    };

    int32_t at(int32_t n, int d) const {  // the token at depth d of record n's label
        const Node& x = nodes_[n];
        return stores_[x.store].toks[x.end - (x.depth - d) - 1];
    }

    bool alive(int32_t n) const { return n == 0 || nodes_[n].parent >= 0; }

    Pos step(Pos p, int32_t tok) const {
        if (p.depth < nodes_[p.node].depth) return at(p.node, p.depth + 1) == tok ? Pos{p.node, p.depth + 1} : Pos{-1, 0};
        const int32_t c = child(p.node, tok);
        return c < 0 ? Pos{-1, 0} : Pos{c, p.depth + 1};
    }

    bool better(int32_t a, int32_t b) const {  // more frequent, ties to the smaller token
        const Node &x = nodes_[a], &y = nodes_[b];
        return x.count > y.count || (x.count == y.count && x.token < y.token);
    }

    template <class F>
    void for_each_child(int32_t n, F&& f) const {
        for (int32_t c = nodes_[n].first; c >= 0; c = nodes_[c].next) f(nodes_[c].token, c);
    }

    int32_t child(int32_t n, int32_t tok) const {
        const Node& node = nodes_[n];
        if (node.num_kids > kIndexThreshold) {
            auto it = index_.find(edge_key(n, tok));
            return it == index_.end() ? -1 : it->second;
        }
        for (int32_t c = node.first; c >= 0; c = nodes_[c].next)
            if (nodes_[c].token == tok) return c;
        return -1;
    }

    // One occurrence ending at record n's end takes token t (of store s, just appended).
    void advance(int32_t n, int32_t t, int32_t s, std::vector<int32_t>& next) {
        if (nodes_[n].depth >= max_depth_) return;
        const int32_t end = (int32_t)stores_[s].toks.size();
        int32_t c = child(n, t);
        if (c < 0 && n != 0 && nodes_[n].first < 0 && nodes_[n].count == 1) {  // a leaf only it passes: grow it
            Node& x = nodes_[n];
            repoint(n, s, end);
            x.depth += 1;
            ++num_nodes_;
            next.push_back(n);
            return;
        }
        if (c < 0) {
            c = new_node(n, t, s, end);
            ++num_nodes_;
        } else if (nodes_[c].depth > nodes_[n].depth + 1) {
            c = split(c);
        }
        nodes_[c].count += 1;
        repoint(c, s, end);  // the latest sequence to pass spells it: stores of removed ones are let go sooner
        const int32_t b = nodes_[n].best;
        if (b < 0 || better(c, b)) nodes_[n].best = c;
        if (n != 0 && nodes_[n].count == nodes_[c].count) merge_into_child(n);
        next.push_back(c);
    }

    template <class T>
    static int32_t take(std::vector<T>& arena, std::vector<int32_t>& free) {  // a freed slot, or a new one
        if (free.empty()) {
            arena.emplace_back();
            return (int32_t)arena.size() - 1;
        }
        const int32_t id = free.back();
        free.pop_back();
        return id;
    }

    int32_t new_store() {
        const int32_t s = take(stores_, free_stores_);
        stores_[s].live = true;
        return s;
    }

    void release(int32_t s, int32_t refs) {  // a record lets go of store s
        Store& st = stores_[s];
        st.refs -= refs;
        if (st.refs == 0 && !st.live) {
            std::vector<int32_t>().swap(st.toks);
            free_stores_.push_back(s);
        }
    }

    void repoint(int32_t n, int32_t s, int32_t end) {
        Node& x = nodes_[n];
        if (x.store != s) {
            ++stores_[s].refs;
            const int32_t old = x.store;
            x.store = s;
            release(old, 1);
        }
        x.end = end;
    }

    int32_t alloc() {
        const int32_t id = take(nodes_, free_);
        nodes_[id] = Node();
        return id;
    }

    int32_t new_node(int32_t parent, int32_t tok, int32_t s, int32_t end) {  // a leaf of one position
        const int32_t id = alloc();
        Node& c = nodes_[id];
        Node& p = nodes_[parent];
        c.token = tok, c.parent = parent, c.depth = (int16_t)(p.depth + 1), c.store = s, c.end = end;
        ++stores_[s].refs;
        c.next = p.first;
        if (p.first >= 0) nodes_[p.first].prev = id;
        p.first = id;
        if (p.num_kids > kIndexThreshold) {
            index_[edge_key(parent, tok)] = id;
        } else if (++p.num_kids > kIndexThreshold) {  // becomes wide: index all its children
            for (int32_t k = p.first; k >= 0; k = nodes_[k].next) index_[edge_key(parent, nodes_[k].token)] = k;
        }
        return id;
    }

    void replace_child(int32_t p, int32_t old, int32_t neu) {  // neu takes old's place (same first token)
        Node &o = nodes_[old], &x = nodes_[neu], &pp = nodes_[p];
        x.parent = p, x.prev = o.prev, x.next = o.next;
        (o.prev >= 0 ? nodes_[o.prev].next : pp.first) = neu;
        if (o.next >= 0) nodes_[o.next].prev = neu;
        if (pp.num_kids > kIndexThreshold) index_[edge_key(p, o.token)] = neu;
        if (pp.best == old) pp.best = neu;
    }

    int32_t split(int32_t c) {  // c's first position becomes a record of its own, above c
        const int32_t u = alloc();
        const Node cc = nodes_[c];
        const int32_t p = cc.parent;
        Node& x = nodes_[u];
        x.token = cc.token, x.count = cc.count, x.depth = (int16_t)(nodes_[p].depth + 1);
        x.store = cc.store, x.end = cc.end - (cc.depth - x.depth);
        ++stores_[cc.store].refs;
        replace_child(p, c, u);
        Node& y = nodes_[c];
        y.parent = u, y.prev = y.next = -1, y.token = at(c, x.depth + 1);
        nodes_[u].first = nodes_[u].best = c;
        nodes_[u].num_kids = 1;
        return u;
    }

    void merge_into_child(int32_t n) {  // n's only child, of n's count, takes n's positions and place
        const int32_t c = nodes_[n].first;
        if (nodes_[n].num_kids > kIndexThreshold) index_.erase(edge_key(n, nodes_[c].token));  // was wide
        nodes_[c].token = nodes_[n].token;
        replace_child(nodes_[n].parent, n, c);
        release(nodes_[n].store, 1);
        nodes_[n] = Node();
        free_.push_back(n);
    }

    void merge_down(int32_t x) {  // after a removal: merge x into its only child if their counts agree
        if (x == 0 || !alive(x)) return;
        const int32_t c = nodes_[x].first;
        if (c >= 0 && nodes_[c].next < 0 && nodes_[c].count == nodes_[x].count) merge_into_child(x);
    }

    void drop_child(int32_t p, int32_t c) {
        Node &node = nodes_[p], &x = nodes_[c];
        (x.prev >= 0 ? nodes_[x.prev].next : node.first) = x.next;
        if (x.next >= 0) nodes_[x.next].prev = x.prev;
        if (node.num_kids > kIndexThreshold) index_.erase(edge_key(p, x.token));
        else --node.num_kids;
    }

    void free_subtree(int32_t root) {
        std::vector<std::pair<int32_t, int32_t>> stack{{root, nodes_[nodes_[root].parent].depth}};  // (record, parent's depth)
        while (!stack.empty()) {
            auto [n, above] = stack.back();
            stack.pop_back();
            for_each_child(n, [&](int32_t tok, int32_t c) {
                stack.push_back({c, nodes_[n].depth});
                if (nodes_[n].num_kids > kIndexThreshold) index_.erase(edge_key(n, tok));
            });
            num_nodes_ -= nodes_[n].depth - above;
            release(nodes_[n].store, 1);
            nodes_[n] = Node();
            free_.push_back(n);
        }
    }

    void rescan(int32_t n) {
        int32_t top = -1;
        for_each_child(n, [&](int32_t, int32_t c) {
            if (top < 0 || better(c, top)) top = c;
        });
        nodes_[n].best = top;
    }

    void chain_draft(Pos pos, int budget, double min_prob, Draft& d) const;
    void tree_draft(Pos start, int budget, double min_prob, Draft& d) const;

    int max_depth_;
    std::vector<Node> nodes_;
    std::vector<int32_t> free_;
    std::unordered_map<uint64_t, int32_t> index_;  // (parent, token) -> child, for wide records only
    std::vector<Store> stores_;
    std::vector<int32_t> free_stores_;
    std::unordered_map<int64_t, int32_t> seqs_;  // sequence id -> its store
    std::unordered_map<int64_t, std::vector<int32_t>> active_;  // per sequence: records its suffixes end at
    int64_t num_nodes_ = 0;
};

}  // namespace rollwise_spec
