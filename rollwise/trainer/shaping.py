"""Reward shaping the trainer applies to the env's rewards, read top to bottom: DAPO's overlong
punishment (Yu et al. 2025, "DAPO", soft overlong punishment; verl's reward_model.overlong_buffer),
and how it and KL in the reward (kl_reward.py) reach the advantages.

A turn that generated more than max_tokens - buffer tokens loses penalty x (its tokens - (max_tokens
- buffer)) / buffer, rising linearly to `penalty` at max_tokens (a turn cut off by the limit): a
reply that runs into the limit learns to be shorter before it is truncated. Each turn is a response
of its own, so an episode loses its turns' sum. The per-token estimators (gae, REINFORCE++) take a
turn's penalty on its last token, the episode ones (grpo, dr_grpo, rloo, gigpo,
reinforce_plus_plus_baseline) on the episode's reward (gigpo's step returns: on the last turn's,
where an episode's reward beyond its turns' goes).
The env's rewards stay as they are (a success is still one; dynamic sampling still judges a group
by them); the step metrics `overlong_penalty` (per episode) and `overlong_turns` (the fraction of
turns in the buffer) show what was taken.
"""
from __future__ import annotations

from dataclasses import replace

from rollwise.types import Trajectory


def check(buffer: int, penalty: float, max_tokens: int) -> None:
    if buffer < 0 or penalty < 0:
        raise ValueError(f"need overlong_buffer >= 0 and overlong_penalty >= 0, got {buffer}, {penalty}")
    if buffer and not 0 < buffer <= max_tokens:
        raise ValueError(f"overlong_buffer {buffer} must lie within max_tokens ({max_tokens}): the last "
                         "overlong_buffer tokens a turn may generate")


class Overlong:
    def __init__(self, max_tokens: int, buffer: int, penalty: float = 1.0) -> None:
        check(buffer, penalty, max_tokens)
        self.max_tokens, self.buffer, self.penalty = max_tokens, buffer, penalty

    def turn(self, n: int) -> float:
        """The penalty of a turn that generated n tokens."""
        return self.penalty * min(max(n - (self.max_tokens - self.buffer), 0), self.buffer) / self.buffer

    def tokens(self, t: Trajectory) -> list[float]:
        """Per generated token of the episode (its sequences in order): each turn's penalty on its last."""
        out: list[float] = []
        for s in t.sequences():
            for turn in s.turns:
                if turn.num_generated:
                    out += [0.0] * (turn.num_generated - 1) + [self.turn(turn.num_generated)]
        return out

    def metrics(self, trajs: list[Trajectory]) -> dict[str, float]:
        turns = [turn.num_generated for t in trajs for s in t.sequences() for turn in s.turns]
        return {"overlong_penalty": sum(map(self.turn, turns)) / max(len(trajs), 1),
                "overlong_turns": sum(self.turn(n) > 0 for n in turns) / max(len(turns), 1)}


def penalties(trajs: list[Trajectory], reward_kl=None, overlong: Overlong | None = None
              ) -> dict[int, list[float]] | None:
    """Each trajectory's penalty per generated token, by id: beta x KL (kl_reward.RewardKL) plus each
    overlong turn's on its last token; None when neither is on."""
    if reward_kl is None and overlong is None:
        return None
    kl = reward_kl.penalty(trajs) if reward_kl is not None else {}
    out = {}
    for t in trajs:
        p = kl.get(id(t)) or [0.0] * t.num_generated
        out[id(t)] = p if overlong is None else [a + b for a, b in zip(p, overlong.tokens(t), strict=True)]
    return out


def rewarded(groups: list[list[Trajectory]], pen: dict[int, list[float]] | None) -> list[list[Trajectory]]:
    """The groups with each episode's reward less its penalties' sum (copies), as the episode estimators see them."""
    if pen is None:
        return groups
    return [[replace(t, reward=t.reward - sum(pen[id(t)])) for t in g] for g in groups]
