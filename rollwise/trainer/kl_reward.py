"""KL in the reward, read top to bottom (verl's use_kl_in_reward; Ziegler et al. 2019, "Fine-Tuning
Language Models from Human Preferences", and its adaptive controller).

Each generated token's reward is lowered by beta x its KL estimate to the reference model, k1 = log
pi(token) - log pi_ref(token), pi the trainer's current weights (verl's old_log_prob: the proximal
policy): the per-token estimators (gae, REINFORCE++) take the penalty token by token, the episode
ones (grpo, dr_grpo, rloo, gigpo) on the episode's reward (its sum; gigpo's step returns count it as
the last turn's, where an episode's reward beyond its turns' goes). Observation tokens carry none.
Unlike `kl_coef` (the k3 estimate in the loss, a gradient toward the reference) the penalty is part
of the return: the critic learns it, GAE discounts it, and a group whose episodes all solved the task
still compares them by how far each strayed (dynamic sampling still judges a group by the env's
rewards alone).

beta starts at `coef`. With `target` > 0 the adaptive controller moves it after each step toward a
per-token KL of `target` (each episode's mean over its tokens, averaged over the batch):
beta *= 1 + clip(KL / target - 1, -0.2, 0.2) x n / horizon, n the step's episodes; else fixed.
"""
from __future__ import annotations

from typing import Callable

import torch

from rollwise.trainer.critic import positions
from rollwise.trainer.policy import Batch, micro_batches
from rollwise.types import Trajectory


def check(coef: float, target: float, horizon: int) -> None:
    if coef < 0 or target < 0 or horizon < 1:
        raise ValueError(f"need reward_kl_coef >= 0, reward_kl_target >= 0 and reward_kl_horizon >= 1, got {coef}, "
                         f"{target}, {horizon}")


class RewardKL:
    """beta (the controller) and the step's per-token KL of each trajectory. `kl`: (sequences, their
    Batch) -> [B, L-1] each target's k1 estimate (the trainer's: its logprobs less the reference's)."""

    def __init__(self, kl: Callable[[list[Trajectory], Batch], torch.Tensor], coef: float, target: float = 0.0,
                 horizon: int = 10000, micro_batch_tokens: int = 8192, comm=None) -> None:
        check(coef, target, horizon)
        self.kl, self.value, self.target, self.horizon, self.mbt = kl, coef, target, horizon, micro_batch_tokens
        self.comm = comm  # data parallel: each rank computes a share of the KLs and every rank gets them all
        self._kls: dict[int, tuple[Trajectory, list[float]]] = {}  # id -> (the trajectory, its KL per token)

    @torch.no_grad()
    def token_kls(self, trajs: list[Trajectory]) -> dict[int, list[float]]:
        """Each trajectory's KL per generated token (its sequences in order), by id; once a step. With
        data parallel, every rank must ask for the same trajectories first (the trainer's `add` does)."""
        todo = [t for t in trajs if self._kls.get(id(t), (None,))[0] is not t]
        dp = self.comm is not None and self.comm.world > 1 and todo
        mine = todo[self.comm.rank::self.comm.world] if dp else todo
        seq: dict[int, list[float]] = {}
        for mb in micro_batches([s for t in mine for s in t.sequences()], self.mbt):
            d = self.kl(mb, Batch.of(mb))
            for r, s in enumerate(mb):
                seq[id(s)] = d[r, positions(s)].tolist()
        kls = [[k for s in t.sequences() for k in seq[id(s)]] for t in mine]
        if dp:  # every rank's share, in `todo`'s order
            parts = self.comm.gather(kls)
            kls = [parts[i % self.comm.world][i // self.comm.world] for i in range(len(todo))]
        for t, k in zip(todo, kls, strict=True):
            self._kls[id(t)] = (t, k)
        return {id(t): self._kls[id(t)][1] for t in trajs}

    def penalty(self, trajs: list[Trajectory]) -> dict[int, list[float]]:
        """Each trajectory's penalty per generated token, beta x KL, by id (the per-token estimators')."""
        return {i: [self.value * k for k in kl] for i, kl in self.token_kls(trajs).items()}

    def finish(self) -> dict[str, float]:
        """The step's beta and mean per-token KL (each episode's mean over its tokens, averaged); then
        beta adapted for the next step (with a target), and the step's KLs dropped."""
        kls = [sum(k) / len(k) for _, k in self._kls.values() if k]
        m = {"reward_kl_coef": self.value, "reward_kl": sum(kls) / len(kls) if kls else 0.0}
        if self.target > 0 and kls:
            err = min(max(m["reward_kl"] / self.target - 1.0, -0.2), 0.2)
            self.value *= 1.0 + err * len(kls) / self.horizon
        self._kls = {}
        return m
