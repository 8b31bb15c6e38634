"""Build of the C++ suffix-tree core (rollwise.spec._C); everything else is in pyproject.toml."""
from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

setup(
    ext_modules=[Pybind11Extension("rollwise.spec._C", ["rollwise/spec/_C.cpp"], depends=["rollwise/spec/suffix_tree.h", "rollwise/spec/suffix_tree_read.h"],
                                   cxx_std=17, extra_compile_args=["-O3"])],
    cmdclass={"build_ext": build_ext},
)
