// Python bindings of the suffix tree (suffix_tree.h, suffix_tree_read.h) and of the native request registry.
#include "suffix_tree_read.h"

#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace rollwise_spec {

// Active requests held natively, so a step's drafting and appending cross into Python once, with
// handles and new tokens only. Each request names the trees it drafts from (request, group,
// global: any may be null), the (tree, sequence) pairs its tokens go to, and its recent context.
// The Python SuffixCache owns the trees and keeps them alive while a request names them.
class Requests {
  public:
    explicit Requests(int context_len) : context_len_(context_len) {}

    void set(int64_t h, std::vector<SuffixTree*> sources, std::vector<std::pair<SuffixTree*, int64_t>> targets,
             std::vector<int32_t> context) {
        Req& r = reqs_[h];
        r.sources = std::move(sources);
        r.targets = std::move(targets);
        r.context = std::move(context);
        trim(r);
    }

    void set_targets(int64_t h, std::vector<std::pair<SuffixTree*, int64_t>> targets) {
        find(h).targets = std::move(targets);
    }

    void drop(int64_t h) { reqs_.erase(h); }
    size_t size() const { return reqs_.size(); }

    void append(const std::vector<int64_t>& handles, const std::vector<std::vector<int32_t>>& tokens) {
        if (handles.size() != tokens.size()) throw std::invalid_argument("handles and tokens differ in length");
        for (int64_t h : handles) find(h);  // all known before anything changes
        py::gil_scoped_release release;
        for (size_t i = 0; i < handles.size(); ++i) {
            Req& r = reqs_.at(handles[i]);
            for (auto& [tree, seq] : r.targets) tree->append(seq, tokens[i]);
            r.context.insert(r.context.end(), tokens[i].begin(), tokens[i].end());
            trim(r);
        }
    }

    std::vector<std::tuple<std::vector<int32_t>, std::vector<int32_t>, std::vector<double>, double, int, int>>
    speculate(const std::vector<int64_t>& handles, const std::vector<int>& max_spec, double alpha, double offset,
              double min_prob, bool tree) {
        if (handles.size() != max_spec.size()) throw std::invalid_argument("handles and max_spec differ in length");
        for (int64_t h : handles) find(h);
        std::vector<std::tuple<std::vector<int32_t>, std::vector<int32_t>, std::vector<double>, double, int, int>> out;
        out.reserve(handles.size());
        py::gil_scoped_release release;
        for (size_t i = 0; i < handles.size(); ++i) {
            const Req& r = reqs_.at(handles[i]);
            Draft best;
            int src = -1;
            for (size_t k = 0; k < r.sources.size(); ++k) {
                if (r.sources[k] == nullptr || max_spec[i] <= 0) continue;
                Draft d = r.sources[k]->speculate(r.context, max_spec[i], alpha, offset, min_prob, tree);
                if (!d.tokens.empty() && (src < 0 || d.score > best.score)) {
                    best = std::move(d);
                    src = (int)k;
                }
            }
            out.emplace_back(std::move(best.tokens), std::move(best.parents), std::move(best.probs), best.score,
                             best.match_len, src);
        }
        return out;
    }

  private:
    struct Req {
        std::vector<SuffixTree*> sources;
        std::vector<std::pair<SuffixTree*, int64_t>> targets;
        std::vector<int32_t> context;
    };

    Req& find(int64_t h) {
        auto it = reqs_.find(h);
        if (it == reqs_.end()) throw std::invalid_argument("unknown request handle " + std::to_string(h));
        return it->second;
    }

    void trim(Req& r) const {
        if (r.context.size() > (size_t)(2 * context_len_))  // amortised: cut back to context_len
            r.context.erase(r.context.begin(), r.context.end() - context_len_);
    }

    int context_len_;
    std::unordered_map<int64_t, Req> reqs_;
};

}  // namespace rollwise_spec

using namespace rollwise_spec;

PYBIND11_MODULE(_C, m) {
    m.doc() = "C++ core of rollwise.spec (suffix trees)";
    py::class_<SuffixTree>(m, "SuffixTree")
        .def(py::init<int>(), py::arg("max_depth"))
        .def_property_readonly("max_depth", &SuffixTree::max_depth)
        .def_property_readonly("num_nodes", &SuffixTree::num_nodes)
        .def_property_readonly("num_records", &SuffixTree::num_records)
        .def_property_readonly("num_stores", &SuffixTree::num_stores)
        .def("has_seq", &SuffixTree::has_seq)
        .def("append", &SuffixTree::append, py::arg("seq_id"), py::arg("tokens"))
        .def("remove", &SuffixTree::remove, py::arg("seq_id"))
        .def("speculate",
             [](const SuffixTree& t, const std::vector<int32_t>& ctx, int max_spec, double alpha, double offset,
                double min_prob, bool tree) { return t.speculate(ctx, max_spec, alpha, offset, min_prob, tree).tuple(); },
             py::arg("context"), py::arg("max_spec_tokens"), py::arg("alpha") = 1.0, py::arg("offset") = 0.0,
             py::arg("min_token_prob") = 0.1, py::arg("tree") = false)
        .def("check_integrity", &SuffixTree::check_integrity)
        .def("path_counts", &SuffixTree::path_counts)
        .def("memory_bytes", &SuffixTree::memory_bytes);
    py::class_<Requests>(m, "Requests")
        .def(py::init<int>(), py::arg("context_len"))
        .def("set", &Requests::set)
        .def("set_targets", &Requests::set_targets)
        .def("drop", &Requests::drop)
        .def("__len__", &Requests::size)
        .def("append", &Requests::append)
        .def("speculate", &Requests::speculate);
}
