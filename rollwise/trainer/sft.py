"""Supervised warm start: next-token NLL on expert transcripts' generated tokens (every context of an
episode), AdamW with warm-up and cosine decay; on one process or data-parallel (`comm`: each rank the
forward and backward of its share of every batch, the gradients summed before each update), in
micro-batches of at most `micro_batch_tokens` padded tokens (gradients accumulated)."""
from __future__ import annotations

import math

import torch

from rollwise.trainer.data_parallel import Comm
from rollwise.trainer.optim import clipped_step
from rollwise.trainer.policy import Batch, PolicyModel, micro_batches
from rollwise.types import Trajectory


class SFT:
    """The warm start, one `step()` at a time. Every rank draws the same batch (the same seed) and
    trains its share of it (its rows dealt by tokens); the loss is normalized by the whole
    batch's generated tokens, so the summed gradients are the one-process step's up to the order of
    their sums, and every rank takes the same update."""

    def __init__(self, policy: PolicyModel, trajs: list[Trajectory], *, steps: int, lr: float = 3e-3,
                 batch_size: int = 16, seed: int = 0, warmup: int = 20, comm: Comm | None = None,
                 micro_batch_tokens: int | None = None) -> None:
        if not trajs:
            raise ValueError("sft needs at least one trajectory")
        self.policy, self.comm, self.batch_size = policy, comm or Comm(), batch_size
        self.micro = micro_batch_tokens
        self.seqs = [s for t in trajs for s in t.sequences()]  # an episode of several contexts: each sequence
        self.g = torch.Generator().manual_seed(seed)
        self.opt = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=0.0)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s / steps, 1.0))))

    def step(self) -> float:
        """One update; the batch's loss (every rank's share summed)."""
        idx = torch.randint(len(self.seqs), (self.batch_size,), generator=self.g).tolist()
        total = float(sum(sum(self.seqs[i].loss_mask[1:]) for i in idx))  # the batch's generated tokens
        # this rank's rows: the longest first onto the rank with the fewest tokens (as the GRPO step's groups)
        mine = self.comm.shard([self.seqs[i] for i in idx], [0.0] * self.comm.world, size=lambda t: len(t.token_ids))
        loss = torch.zeros(())
        fits = not mine or not self.micro or len(mine) * max(len(t.token_ids) for t in mine) <= self.micro
        for rows in [mine] if fits else micro_batches(mine, self.micro):  # (whole: in the batch's order)
            if rows:
                b = Batch.of(rows)
                part = -(self.policy.logprobs(b) * b.mask).sum() / total
                part.backward()
                loss = loss + part.detach()
        self.comm.grads(self.policy.parameters())
        clipped_step(self.policy.parameters(), self.opt, 1.0)
        self.sched.step()
        return float(self.comm.sum(loss.detach().reshape(1))[0])


def sft(policy: PolicyModel, trajs: list[Trajectory], *, steps: int, lr: float = 3e-3, batch_size: int = 16,
        seed: int = 0, warmup: int = 20, progress=None, micro_batch_tokens: int | None = None) -> list[float]:
    """Supervised warm start on expert trajectories (`SFT`, on this process). Returns the loss per step."""
    warm = SFT(policy, trajs, steps=steps, lr=lr, batch_size=batch_size, seed=seed, warmup=warmup,
               micro_batch_tokens=micro_batch_tokens)
    losses = []
    for s in range(steps):
        losses.append(warm.step())
        if progress is not None:
            progress(s, losses[-1])
    return losses
