// The depth-limited suffix tree of rollwise.spec (the Python file suffix_tree.py is its oracle).
//
// Nodes live in one arena of 28-byte records and refer to each other by index; freed nodes are
// reused. Children form a sibling list; a node with many children is also indexed in one shared
// hash map (parent, token) -> child. Each node keeps its most frequent child, so appending a token
// costs O(max_depth) and a chain draft O(1) per drafted token.
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

constexpr int32_t kIndexThreshold = 8;  // nodes with more children are indexed in the hash map

struct Node {
    int32_t token = -1, count = 0, parent = -1, best = -1;
    int32_t first = -1, next = -1;  // first child; next sibling
    int16_t depth = 0;
    int16_t num_kids = 0;  // saturates at kIndexThreshold + 1 once indexed
};

inline uint64_t edge_key(int32_t parent, int32_t token) { return ((uint64_t)(uint32_t)parent << 32) | (uint32_t)token; }

using DraftTuple = std::tuple<std::vector<int32_t>, std::vector<int32_t>, std::vector<double>, double, int>;

struct Draft {
    std::vector<int32_t> tokens, parents;
    std::vector<double> probs;
    double score = 0.0;
    int match_len = 0;
    DraftTuple tuple() const { return {tokens, parents, probs, score, match_len}; }
};

class SuffixTree {
  public:
    explicit SuffixTree(int max_depth) : max_depth_(max_depth) {
        if (max_depth < 1) throw std::invalid_argument("max_depth must be >= 1");
        nodes_.emplace_back();  // the root
    }

    int max_depth() const { return max_depth_; }
    int64_t num_nodes() const { return num_nodes_; }
    bool has_seq(int64_t id) const { return seqs_.count(id) > 0; }

    void append(int64_t seq_id, const std::vector<int32_t>& tokens) {
        auto& seq = seqs_[seq_id];
        auto& active = active_[seq_id];
        std::vector<int32_t> next;
        for (int32_t t : tokens) {
            seq.push_back(t);
            next.clear();
            extend(0, t, next);
            for (int32_t n : active) extend(n, t, next);
            nodes_[0].count += 1;
            active.swap(next);
        }
    }

    void remove(int64_t seq_id) {
        auto it = seqs_.find(seq_id);
        if (it == seqs_.end()) return;
        std::vector<int32_t> seq = std::move(it->second);
        seqs_.erase(it);
        active_.erase(seq_id);
        std::vector<int32_t> dead;
        std::unordered_set<int32_t> touched;
        const size_t n = seq.size();
        for (size_t s = 0; s < n; ++s) {
            int32_t node = 0;
            for (size_t j = s; j < std::min(n, s + (size_t)max_depth_); ++j) {
                node = child(node, seq[j]);
                if (--nodes_[node].count == 0) dead.push_back(node);
                touched.insert(nodes_[node].parent);
            }
        }
        nodes_[0].count -= (int32_t)n;
        for (int32_t d : dead) {  // a dead node's subtree is dead too: detach the topmost ones only
            int32_t p = nodes_[d].parent;  // -1 once freed with an ancestor's subtree
            if (p == 0 || (p > 0 && nodes_[p].count > 0)) {
                drop_child(p, nodes_[d].token);
                free_subtree(d);
            }
        }
        for (int32_t p : touched)
            if (p == 0 || nodes_[p].count > 0) rescan(p);
    }

    Draft speculate(const std::vector<int32_t>& context, int max_spec, double alpha, double offset,
                    double min_prob, bool tree) const {
        Draft best, cur;
        const size_t len = std::min(context.size(), (size_t)max_depth_);
        const int32_t* ctx = context.data() + (context.size() - len);
        for (size_t m = 1; m <= len; ++m) {
            int32_t node = 0;
            for (size_t j = len - m; j < len; ++j) {
                node = child(node, ctx[j]);
                if (node < 0) return best;  // longer suffixes cannot match either
            }
            double b = alpha * (double)m + offset;
            int budget = b >= (double)max_spec ? max_spec : (int)b;
            if (budget <= 0) continue;
            cur.tokens.clear(), cur.parents.clear(), cur.probs.clear(), cur.score = 0.0;
            if (tree) tree_draft(node, budget, min_prob, cur);
            else chain_draft(node, budget, min_prob, cur);
            if (!cur.tokens.empty() && cur.score >= best.score) {
                std::swap(best, cur);
                best.match_len = (int)m;
            }
        }
        return best;
    }

    void check_integrity() const {
        int64_t reachable = 0;
        std::vector<int32_t> stack{0};
        while (!stack.empty()) {
            int32_t n = stack.back();
            stack.pop_back();
            const Node& node = nodes_[n];
            int32_t top = -1;
            for_each_child(n, [&](int32_t tok, int32_t c) {
                const Node& ch = nodes_[c];
                ++reachable;
                if (ch.token != tok || ch.parent != n || ch.depth != node.depth + 1 || ch.depth > max_depth_)
                    throw std::runtime_error("broken parent/child link");
                if (ch.count <= 0 || ch.count > node.count) throw std::runtime_error("bad count");
                if (top < 0 || better(c, top)) top = c;
                stack.push_back(c);
            });
            if (node.best != top) throw std::runtime_error("stale most-frequent child");
            int32_t kids = 0;
            for_each_child(n, [&](int32_t tok, int32_t c) {
                ++kids;
                if (node.num_kids > kIndexThreshold) {
                    auto it = index_.find(edge_key(n, tok));
                    if (it == index_.end() || it->second != c) throw std::runtime_error("wide node not indexed");
                }
            });
            if (node.num_kids <= kIndexThreshold && kids != node.num_kids) throw std::runtime_error("child count");
        }
        if (reachable != num_nodes_) throw std::runtime_error("node count mismatch");
        int64_t total = 0;
        for (auto& kv : seqs_) total += (int64_t)kv.second.size();
        if (total != nodes_[0].count) throw std::runtime_error("root count mismatch");
    }

    py::dict path_counts() const {
        py::dict out;
        std::vector<std::pair<int32_t, std::vector<int32_t>>> stack{{0, {}}};
        while (!stack.empty()) {
            auto [n, path] = stack.back();
            stack.pop_back();
            for_each_child(n, [&](int32_t tok, int32_t c) {
                auto p = path;
                p.push_back(tok);
                out[py::tuple(py::cast(p))] = nodes_[c].count;
                stack.push_back({c, std::move(p)});
            });
        }
        return out;
    }

    size_t memory_bytes() const {
        size_t b = nodes_.capacity() * sizeof(Node) + free_.capacity() * 4 + index_.size() * 32 +
                   index_.bucket_count() * 8;
        for (auto& kv : seqs_) b += kv.second.capacity() * 4 + 64;
        for (auto& kv : active_) b += kv.second.capacity() * 4 + 64;
        return b;
    }

  private:
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

    int32_t new_node(int32_t parent, int32_t tok) {
        int32_t id;
        if (!free_.empty()) {
            id = free_.back();
            free_.pop_back();
        } else {
            id = (int32_t)nodes_.size();
            nodes_.emplace_back();
        }
        Node& c = nodes_[id];
        Node& p = nodes_[parent];
        c = Node();
        c.token = tok;
        c.parent = parent;
        c.depth = (int16_t)(p.depth + 1);
        c.next = p.first;
        p.first = id;
        if (p.num_kids > kIndexThreshold) {
            index_[edge_key(parent, tok)] = id;
        } else if (++p.num_kids > kIndexThreshold) {  // becomes wide: index all its children
            for (int32_t k = p.first; k >= 0; k = nodes_[k].next) index_[edge_key(parent, nodes_[k].token)] = k;
        }
        ++num_nodes_;
        return id;
    }

    void drop_child(int32_t p, int32_t tok) {
        Node& node = nodes_[p];
        int32_t prev = -1, c = node.first;
        while (c >= 0 && nodes_[c].token != tok) prev = c, c = nodes_[c].next;
        if (c < 0) return;
        (prev < 0 ? node.first : nodes_[prev].next) = nodes_[c].next;
        if (node.num_kids > kIndexThreshold) index_.erase(edge_key(p, tok));
        else --node.num_kids;
    }

    void free_subtree(int32_t root) {
        std::vector<int32_t> stack{root};
        while (!stack.empty()) {
            int32_t n = stack.back();
            stack.pop_back();
            for_each_child(n, [&](int32_t tok, int32_t c) {
                stack.push_back(c);
                if (nodes_[n].num_kids > kIndexThreshold) index_.erase(edge_key(n, tok));
            });
            nodes_[n] = Node();
            free_.push_back(n);
            --num_nodes_;
        }
    }

    void extend(int32_t n, int32_t tok, std::vector<int32_t>& next) {
        if (nodes_[n].depth >= max_depth_) return;
        int32_t c = child(n, tok);
        if (c < 0) c = new_node(n, tok);
        nodes_[c].count += 1;
        int32_t b = nodes_[n].best;
        if (b < 0 || better(c, b)) nodes_[n].best = c;
        next.push_back(c);
    }

    void rescan(int32_t n) {
        int32_t top = -1;
        for_each_child(n, [&](int32_t, int32_t c) {
            if (top < 0 || better(c, top)) top = c;
        });
        nodes_[n].best = top;
    }

    void chain_draft(int32_t node, int budget, double min_prob, Draft& d) const {
        double p = 1.0;
        int32_t parent = -1;
        while ((int)d.tokens.size() < budget && nodes_[node].best >= 0) {
            int32_t c = nodes_[node].best;
            p *= (double)nodes_[c].count / (double)nodes_[node].count;
            if (p < min_prob) break;
            d.tokens.push_back(nodes_[c].token);
            d.parents.push_back(parent);
            d.probs.push_back(p);
            d.score += p;
            parent = (int32_t)d.tokens.size() - 1;
            node = c;
        }
    }

    void tree_draft(int32_t node, int budget, double min_prob, Draft& d) const {
        struct Item {
            double p;
            int64_t order;
            int32_t node, parent_idx;
        };
        auto cmp = [](const Item& a, const Item& b) { return a.p < b.p || (a.p == b.p && a.order > b.order); };
        std::priority_queue<Item, std::vector<Item>, decltype(cmp)> heap(cmp);
        int64_t pushed = 0;
        std::vector<int32_t> kids;
        auto push = [&](int32_t n, double parent_p, int32_t parent_idx) {
            // only children that clear min_prob, most frequent first (the order ties are broken in)
            kids.clear();
            for_each_child(n, [&](int32_t, int32_t c) {
                if (parent_p * ((double)nodes_[c].count / (double)nodes_[n].count) >= min_prob) kids.push_back(c);
            });
            std::sort(kids.begin(), kids.end(), [&](int32_t a, int32_t b) { return better(a, b); });
            for (int32_t c : kids)
                heap.push({parent_p * ((double)nodes_[c].count / (double)nodes_[n].count), pushed++, c, parent_idx});
        };
        push(node, 1.0, -1);
        while (!heap.empty() && (int)d.tokens.size() < budget) {
            Item it = heap.top();
            heap.pop();
            d.tokens.push_back(nodes_[it.node].token);
            d.parents.push_back(it.parent_idx);
            d.probs.push_back(it.p);
            d.score += it.p;
            push(it.node, it.p, (int32_t)d.tokens.size() - 1);
        }
    }

    int max_depth_;
    std::vector<Node> nodes_;
    std::vector<int32_t> free_;
    std::unordered_map<uint64_t, int32_t> index_;  // (parent, token) -> child, for wide nodes only
    std::unordered_map<int64_t, std::vector<int32_t>> seqs_;
    std::unordered_map<int64_t, std::vector<int32_t>> active_;
    int64_t num_nodes_ = 0;
};

}  // namespace rollwise_spec
