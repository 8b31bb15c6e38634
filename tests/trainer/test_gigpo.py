"""GiGPO's step-level advantages (rollwise/trainer/advantages.py): the formula on hand-built
episodes, where the trainer puts each turn's advantage, and a step on a real tiny model."""
from __future__ import annotations

import statistics

import pytest
import torch

from rollwise.rl_config import TrainConfig
from rollwise.trainer.advantages import (advantages, anchor_states, informative, returns, step_groups,
                                         token_advantages, turn_advantages)
from rollwise.trainer.grpo import GRPOConfig, GRPOTrainer
from rollwise.trainer.policy import Batch, PolicyModel
from rollwise.types import Trajectory, TurnRecord

P = [1, 2, 3]  # the group's prompt


def episode(turns: list[tuple[list[int], list[int], float]], prompt=P, reward: float | None = None,
            tid: str = "t") -> Trajectory:
    """turns: (generated ids, observation ids after them, the step's reward)."""
    ids, mask, records = list(prompt), [0] * len(prompt), []
    for gen, obs, r in turns:
        records.append(TurnRecord(start=len(ids), num_generated=len(gen), num_observation=len(obs),
                                  finish_reason="stop", policy_version=0, num_cached_tokens=0, generation_s=0,
                                  tool_s=0, reward=r))
        ids += gen + obs
        mask += [1] * len(gen) + [0] * len(obs)
    total = sum(r for _, _, r in turns) if reward is None else reward
    return Trajectory(trajectory_id=tid, group_id="g", task={}, token_ids=ids, loss_mask=mask,
                      logprobs=[0.0] * len(ids), turns=records, reward=total)


def z(xs: list[float]) -> list[float]:
    m, s = statistics.mean(xs), statistics.stdev(xs)
    return [(x - m) / (s + 1e-6) for x in xs]


def test_step_advantages_compare_turns_from_the_same_state():
    g = 0.9
    short = episode([([10], [50], 0.0), ([11], [], 1.0)])  # P -> A -> goal
    long = episode([([12], [50], 0.0), ([13], [60], 0.0), ([14], [], 1.0)])  # P -> A -> B -> goal
    lost = episode([([15], [70], 0.0), ([16], [], 0.0)])  # P -> C -> fell
    assert anchor_states(long) == [tuple(P), (50,), (60,)]
    assert returns(long, g) == pytest.approx([g * g, g, 1.0]) and returns(lost, g) == [0.0, 0.0]
    stats = {}
    got = turn_advantages([[short, long, lost]], "gigpo", step_weight=0.5, gamma=g, stats=stats)
    ep = z([1.0, 1.0, 0.0])
    at_p = z([g, g * g, 0.0])  # every first turn starts from the prompt
    at_a = z([1.0, g])  # short's and long's second turns both start from observation 50
    assert got[0] == pytest.approx([ep[0] + 0.5 * at_p[0], ep[0] + 0.5 * at_a[0]])
    assert got[1] == pytest.approx([ep[1] + 0.5 * at_p[1], ep[1] + 0.5 * at_a[1], ep[1]])  # state 60: alone
    assert got[2] == pytest.approx([ep[2] + 0.5 * at_p[2], ep[2]])
    assert stats == {"anchored": 5, "turns": 7}
    assert got[0][1] > got[1][1]  # from the same state, the turn that reached the goal sooner
    # the episode-level estimators give every turn the episode's advantage
    for est in ("grpo", "dr_grpo", "rloo"):
        flat = turn_advantages([[short, long, lost]], est)
        assert flat == [[a] * t.num_turns for t, a in zip([short, long, lost], advantages([[short, long, lost]], est))]


def test_an_envs_state_key_groups_turns_whose_observations_differ():
    a = episode([([10], [50, 1], 0.0), ([11], [], 1.0)])  # observations with a clock: 50 1 and 50 2
    b = episode([([12], [50, 2], 0.0), ([13], [], 0.0)])
    ep = z([1.0, 0.0])
    got = turn_advantages([[a, b]], "gigpo", gamma=1.0)
    assert [got[0][1], got[1][1]] == pytest.approx(ep)  # second turns apart: no step advantage
    for t in (a, b):
        t.turns[0].state, t.turns[1].state = "start", "cell 5"
    got = turn_advantages([[a, b]], "gigpo", gamma=1.0)
    assert [got[0][1], got[1][1]] == pytest.approx([2 * ep[0], 2 * ep[1]])  # now compared: a's won


def test_similar_observations_share_a_step_group_and_mean_norm_does_not_divide():
    clock = tuple(range(100, 118))  # an observation of 18 tokens ...
    later = clock[:-1] + (999,)  # ... and the same one a clock tick later (ratio 34 / 36 = 0.94)
    assert step_groups([clock, later, (5, 6), ("state", 1), ("state", 1)]) == [0, 1, 2, 3, 3]
    assert step_groups([clock, later, (5, 6), ("state", 1), ("state", 1)], similarity=0.9) == [0, 0, 1, 2, 2]
    assert step_groups([clock, later], similarity=0.95) == [0, 1]
    a = episode([([10], list(clock), 0.0), ([11], [], 1.0)])
    b = episode([([12], list(later), 0.0), ([13], [], 0.0)])
    ep = z([1.0, 0.0])
    apart = turn_advantages([[a, b]], "gigpo", gamma=1.0)
    together = turn_advantages([[a, b]], "gigpo", gamma=1.0, similarity=0.9)
    assert [apart[0][1], apart[1][1]] == pytest.approx(ep)  # second turns apart: no step advantage
    assert [together[0][1], together[1][1]] == pytest.approx([2 * ep[0], 2 * ep[1]])  # compared: a's won
    assert not informative([a, episode([([12], list(later), 0.0), ([13], [], 1.0)])], "gigpo", similarity=0.9)
    # mean_norm: the group's mean taken off, not divided by its std, for the episode and the step advantages
    flat = turn_advantages([[a, b]], "gigpo", step_weight=0.5, gamma=1.0, mode="mean_norm", similarity=0.9)
    assert flat[0] == pytest.approx([0.5 + 0.5 * 0.5] * 2) and flat[1] == pytest.approx([-0.5 - 0.5 * 0.5] * 2)


def test_a_group_that_all_succeeded_still_teaches_the_shorter_path():
    short = episode([([10], [50], 0.0), ([11], [], 1.0)])
    long = episode([([12], [50], 0.0), ([13], [60], 0.0), ([14], [], 1.0)])
    assert not informative([short, long], "grpo") and informative([short, long], "gigpo")
    assert not informative([short, short], "gigpo")  # the same episode twice: nothing to compare
    assert informative([short, episode([([10], [50], 0.0), ([11], [], 0.0)])], "grpo")
    # a reward given at the end (an agent's return, a judge), not as a step's, counts as the last turn's
    late = episode([([10], [50], 0.0), ([11], [], 0.0)], reward=2.0)
    assert returns(late, 0.5) == [1.0, 2.0]


def test_several_contexts_and_positions_of_each_turns_advantage():
    first = episode([([10, 11], [50], 0.0)], tid="x")
    last = episode([([12], [60, 61], 0.0), ([13, 14, 15], [], 1.0)], prompt=[7, 8], tid="x")
    last.earlier = [first]
    assert anchor_states(last) == [tuple(P), (7, 8), (60, 61)]
    assert returns(last, 1.0) == [1.0, 1.0, 1.0]
    a = token_advantages([first, last], [[0.5], [-1.0, 2.0]], 7)
    # target j predicts token j + 1: turn 0 of `first` (tokens 3-4) sits at targets 2-3
    assert a[0].tolist() == [0, 0, 0.5, 0.5, 0, 0, 0]
    assert a[1].tolist() == [0, -1.0, 0, 0, 2.0, 2.0, 2.0]
    assert (a != 0).eq(Batch.of([first, last]).mask.bool()).all()


def test_gigpo_step_on_a_real_model(model_dir):
    policy = PolicyModel(model_dir)
    short = episode([([40, 41], [50, 51], 0.0), ([42], [], 1.0)], tid="s")
    long = episode([([60, 61], [50, 51], 0.0), ([62], [70], 0.0), ([63], [], 1.0)], tid="l")
    for t in (short, long):  # behaviour logprobs: the policy's own (fresh samples, ratio 1)
        b = Batch.of([t])
        t.logprobs = [0.0] + (policy.logprobs(b).detach() * b.mask)[0].tolist()
    assert GRPOTrainer(policy, GRPOConfig(lr=1e-2)).step([[short, long]])["trained_trajectories"] == 0  # no spread
    before = policy.logprobs(Batch.of([short, long])).detach()
    m = GRPOTrainer(policy, GRPOConfig(lr=1e-2, advantage="gigpo")).step([[short, long]])
    assert m["trained_trajectories"] == 2 and m["anchored_turns"] == pytest.approx(4 / 5) and m["logprob_diff"] < 1e-3
    gain = policy.logprobs(Batch.of([short, long])).detach() - before
    assert gain[0, 2:4].sum() > 0 and gain[1, 2:4].sum() < 0  # the first turns: the shorter path's gains


def test_gigpo_without_its_step_part_is_grpo(model_dir):
    """step_advantage_weight 0: the per-token advantages are the episode's, the same update bit for bit."""
    groups = [[episode([([40 + i], [50], 0.0), ([45], [], float(i))], tid=f"{j}{i}") for i in range(2)]
              for j in range(2)]
    updated = []
    for cfg in (GRPOConfig(lr=1e-2), GRPOConfig(lr=1e-2, advantage="gigpo", step_advantage_weight=0.0)):
        policy = PolicyModel(model_dir)
        for g in groups:
            for t in g:
                b = Batch.of([t])
                t.logprobs = [0.0] + (policy.logprobs(b).detach() * b.mask)[0].tolist()
        GRPOTrainer(policy, cfg).step(groups)
        updated.append(torch.cat([p.detach().flatten() for p in policy.parameters()]))
    assert torch.equal(updated[0], updated[1])


def test_gigpo_config_is_checked():
    assert TrainConfig.from_dict({"model": "m", "advantage": "gigpo", "gamma": 0.9}).gamma == 0.9
    with pytest.raises(ValueError, match="valid.*gigpo"):
        TrainConfig.from_dict({"model": "m", "advantage": "gipo"})
    with pytest.raises(ValueError, match="gamma"):
        TrainConfig.from_dict({"model": "m", "advantage": "gigpo", "gamma": 1.5})
    with pytest.raises(ValueError, match="valid.*mean_norm"):
        TrainConfig.from_dict({"model": "m", "advantage": "gigpo", "gigpo_mode": "std"})
    with pytest.raises(ValueError, match="gigpo_similarity"):
        TrainConfig.from_dict({"model": "m", "advantage": "gigpo", "gigpo_similarity": 0})
    assert TrainConfig.from_dict({"model": "m", "advantage": "gigpo", "gigpo_similarity": 0.9}).gigpo_similarity == 0.9
