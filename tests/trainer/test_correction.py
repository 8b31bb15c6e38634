"""Rollout correction (rollwise/trainer/correction.py): truncated or masked importance weights per
token or sequence, the veto, and what a GRPO step reports of them."""
from __future__ import annotations

import math

import pytest
import torch

from rollwise import LLM, SamplingParams
from rollwise.rl_config import TrainConfig
from rollwise.trainer.correction import is_weights
from rollwise.trainer.grpo import GRPOConfig, GRPOTrainer
from rollwise.trainer.policy import PolicyModel
from rollwise.types import Trajectory, TurnRecord

L = math.log


def test_token_weights_truncate_or_mask():
    lr = torch.tensor([[L(3.0), L(0.5), L(1.5), 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the last position is not generated
    w, dropped = is_weights(lr, mask, "token", "truncate", cap=2.0)
    assert w[0, :3].tolist() == pytest.approx([2.0, 0.5, 1.5]) and not dropped.any()
    w, dropped = is_weights(lr, mask, "token", "mask", cap=2.0, low=0.6)
    assert w[0, :3].tolist() == pytest.approx([0.0, 0.0, 1.5]) and dropped.tolist() == [[True, True, False, False]]


def test_sequence_and_geometric_weights_carry_one_ratio_per_row():
    lr = torch.tensor([[L(2.0), L(2.0), 0.0], [L(0.5), L(1.0), L(1.0)]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    w, _ = is_weights(lr, mask, "sequence", "truncate", cap=10.0)
    assert w[0, :2].tolist() == pytest.approx([4.0, 4.0]) and w[1].tolist() == pytest.approx([0.5] * 3)
    w, _ = is_weights(lr, mask, "geometric", "truncate", cap=10.0)
    assert w[0, :2].tolist() == pytest.approx([2.0, 2.0]) and w[1].tolist() == pytest.approx([0.5 ** (1 / 3)] * 3)
    w, dropped = is_weights(lr, mask, "sequence", "mask", cap=3.0)  # row 0's product 4 is out: all of it
    assert w[0, :2].tolist() == [0.0, 0.0] and dropped.tolist() == [[True, True, False], [False] * 3]
    huge = torch.tensor([[500.0, 500.0]])  # a product past float range: capped, or masked, never inf
    assert is_weights(huge, torch.ones(1, 2), "sequence", "truncate", cap=2.0)[0].tolist() == [[2.0, 2.0]]
    assert is_weights(huge, torch.ones(1, 2), "sequence", "mask", cap=2.0)[0].tolist() == [[0.0, 0.0]]


def test_veto_drops_the_whole_sequence_of_a_near_impossible_token():
    lr = torch.tensor([[0.0, L(1e-6), 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    w, dropped = is_weights(lr, mask, veto=1e-4)
    assert w[0].tolist() == [0.0] * 3 and w[1, :2].tolist() == [1.0, 1.0]
    assert dropped.tolist() == [[True] * 3, [False] * 3]


def _stale(model_dir: str, n: int) -> list[Trajectory]:
    """Samples of version 0 (the trainer will be at version 1: stale, so unchecked), one per prompt."""
    prompts = [[5 + i, 17, 300 + i, 42] for i in range(n)]
    outs = LLM(model_dir, seed=3).generate(prompts, SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True,
                                                                   seed=3))
    return [Trajectory(trajectory_id=f"t{i}", group_id="g", task={}, token_ids=p + o.token_ids,
                       loss_mask=[0] * 4 + [1] * 6, logprobs=[0.0] * 4 + o.logprobs, reward=float(i % 2),
                       turns=[TurnRecord(start=4, num_generated=6, num_observation=0, finish_reason="length",
                                         policy_version=0, num_cached_tokens=0, generation_s=0, tool_s=0)])
            for i, (p, o) in enumerate(zip(prompts, outs))]


@pytest.mark.parametrize("level, mode, veto, dropped", [("token", "truncate", 0.0, 0), ("token", "mask", 0.0, 1),
                                                        ("sequence", "mask", 0.0, 6), ("token", "truncate", 1e-2, 6)])
def test_a_step_reports_what_the_correction_dropped(model_dir, level, mode, veto, dropped):
    trajs = _stale(model_dir, 4)
    trajs[0].logprobs[5] -= 4.0  # the rollout found token 1 of trajectory 0 far less likely: ratio e^4
    if veto:
        trajs[0].logprobs[5] += 9.0  # ... or far more: ratio e^-5, under the veto
    trainer = GRPOTrainer(PolicyModel(model_dir), GRPOConfig(lr=1e-3, is_level=level, is_mode=mode, is_veto=veto))
    trainer.version = 1
    m = trainer.step([trajs])
    assert m["is_dropped"] == pytest.approx(dropped / 24)
    # k3 of KL(behaviour || trainer): the one perturbed token's, the rest agree to rounding
    d = 5.0 if veto else -4.0
    assert m["behaviour_kl"] == pytest.approx((math.exp(-d) - 1 + d) / 24, rel=1e-3)


def test_correction_config_is_checked():
    cfg = TrainConfig.from_dict({"model": "m", "is_level": "geometric", "is_mode": "mask", "is_low": 0.5})
    assert (cfg.is_level, cfg.is_mode, cfg.is_low) == ("geometric", "mask", 0.5)
    with pytest.raises(ValueError, match="valid.*token.*sequence.*geometric"):
        TrainConfig.from_dict({"model": "m", "is_level": "seq"})
    with pytest.raises(ValueError, match="valid.*truncate.*mask"):
        GRPOTrainer(None, GRPOConfig(is_mode="clip"))
    with pytest.raises(ValueError, match="is_low < tis_cap"):
        TrainConfig.from_dict({"model": "m", "is_mode": "mask", "is_low": 3.0})
