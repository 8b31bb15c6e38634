"""KL in the reward (`reward_kl_coef`, rollwise/trainer/kl_reward.py): the controller, the per-token
KL against its definition, the penalty in each estimator's advantages, and the adapted beta kept."""
from __future__ import annotations

import pytest
import torch

from rollwise.rl_config import TrainConfig
from rollwise.trainer.critic import estimate, positions
from rollwise.trainer.grpo import GRPOConfig, GRPOTrainer
from rollwise.trainer.kl_reward import RewardKL
from rollwise.trainer.policy import Batch, PolicyModel

from tests.trainer.test_gae import fresh
from tests.trainer.test_gigpo import episode


def test_the_adaptive_controller_moves_beta_toward_the_target_and_the_fixed_one_does_not():
    def stepped(target, kl, n=100, horizon=1000):
        r = RewardKL(lambda mb, b: None, 0.1, target, horizon)
        r._kls = {i: (None, [kl] * 3) for i in range(n)}  # n episodes, each `kl` per token
        m = r.finish()
        return m, r.value
    m, beta = stepped(0.05, 0.06)
    assert m == {"reward_kl_coef": 0.1, "reward_kl": pytest.approx(0.06)}
    assert beta == pytest.approx(0.1 * (1 + 0.2 * 100 / 1000))  # 0.06 / 0.05 - 1 = 0.2: up
    assert stepped(0.05, 0.5)[1] == pytest.approx(0.1 * 1.02)  # the error is clipped at 0.2
    assert stepped(0.05, 0.0)[1] == pytest.approx(0.1 * 0.98)  # under the target: down
    assert stepped(0.0, 0.5)[1] == 0.1  # no target: fixed
    with pytest.raises(ValueError, match="reward_kl_horizon"):
        RewardKL(lambda mb, b: None, 0.1, 0.05, 0)


def test_penalties_lower_each_tokens_reward_and_the_returns_discount_them():
    a = episode([([10, 11], [50], 0.0), ([12], [], 1.0)], tid="a")
    (_, _, adv, _, _), = estimate([a], 0.5, 1.0, 64, penalty={id(a): [0.1, 0.2, 0.4]})
    # returns to go of rewards [0 - 0.1, 0 - 0.2, 1 - 0.4] at gamma 0.5
    assert adv[0, positions(a)].tolist() == pytest.approx([-0.1 + 0.5 * (-0.2 + 0.5 * 0.6), -0.2 + 0.5 * 0.6, 0.6])


def moved(model_dir, advantage="grpo"):
    """A trainer whose policy took a step away from its reference (the weights at the start)."""
    policy = PolicyModel(model_dir)
    won, lost = episode([([40, 41], [], 1.0)], tid="w"), episode([([60, 61], [], 0.0)], tid="l")
    fresh(policy, [won, lost])
    trainer = GRPOTrainer(policy, GRPOConfig(lr=3e-2, reward_kl_coef=0.5, reward_kl_target=0.01,
                                             reward_kl_horizon=4, advantage=advantage))
    m = trainer.step([[won, lost]])
    return trainer, m


def test_the_per_token_kl_is_the_policys_logprob_less_the_references(model_dir):
    trainer, m = moved(model_dir)
    assert m["reward_kl"] == 0.0 and m["reward_kl_coef"] == 0.5  # step 1: the policy was the reference, bit for bit
    assert trainer.reward_kl.value == pytest.approx(0.5 * (1 - 0.2 * 2 / 4))  # KL 0 < target: beta down
    t = episode([([40, 45, 46], [], 1.0)], tid="x")
    kls = trainer.reward_kl.token_kls([t])[id(t)]
    b = Batch.of([t])
    with torch.no_grad():
        lp = trainer.policy.logprobs(b)[0, positions(t)]
        ref = torch.log_softmax(trainer.snap.ref(input_ids=b.input_ids).logits[0, :-1], -1)
        lp_ref = ref[positions(t), b.targets[0, positions(t)]]
    assert kls == pytest.approx((lp - lp_ref).tolist(), abs=1e-5) and max(map(abs, kls)) > 1e-3
    assert trainer.reward_kl.token_kls([t])[id(t)] is kls  # once a step


def test_an_equal_reward_group_teaches_with_kl_in_the_reward_and_the_checkpoint_keeps_beta(model_dir):
    trainer, _ = moved(model_dir)
    same = fresh(trainer.policy, [episode([([40 + i, 41], [], 1.0)], tid=f"s{i}") for i in range(3)])
    useful, adv = trainer._useful([same])
    assert len(useful) == 3 and len({round(adv[id(t)][0], 6) for t in same}) == 3  # their KLs differ
    kls = trainer.reward_kl.token_kls(same)
    r = torch.tensor([1.0 - trainer.reward_kl.value * sum(kls[id(t)]) for t in same], dtype=torch.float64)
    assert [adv[id(t)][0] for t in same] == pytest.approx(((r - r.mean()) / (r.std() + 1e-6)).tolist())
    trainer.reward_kl.finish()
    plain = GRPOTrainer(trainer.policy, GRPOConfig())
    assert plain._useful([same])[0] == []  # without it, the same group carries no advantage
    again = GRPOTrainer(PolicyModel(model_dir), GRPOConfig(reward_kl_coef=0.5, reward_kl_target=0.01))
    again.load_state(trainer.state())
    assert again.reward_kl.value == trainer.reward_kl.value != 0.5


@pytest.mark.parametrize("advantage", ["gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gigpo"])
def test_every_estimator_takes_the_penalty(model_dir, advantage):
    trainer, _ = moved(model_dir, advantage)
    same = fresh(trainer.policy, [episode([([40 + i, 41], [50], 0.0), ([42], [], 1.0)], tid=f"s{i}")
                                  for i in range(2)])
    kls = trainer.reward_kl.token_kls(same)
    assert all(len(kls[id(t)]) == 3 for t in same)
    trainer.begin(streamed=False)
    trainer.add([same])
    if advantage == "gigpo":  # the episode advantages differ by the penalties
        useful, adv = trainer._useful([same])
        assert len(useful) == 2 and adv[id(same[0])][0] == pytest.approx(-adv[id(same[1])][0])
    else:  # per token: the returns less the discounted penalties
        (_, b, a, ret, v), = trainer._acc["whiten"]
        if advantage != "reinforce_plus_plus_baseline":
            t = same[0]
            row = [s.trajectory_id for s in trainer._acc["whiten"][0][0]].index(t.trajectory_id)
            pen = [trainer.reward_kl.value * k for k in kls[id(t)]]
            expect = [1.0 - sum(pen[j:]) for j in range(3)]  # gamma 1: the rewards to go, less the penalties'
            assert (ret[row, positions(t)]).tolist() == pytest.approx(expect, abs=1e-5)
        else:
            assert a[b.mask > 0].abs().max() > 0  # equal rewards, different KLs: not all 0
    trainer.finish()


def test_reward_kl_config_is_checked():
    with pytest.raises(ValueError, match="reward_kl_coef"):
        TrainConfig.from_dict({"model": "m", "reward_kl_coef": -0.1})
    assert TrainConfig.from_dict({"model": "m", "reward_kl_coef": 0.1}).trainer_config().reward_kl_coef == 0.1


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> str:
    """A teacher of another size on the test model's vocabulary (conftest's qwen3: 1024 tokens)."""
    from rollwise.make_model import make_model
    return str(make_model(tmp_path_factory.mktemp("teacher"), family="qwen3", layers=1, hidden=96, heads=4,
                          kv_heads=2, vocab=1024, std=0.1, seed=11, tie=True, head_dim=24))


def test_a_reference_model_is_a_teacher_and_its_reverse_kl_is_the_reward(model_dir, teacher_dir):
    """reference_model: the KL's reference is that model (any size, the same vocabulary), not a copy of the
    policy; each token's KL is the policy's logprob less the teacher's (on-policy distillation)."""
    from transformers import AutoModelForCausalLM
    trainer = GRPOTrainer(PolicyModel(model_dir), GRPOConfig(reward_kl_coef=1.0, reference_model=teacher_dir))
    assert trainer.snap.ref is None and trainer.snap.teacher is not None  # (no copy of the policy kept)
    t = episode([([40, 45, 46], [50], 0.0), ([47], [], 1.0)], tid="x")
    kls = trainer.reward_kl.token_kls([t])[id(t)]
    b = Batch.of([t])
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32)
    with torch.no_grad():
        lp = trainer.policy.logprobs(b)[0, positions(t)]
        ref = torch.log_softmax(teacher(input_ids=b.input_ids).logits[0, :-1], -1)
        lp_ref = ref[positions(t), b.targets[0, positions(t)]]
    assert kls == pytest.approx((lp - lp_ref).tolist(), abs=1e-5) and max(map(abs, kls)) > 0.1
    cfg = TrainConfig.from_dict({"model": "m", "reward_kl_coef": 1.0, "reference_model": teacher_dir})
    assert cfg.trainer_config().reference_model == teacher_dir


def test_distilling_on_the_policys_own_samples_brings_it_toward_the_teacher(model_dir, teacher_dir):
    """Steps on the policy's own samples with the teacher's reverse KL as each token's reward (REINFORCE++,
    no discount: on-policy distillation) shrink the true KL(policy || teacher) where they were drawn."""
    from transformers import AutoModelForCausalLM
    prompt = [1, 9, 17, 33]
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32)
    policy = PolicyModel(model_dir)

    def next_logprobs(model) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1], -1)

    def true_kl() -> float:
        lp, lt = next_logprobs(policy.model), next_logprobs(teacher)
        return float((lp.exp() * (lp - lt)).sum())

    trainer = GRPOTrainer(policy, GRPOConfig(lr=1e-2, reward_kl_coef=1.0, reference_model=teacher_dir,
                                             advantage="reinforce_plus_plus", gae_gamma=0.0))
    g = torch.Generator().manual_seed(0)
    kl = [true_kl()]
    for step in range(10):
        drawn = torch.multinomial(next_logprobs(policy.model).exp(), 64, replacement=True, generator=g)
        eps = fresh(policy, [episode([([int(x)], [], 0.0)], prompt=prompt, tid=f"{step}-{i}")
                             for i, x in enumerate(drawn)])
        trainer.step([[e] for e in eps])
        kl.append(true_kl())
    assert kl[0] > 0.5 and kl[-1] < 0.75 * kl[0], kl  # (0.82 -> 0.51 when written)


def test_a_reference_model_is_checked(model_dir, tmp_path):
    from rollwise.make_model import make_model
    other_vocab = str(make_model(tmp_path / "v", family="qwen3", layers=1, hidden=64, heads=4, kv_heads=2,
                                 vocab=2048, head_dim=16))
    for bad, match in ((other_vocab, "vocabulary of 2048"), (str(tmp_path), "not a model directory")):
        with pytest.raises(ValueError, match=match):
            GRPOTrainer(PolicyModel(model_dir), GRPOConfig(reward_kl_coef=1.0, reference_model=bad))
    with pytest.raises(ValueError, match="reference_model is the KL reference"):
        GRPOTrainer(PolicyModel(model_dir), GRPOConfig(reference_model=other_vocab))
