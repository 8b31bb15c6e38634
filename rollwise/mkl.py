"""MKL's vector math, set up on one thread before torch's threads share it.

On the CPU torch computes cos, sin, exp, log, tanh, erf and a few more through MKL's vector math
(VML), a tensor of more than 2,048 elements split between its OpenMP threads. VML sets itself up on
its first call, and threads that make that first call together can compute their shares with
different kernels: most of one thread's share then differs in its last bits, in one to a few
process starts in a hundred (`benchmarks/vml_race.py`). The trainer's first step met it in the rotary
embedding's cos (a run's first loss differed in its last bits from the same run in another
process), and the engine computes its rotary table once at load, so a replica could keep such a
table all its life. `settle()`, called before a policy, an engine or a reward model is built, makes
each op's first call on the calling thread alone: a few milliseconds, once a process.
"""
from __future__ import annotations

# torch's VML-backed unary ops on CPU (ATen/cpu/vml.h, IMPLEMENT_VML_MKL)
VML_OPS = ("acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp", "log", "log10", "log2", "sin",
           "sqrt", "tan", "tanh", "trunc")
_settled = False


def settle() -> None:
    """Each VML op's first call, in float32 and float64, made on this thread alone (once a process)."""
    global _settled
    if _settled:
        return
    import torch
    for dtype in (torch.float32, torch.float64):
        x = torch.full((1,), 0.5, dtype=dtype)  # (one element: torch runs it on the calling thread)
        for op in VML_OPS:
            getattr(torch, op)(x)
    _settled = True
