"""The update every trainer here makes: gradients clipped to a global norm, and no update at all
when that norm is not finite (verl's and Megatron's rule). One NaN or inf gradient, from a sample
that overflowed or a loss that went wrong, would otherwise be written into every weight and the
replicas would serve NaN from then on; the step's gradients are dropped and the run goes on. The
norm is taken after data-parallel ranks have summed their gradients, so every rank decides alike."""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def clipped_step(params: Iterable[torch.nn.Parameter], opt: torch.optim.Optimizer, max_norm: float,
                 update: bool = True) -> float:
    """Clip, step (if `update` and the norm is finite), zero the gradients; the norm before clipping."""
    norm = float(torch.nn.utils.clip_grad_norm_(list(params), max_norm))
    if update and math.isfinite(norm):
        opt.step()
    opt.zero_grad(set_to_none=True)
    return norm


def skipped(norms: list[float]) -> int:
    """How many of these updates were dropped for a norm that is not finite."""
    return sum(not math.isfinite(n) for n in norms)
