"""Advantages, read top to bottom: one per episode (GRPO's family) or one per turn (GiGPO); the
per-token ones whitened over the batch (PPO's GAE, REINFORCE++) are in critic.py.

"grpo": each group's rewards minus the group mean, divided by the group's std; "dr_grpo": not
divided (Dr. GRPO: the std favours groups that are nearly all right or all wrong); "rloo": each reward
minus the mean of the group's others (REINFORCE leave-one-out, an unbiased baseline: n / (n - 1)
times dr_grpo's); "opo" (OPO, Hao et al. 2025, verl's): each reward minus the group's mean weighted by
the episodes' generated tokens, the baseline that minimises the gradient's variance for exact
on-policy training; "remax" (ReMax, Li et al. 2024, verl's): each reward minus that of an episode
the policy ran greedily on the same task (`Trajectory.baseline`; the rollout runs one per group, not
trained on), so a group of one trains; "grpo_passk" (Pass@k training, Chen et al. 2025, verl's):
only the group's best episode (the first, on a tie) gets an advantage, its reward minus the second
best's, over the group's std, so a group is credited for solving the task once rather than on
average. The same for every generated token of a trajectory (of each of its token sequences, when
the episode ran in several contexts: `Trajectory.earlier`).

"gigpo" (GiGPO, Feng et al. 2025, "Group-in-Group Policy Optimization for LLM Agent Training"): the
episode's grpo advantage plus `step_weight` times a step advantage per turn. The turns of a group's
episodes are grouped by their anchor state, what the model read just before generating the turn (the
first prompt for a context's first turn, else the observation the previous turn got back: the same
tool result, the same position on the grid), or the env's own key of its state where it defines
`state_key()` (for observations that carry text that changes, such as a clock), and each turn's
discounted return from there on (sum over k >= t of gamma^(k-t) r_k, r_k the env's reward for turn
k) is compared with the others from the same state: minus their mean, divided by their std
(`mode = "mean_std_norm"`; `"mean_norm"`: not divided, for the episode advantage too, verl-agent's
modes). A state reached once gets 0. So a group whose episodes all succeed (no episode advantage)
still teaches the turn that got there sooner, and a failed episode's good moves are not all blamed
for its end. Markov: the history before the anchor is not compared. With `similarity` < 1 a state
joins the step group of the first earlier one whose tokens are that similar (difflib's ratio, 2 x
matches / total length; the first member stands for the group), so observations that differ in a
detail (a counter, a timestamp) compare their turns, as verl-agent's similarity-based groups do;
env keys match exactly.
"""
from __future__ import annotations

from difflib import SequenceMatcher

import torch

from rollwise.types import Trajectory

GIGPO_MODES = ("mean_std_norm", "mean_norm")

# "gae" (PPO's, from a critic) and REINFORCE++'s: per token, whitened over the batch (critic.py)
WHITENED = ("gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
EPISODE_ADVANTAGES = ("grpo", "dr_grpo", "rloo", "gigpo", "opo", "grpo_passk", "remax")  # here, from rewards
ADVANTAGES = EPISODE_ADVANTAGES + WHITENED
NO_GROUP = ("gae", "reinforce_plus_plus")  # need no group (a group of one trains; every group teaches)


def check_gigpo(mode: str, similarity: float) -> None:
    if mode not in GIGPO_MODES:
        raise ValueError(f"unknown gigpo_mode {mode!r}; valid: {list(GIGPO_MODES)}")
    if not 0 < similarity <= 1:
        raise ValueError(f"gigpo_similarity must be in (0, 1] (1: equal states only), got {similarity}")


def advantages(groups: list[list[Trajectory]], estimator: str = "grpo") -> list[float]:
    """Each trajectory's episode advantage, groups in order (gigpo's is grpo's)."""
    if estimator in WHITENED:
        raise ValueError(f"{estimator!r} advantages are per token, whitened over the batch (critic.py)")
    if estimator not in EPISODE_ADVANTAGES:
        raise ValueError(f"unknown advantage {estimator!r}; valid: {list(EPISODE_ADVANTAGES)}")
    out = []
    for g in groups:
        r = torch.tensor([t.reward for t in g], dtype=torch.float64)
        a = r - r.mean()
        if len(g) > 1 and estimator in ("grpo", "gigpo"):
            a = a / (r.std() + 1e-6)
        elif len(g) > 1 and estimator == "rloo":
            a = a * len(g) / (len(g) - 1)
        elif estimator == "opo":
            n = torch.tensor([t.num_generated for t in g], dtype=torch.float64)
            a = r - (n * r).sum() / n.sum().clamp(min=1)
        elif estimator == "remax":
            if g[0].baseline is None:
                raise ValueError("remax advantages need each group's greedy episode's reward (Trajectory.baseline): "
                                 "a run with advantage = 'remax' rolls one out per group")
            a = r - g[0].baseline
        elif estimator == "grpo_passk":
            a = torch.zeros_like(r)
            if len(g) > 1:
                best = int(r.argmax())
                a[best] = (r[best] - torch.cat([r[:best], r[best + 1:]]).max()) / (r.std() + 1e-6)
        out.extend(a.tolist())
    return out


def anchor_states(t: Trajectory) -> list[tuple]:
    """Per turn of the episode (its sequences in order), the state it was generated from: the env's
    own key where it gives one (`state_key()`, in `TurnRecord.state`), else the tokens the model read
    just before the turn: the context's first prompt, or the previous turn's observation delta."""
    out = []
    for s in t.sequences():
        end = 0  # where the previous turn's generated tokens ended
        for turn in s.turns:
            out.append(("state", turn.state) if turn.state is not None else tuple(s.token_ids[end:turn.start]))
            end = turn.start + turn.num_generated
    return out


def returns(t: Trajectory, gamma: float) -> list[float]:
    """Per turn, the discounted return from it on. The episode's reward beyond its turns' (an env or
    agent that gives it at the end, not as a step's) counts as the last turn's."""
    r = [turn.reward for s in t.sequences() for turn in s.turns]
    if r:
        r[-1] += t.reward - sum(r)
    g, out = 0.0, []
    for x in reversed(r):
        g = x + gamma * g
        out.append(g)
    return out[::-1]


def step_groups(anchors: list[tuple], similarity: float = 1.0) -> list[int]:
    """A step group id per anchor state: equal states share one; with `similarity` < 1, a token state
    joins the first group whose first member's tokens are at least that similar."""
    reps: list[tuple] = []  # each group's first member
    ids, exact = [], {}
    for a in anchors:
        if a not in exact and similarity < 1 and not (a and a[0] == "state"):
            for gid, r in enumerate(reps):
                if r and r[0] == "state":
                    continue
                m = SequenceMatcher(None, r, a, autojunk=False)
                if m.real_quick_ratio() >= similarity and m.quick_ratio() >= similarity and m.ratio() >= similarity:
                    exact[a] = gid
                    break
        if a not in exact:
            exact[a] = len(reps)
            reps.append(a)
        ids.append(exact[a])
    return ids


def turn_advantages(groups: list[list[Trajectory]], estimator: str = "grpo", step_weight: float = 1.0,
                    gamma: float = 0.95, stats: dict | None = None, mode: str = "mean_std_norm",
                    similarity: float = 1.0) -> list[list[float]]:
    """Each trajectory's advantage per turn (its sequences' turns in order), groups in order. `stats`,
    if given, counts "turns" and "anchored" (turns whose state another turn of the group shares)."""
    episode = advantages(groups, "dr_grpo" if estimator == "gigpo" and mode == "mean_norm" else estimator)
    out, i = [], 0
    for g in groups:
        per = [[a] * t.num_turns for t, a in zip(g, episode[i:i + len(g)])]
        i += len(g)
        if estimator == "gigpo":
            turns = [(j, k, s, ret) for j, t in enumerate(g)
                     for k, (s, ret) in enumerate(zip(anchor_states(t), returns(t, gamma)))]
            steps: dict[int, list[tuple[int, int, float]]] = {}  # step group -> (trajectory, turn, return)
            for gid, (j, k, _, ret) in zip(step_groups([x[2] for x in turns], similarity), turns):
                steps.setdefault(gid, []).append((j, k, ret))
            for members in steps.values():
                if len(members) < 2:
                    continue
                r = torch.tensor([m[2] for m in members], dtype=torch.float64)
                a = (r - r.mean()) if mode == "mean_norm" else (r - r.mean()) / (r.std() + 1e-6)
                a = a.tolist()
                for (j, k, _), x in zip(members, a):
                    per[j][k] += step_weight * x
                if stats is not None:
                    stats["anchored"] = stats.get("anchored", 0) + len(members)
        if stats is not None:
            stats["turns"] = stats.get("turns", 0) + sum(t.num_turns for t in g)
        out.extend(per)
    return out


def informative(group: list[Trajectory], estimator: str = "grpo", step_weight: float = 1.0,
                gamma: float = 0.95, mode: str = "mean_std_norm", similarity: float = 1.0) -> bool:
    """Whether a group teaches anything: its rewards differ, or (gigpo) a turn's step advantage is not 0,
    or (`NO_GROUP`) always: their advantages do not cancel in a group, or (remax) one differs from the
    greedy episode's. DAPO's dynamic sampling skips the others."""
    if len({t.reward for t in group}) > 1 or estimator in NO_GROUP:
        return True
    if estimator == "remax":
        return group[0].reward != group[0].baseline
    return estimator == "gigpo" and any(abs(a) > 1e-9 for per in turn_advantages(
        [group], estimator, step_weight, gamma, mode=mode, similarity=similarity) for a in per)


def token_advantages(seqs: list[Trajectory], per_turn: list[list[float]], width: int) -> torch.Tensor:
    """[len(seqs), width] float32: each turn's advantage on the positions of the targets that are its
    generated tokens (target j predicts token j + 1, as `Batch.targets`), 0 elsewhere."""
    out = torch.zeros(len(seqs), width)
    for i, (s, adv) in enumerate(zip(seqs, per_turn)):
        for turn, a in zip(s.turns, adv):
            out[i, turn.start - 1:turn.start - 1 + turn.num_generated] = a
    return out
