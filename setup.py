"""Builds of the native cores (rollwise.spec._C: the suffix tree; rollwise.engine._C: the engine's
kernels); everything else is in pyproject.toml."""
from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

setup(
    ext_modules=[
        Pybind11Extension("rollwise.spec._C", ["rollwise/spec/_C.cpp"],
                          depends=["rollwise/spec/suffix_tree.h", "rollwise/spec/suffix_tree_read.h"],
                          cxx_std=17, extra_compile_args=["-O3"]),
        # OpenMP: the same libgomp torch loads (soname libgomp.so.1), so one thread pool and one
        # OMP_WAIT_POLICY for both. No reassociation of float sums: the attention's order of
        # operations is its source's (explicit vectors), the same for a row in any batch; multiply-adds
        # fuse (-ffp-contract=fast, GCC's default, spelled out).
        # Optional: without it the engine runs torch ops alone
        Pybind11Extension("rollwise.engine._C",
                          ["rollwise/engine/_C.cpp", "rollwise/engine/paged_attention.cpp",
                           "rollwise/engine/small_ops.cpp", "rollwise/engine/sampling.cpp"],
                          depends=["rollwise/engine/kernels.h", "rollwise/engine/attention_tile.h"],
                          cxx_std=17, optional=True,
                          extra_compile_args=["-O3", "-fopenmp", "-ffp-contract=fast", "-fno-trapping-math"],
                          extra_link_args=["-fopenmp"]),
    ],
    cmdclass={"build_ext": build_ext},
)
