"""The native kernels (rollwise/engine/*.cpp, built by `pip install`) behind one switch. Each has a
torch twin, which stays its test oracle and the path for what the kernels do not take: bf16, other
devices, autograd, tree drafts of more than 64 tokens (attention.py)."""
from __future__ import annotations

import torch

try:
    from rollwise.engine import _C
except ImportError:  # not built: the torch twins do everything
    _C = None

ENABLED = _C is not None  # tests and benchmarks turn it off to compare with the torch path
# the attention's prefill tiles with their (query, head) pairs in a vector's lanes; off: pair by pair,
# the same bits (benchmarks compare the two)
LANES = True


def takes(*xs: torch.Tensor) -> bool:
    """Whether the small-op kernels take these tensors: fp32 on the CPU, contiguous, no autograd."""
    return ENABLED and not torch.is_grad_enabled() and all(
        x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous() for x in xs)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm over the last dimension of x (see `takes`)."""
    out = torch.empty_like(x)
    d = x.shape[-1]
    _C.rms_norm(x.view(-1, d).numpy(), weight.detach().numpy(), eps, out.view(-1, d).numpy())
    return out


def rope_(x: torch.Tensor, c0: int, heads: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates `heads` heads of size D from column c0 of each row of x [T, W] in place (apply_rope's
    math; cos, sin [T, D] or [T, 1, D], see `takes`). Returns x."""
    t, d = x.shape[0], cos.shape[-1]
    _C.rope_(x.numpy(), c0, heads, cos.view(t, d).numpy(), sin.view(t, d).numpy())
    return x


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate, up] along the last dimension, x [N, 2I] (see `takes`)."""
    out = x.new_empty(x.shape[0], x.shape[1] // 2)
    _C.silu_and_mul(x.numpy(), out.numpy())
    return out


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """sampler.inverse_cdf's tokens (probs [B, V] float32, contiguous, on the CPU; u [B] float64),
    without its float64 cumulative sums."""
    out = torch.empty(probs.shape[0], dtype=torch.long)
    _C.inverse_cdf(probs.detach().numpy(), u.contiguous().numpy(), out.numpy())
    return out
