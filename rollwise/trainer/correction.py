"""Importance weights that correct for the rollout's policy not being the trainer's: samples of older
weights (staleness) and the replicas' other numerics (bf16, other kernels). The ratio is proximal /
behaviour: the trainer's logprob of each sampled token at the step's start over the rollout's.

`is_level`: "token", each token's own ratio (AReaL's decoupled PPO, TIS); "sequence", the product
of a token sequence's ratios, carried by each of its tokens; "geometric", their geometric mean (the
sequence ratio per token, so long sequences are not all cut). `is_mode`: "truncate", the weight
min(ratio, cap) (TIS); "mask", the ratio where it lies in [low, cap] and 0 elsewhere (MIS: a token or
sequence the rollout sampled too unlike the trainer carries no loss, rather than a capped one).
`is_veto` > 0: a sequence with any token whose ratio is under it carries no loss at all (a token the
trainer finds near impossible: a rollout-side numerical failure). Tokens and sequences dropped still
count in the loss's token average. verl calls these rollout_is_level / _mode / _threshold(_lower)
and rollout_token_veto_threshold.
"""
from __future__ import annotations

import torch

IS_LEVELS = ("token", "sequence", "geometric")
IS_MODES = ("truncate", "mask")


def check(level: str, mode: str, cap: float, low: float, veto: float) -> None:
    if level not in IS_LEVELS:
        raise ValueError(f"unknown is_level {level!r}; valid: {list(IS_LEVELS)}")
    if mode not in IS_MODES:
        raise ValueError(f"unknown is_mode {mode!r}; valid: {list(IS_MODES)}")
    if not 0 <= low < cap or veto < 0:
        raise ValueError(f"need 0 <= is_low < tis_cap and is_veto >= 0, got {low}, {cap}, {veto}")


def is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str = "token", mode: str = "truncate",
               cap: float = 2.0, low: float = 0.0, veto: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """log_ratio, mask: [B, T] (proximal - behaviour logprobs; 1 on generated tokens). Returns the
    weights [B, T] and a [B, T] bool of the generated tokens whose weight the mode or veto zeroed."""
    lr = log_ratio * mask
    if level != "token":
        s = lr.sum(1, keepdim=True)
        if level == "geometric":
            s = s / mask.sum(1, keepdim=True).clamp(min=1)
        lr = s.expand_as(log_ratio)
    r = torch.exp(lr)
    if mode == "truncate":
        w = r.clamp(max=cap)
        dropped = torch.zeros_like(mask, dtype=torch.bool)
    else:
        dropped = ((r < low) | (r > cap)) & mask.bool()
        w = torch.where(dropped, torch.zeros_like(r), r)
    if veto > 0:
        vetoed = ((log_ratio < torch.log(torch.tensor(veto))) & mask.bool()).any(1, keepdim=True) & mask.bool()
        w = torch.where(vetoed, torch.zeros_like(w), w)
        dropped = dropped | vetoed
    return w, dropped
