// What reads the suffix tree of suffix_tree.h: drafting and the integrity check (with the trie's
// positions listed for the Python oracle to compare).
#pragma once
#include "suffix_tree.h"

namespace rollwise_spec {

inline Draft SuffixTree::speculate(const std::vector<int32_t>& context, int max_spec, double alpha, double offset,
                                   double min_prob, bool tree) const {
    Draft best, cur;
    const size_t len = std::min(context.size(), (size_t)max_depth_);
    const int32_t* ctx = context.data() + (context.size() - len);
    for (size_t m = 1; m <= len; ++m) {
        Pos pos{0, 0};
        for (size_t j = len - m; j < len; ++j) {
            pos = step(pos, ctx[j]);
            if (pos.node < 0) return best;  // longer suffixes cannot match either
        }
        double b = alpha * (double)m + offset;
        int budget = b >= (double)max_spec ? max_spec : (int)b;
        if (budget <= 0) continue;
        cur.tokens.clear(), cur.parents.clear(), cur.probs.clear(), cur.score = 0.0;
        if (tree) tree_draft(pos, budget, min_prob, cur);
        else chain_draft(pos, budget, min_prob, cur);
        if (!cur.tokens.empty() && cur.score >= best.score) {
            std::swap(best, cur);
            best.match_len = (int)m;
        }
    }
    return best;
}

// Inside a label the next position is the only child, with the same count (ratio exactly 1).
inline void SuffixTree::chain_draft(Pos pos, int budget, double min_prob, Draft& d) const {
    double p = 1.0;
    int32_t parent = -1;
    while ((int)d.tokens.size() < budget) {
        int32_t tok;
        if (pos.depth < nodes_[pos.node].depth) {
            tok = at(pos.node, pos.depth + 1);
            pos.depth += 1;
        } else {
            const int32_t c = nodes_[pos.node].best;
            if (c < 0) break;
            p *= (double)nodes_[c].count / (double)nodes_[pos.node].count;
            if (p < min_prob) break;
            tok = nodes_[c].token;
            pos = {c, pos.depth + 1};
        }
        d.tokens.push_back(tok);
        d.parents.push_back(parent);
        d.probs.push_back(p);
        d.score += p;
        parent = (int32_t)d.tokens.size() - 1;
    }
}

inline void SuffixTree::tree_draft(Pos start, int budget, double min_prob, Draft& d) const {
    struct Item {
        double p;
        int64_t order;
        Pos pos;
        int32_t parent_idx;
    };
    auto cmp = [](const Item& a, const Item& b) { return a.p < b.p || (a.p == b.p && a.order > b.order); };
    std::priority_queue<Item, std::vector<Item>, decltype(cmp)> heap(cmp);
    int64_t pushed = 0;
    std::vector<int32_t> kids;
    auto push = [&](Pos at_pos, double parent_p, int32_t parent_idx) {
        const Node& n = nodes_[at_pos.node];
        if (at_pos.depth < n.depth) {  // one child, the label's next position: ratio 1
            if (parent_p >= min_prob) heap.push({parent_p, pushed++, {at_pos.node, at_pos.depth + 1}, parent_idx});
            return;
        }
        // only children that clear min_prob, most frequent first (the order ties are broken in)
        kids.clear();
        for_each_child(at_pos.node, [&](int32_t, int32_t c) {
            if (parent_p * ((double)nodes_[c].count / (double)n.count) >= min_prob) kids.push_back(c);
        });
        std::sort(kids.begin(), kids.end(), [&](int32_t a, int32_t b) { return better(a, b); });
        for (int32_t c : kids)
            heap.push({parent_p * ((double)nodes_[c].count / (double)n.count), pushed++, {c, n.depth + 1}, parent_idx});
    };
    push(start, 1.0, -1);
    while (!heap.empty() && (int)d.tokens.size() < budget) {
        Item it = heap.top();
        heap.pop();
        d.tokens.push_back(at(it.pos.node, it.pos.depth));
        d.parents.push_back(it.parent_idx);
        d.probs.push_back(it.p);
        d.score += it.p;
        push(it.pos, it.p, (int32_t)d.tokens.size() - 1);
    }
}

inline void SuffixTree::check_integrity() const {
    int64_t reachable = 0, positions = 0;
    std::vector<std::pair<int32_t, std::vector<int32_t>>> stack{{0, {}}};
    std::unordered_map<int32_t, int32_t> refs;
    while (!stack.empty()) {
        auto [n, path] = std::move(stack.back());
        stack.pop_back();
        const Node& node = nodes_[n];
        int32_t top = -1, kids = 0, prev = -1;
        for (int32_t c = node.first; c >= 0; prev = c, c = nodes_[c].next) {
            const Node& ch = nodes_[c];
            ++reachable, ++kids;
            positions += ch.depth - node.depth;
            ++refs[ch.store];
            if (ch.parent != n || ch.prev != prev || ch.depth <= node.depth || ch.depth > max_depth_)
                throw std::runtime_error("broken parent/child link");
            if (ch.count <= 0 || ch.count > node.count) throw std::runtime_error("bad count");
            if (n != 0 && kids == 1 && ch.next < 0 && ch.count == node.count)
                throw std::runtime_error("an only child with its parent's count is not merged");
            const auto& toks = stores_.at(ch.store).toks;
            if (ch.end > (int32_t)toks.size() || ch.end < ch.depth) throw std::runtime_error("label out of its store");
            auto full = path;
            for (int d = node.depth + 1; d <= ch.depth; ++d) full.push_back(at(c, d));
            if (!std::equal(full.begin(), full.end(), toks.begin() + (ch.end - ch.depth)) || ch.token != full[node.depth])
                throw std::runtime_error("a label's store does not spell its path");
            if (node.num_kids > kIndexThreshold) {
                auto it = index_.find(edge_key(n, ch.token));
                if (it == index_.end() || it->second != c) throw std::runtime_error("wide record not indexed");
            }
            if (top < 0 || better(c, top)) top = c;
            stack.push_back({c, std::move(full)});
        }
        if (node.best != top) throw std::runtime_error("stale most-frequent child");
        if (node.num_kids <= kIndexThreshold && kids != node.num_kids) throw std::runtime_error("child count");
    }
    if (reachable != num_records() || positions != num_nodes_) throw std::runtime_error("node count mismatch");
    int64_t total = 0;
    for (auto& kv : seqs_) total += (int64_t)stores_[kv.second].toks.size();
    if (total != nodes_[0].count) throw std::runtime_error("root count mismatch");
    for (auto& [key, c] : index_) {  // no entry outlives its parent's width or its child
        const int32_t p = (int32_t)(key >> 32);
        if (!alive(p) || nodes_[p].num_kids <= kIndexThreshold || !alive(c) || nodes_[c].parent != p ||
            nodes_[c].token != (int32_t)(uint32_t)key)
            throw std::runtime_error("stale child index entry");
    }
    for (size_t s = 0; s < stores_.size(); ++s) {
        auto it = refs.find((int32_t)s);
        if (stores_[s].refs != (it == refs.end() ? 0 : it->second)) throw std::runtime_error("store refcount");
    }
}

inline py::dict SuffixTree::path_counts() const {
    py::dict out;
    std::vector<std::pair<int32_t, std::vector<int32_t>>> stack{{0, {}}};
    while (!stack.empty()) {
        auto [n, path] = std::move(stack.back());
        stack.pop_back();
        for_each_child(n, [&](int32_t, int32_t c) {
            auto p = path;
            for (int d = nodes_[n].depth + 1; d <= nodes_[c].depth; ++d) {
                p.push_back(at(c, d));
                out[py::tuple(py::cast(p))] = nodes_[c].count;
            }
            stack.push_back({c, std::move(p)});
        });
    }
    return out;
}

}  // namespace rollwise_spec
