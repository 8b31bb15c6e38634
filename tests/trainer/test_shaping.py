"""DAPO's overlong punishment (`overlong_buffer`, rollwise/trainer/shaping.py): the formula, where
each estimator takes it, and the run's max_tokens as the limit."""
from __future__ import annotations

import pytest

from rollwise.rl_config import TrainConfig
from rollwise.trainer.critic import positions
from rollwise.trainer.grpo import GRPOConfig, GRPOTrainer
from rollwise.trainer.policy import PolicyModel
from rollwise.trainer.shaping import Overlong

from tests.trainer.test_gae import fresh
from tests.trainer.test_gigpo import episode


def test_a_turn_loses_linearly_in_the_buffer_and_all_at_the_limit():
    o = Overlong(max_tokens=10, buffer=4, penalty=0.5)
    assert [o.turn(n) for n in (1, 6, 7, 9, 10)] == [0.0, 0.0, 0.125, 0.375, 0.5]
    t = episode([([40] * 7, [50], 0.0), ([41] * 2, [51], 0.0), ([42] * 10, [], 1.0)])
    assert o.tokens(t) == [0.0] * 6 + [0.125] + [0.0, 0.0] + [0.0] * 9 + [0.5]  # on each turn's last token
    assert o.metrics([t]) == {"overlong_penalty": pytest.approx(0.625), "overlong_turns": pytest.approx(2 / 3)}
    with pytest.raises(ValueError, match="within max_tokens"):
        Overlong(max_tokens=10, buffer=11)
    with pytest.raises(ValueError, match="overlong_penalty"):
        GRPOConfig(overlong_buffer=2, overlong_max_tokens=8, overlong_penalty=-1.0).check()
    run = TrainConfig.from_dict({"model": "m", "max_tokens": 48, "overlong_buffer": 16})
    assert run.trainer_config().overlong_max_tokens == 48
    with pytest.raises(ValueError, match="within max_tokens"):
        TrainConfig.from_dict({"model": "m", "max_tokens": 48, "overlong_buffer": 64})


@pytest.mark.parametrize("advantage", ["grpo", "gigpo", "reinforce_plus_plus", "gae"])
def test_a_group_that_all_solved_teaches_the_shorter_reply(model_dir, advantage):
    """Both episodes solved: GRPO has nothing to learn from them, unless one ran into the buffer."""
    policy = PolicyModel(model_dir)
    short, long = (episode([([40 + i] * n, [50], 0.0), ([42], [], 1.0)], tid=f"e{i}") for i, n in ((0, 2), (1, 7)))
    fresh(policy, [short, long])
    cfg = dict(advantage=advantage, overlong_max_tokens=8, overlong_buffer=4, overlong_penalty=1.0)
    trainer = GRPOTrainer(policy, GRPOConfig(**cfg))
    if advantage in ("grpo", "gigpo"):
        useful, adv = trainer._useful([[short, long]])
        assert len(useful) == 2 and adv[id(short)][0] > 0 > adv[id(long)][0]
        assert GRPOTrainer(policy, GRPOConfig(advantage=advantage))._useful([[short, long]])[0] == []
    trainer.begin(streamed=False)
    trainer.add([[short, long]])
    if advantage in ("reinforce_plus_plus", "gae"):  # per token: the turn's penalty on its last token
        (mb, b, a, ret, v), = trainer._acc["whiten"]
        r = [s.trajectory_id for s in mb].index("e1")
        last = positions(long)[6]  # the long turn's 7th token: 0.75 off; the episode's reward 1 on the last
        rewards = [0.0] * 6 + [-0.75] + [1.0]
        want = [sum(rewards[i:]) for i in range(8)]  # returns to go (gamma 1)
        assert ret[r, positions(long)].tolist() == pytest.approx(want) and ret[r, last] == pytest.approx(0.25)
    m = trainer.finish()
    assert m["trained_trajectories"] == 2 and m["overlong_penalty"] == pytest.approx(0.75 / 2)
    assert m["overlong_turns"] == pytest.approx(1 / 4)
