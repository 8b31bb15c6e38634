// The engine's native kernels as the Python module rollwise.engine._C (native.py, attention.py).
#include <pybind11/pybind11.h>

#include <iterator>

#include "kernels.h"

using namespace rollwise;

PYBIND11_MODULE(_C, m) {
    m.doc() = "Native kernels: paged attention, RMSNorm, SiLU-and-multiply, RoPE, sampling's inverse CDF (torch twins "
              "in attention.py, models/llama.py and sampler.py)";
    m.def("paged_attention", &paged_attention, py::arg("q").noconvert(), py::arg("k_cache").noconvert(),
          py::arg("v_cache").noconvert(), py::arg("block_tables").noconvert(), py::arg("rows").noconvert(),
          py::arg("seqs").noconvert(), py::arg("prefix").noconvert(), py::arg("masks").noconvert(),
          py::arg("out").noconvert(), py::arg("block_size"), py::arg("scale"), py::arg("parallel_pairs") = 65536,
          py::arg("lanes") = true);
    m.def("rms_norm", &rms_norm, py::arg("x").noconvert(), py::arg("w").noconvert(), py::arg("eps"),
          py::arg("out").noconvert());
    py::tuple sizes(std::size(VectorHeadSizes::values));
    for (size_t i = 0; i < sizes.size(); ++i) sizes[i] = VectorHeadSizes::values[i];
    m.attr("VECTOR_HEAD_SIZES") = sizes;  // the attention's vector kernel; other head sizes: its loop kernel
    m.def("silu_and_mul", &silu_and_mul, py::arg("x").noconvert(), py::arg("out").noconvert());
    m.def("rope_", &rope_, py::arg("x").noconvert(), py::arg("c0"), py::arg("heads"), py::arg("cos").noconvert(),
          py::arg("sin").noconvert());
    m.def("inverse_cdf", &inverse_cdf, py::arg("probs").noconvert(), py::arg("u").noconvert(),
          py::arg("out").noconvert());
}
