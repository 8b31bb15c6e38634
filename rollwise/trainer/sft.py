"""Supervised warm start: next-token NLL on expert transcripts' generated tokens (every context of an
episode), AdamW with warm-up and cosine decay."""
from __future__ import annotations

import math

import torch

from rollwise.trainer.policy import Batch, PolicyModel
from rollwise.types import Trajectory


def sft(policy: PolicyModel, trajs: list[Trajectory], *, steps: int, lr: float = 3e-3, batch_size: int = 16,
        seed: int = 0, warmup: int = 20, progress=None) -> list[float]:
    """Supervised warm start on expert trajectories: next-token NLL on the generated (mask 1) tokens,
    AdamW with warm-up and cosine decay. Returns the loss per step."""
    if not trajs:
        raise ValueError("sft needs at least one trajectory")
    seqs = [s for t in trajs for s in t.sequences()]  # an episode of several contexts: each sequence
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s / steps, 1.0))))
    losses = []
    for s in range(steps):
        idx = torch.randint(len(seqs), (batch_size,), generator=g).tolist()
        b = Batch.of([seqs[i] for i in idx])
        lp = policy.logprobs(b)
        loss = -(lp * b.mask).sum() / b.mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if progress is not None:
            progress(s, losses[-1])
    return losses
