"""True on-policy: the trainer's logprobs of tokens batch-invariant replicas sampled are theirs, bit for
bit, with transformers' gradients."""
from __future__ import annotations

import random

import pytest
import torch

from rollwise import LLM, SamplingParams
from rollwise.trainer.grpo import GRPOConfig, GRPOTrainer, LogprobMismatch
from rollwise.trainer.policy import Batch, PolicyModel
from rollwise.types import Trajectory, TurnRecord


def _rollouts(model_dir: str, temperature: float, invariant: bool = True, shared: int = 0,
              **engine) -> list[Trajectory]:
    """Seeded samples of a batch-invariant engine (a default one with invariant=False), two turns
    each: the second turn's prompt is the first's tokens plus an observation (from the prefix
    cache), as in an episode; the prompts start with `shared` common tokens."""
    rng = random.Random(0)
    llm = LLM(model_dir, kv_cache_gb=0.05, batch_invariant=invariant, **engine)
    head = [rng.randrange(10, 1000) for _ in range(shared)]
    prompts = [head + [rng.randrange(10, 1000) for _ in range(rng.randint(3, 40))] for _ in range(6)]
    trajs = [Trajectory(trajectory_id=f"t{i}", group_id="g", task={}, token_ids=list(p), loss_mask=[0] * len(p),
                        logprobs=[0.0] * len(p)) for i, p in enumerate(prompts)]
    for turn in range(2):
        params = [SamplingParams(temperature=temperature, seed=10 * turn + i, max_tokens=12, ignore_eos=True)
                  for i in range(len(trajs))]
        for i, (t, o) in enumerate(zip(trajs, llm.generate([t.token_ids for t in trajs], params))):
            obs = [rng.randrange(10, 1000) for _ in range(5)]
            t.turns.append(TurnRecord(start=len(t.token_ids), num_generated=len(o.token_ids), num_observation=len(obs),
                                      finish_reason="length", policy_version=0, num_cached_tokens=0,
                                      generation_s=0, tool_s=0, replica="r0"))
            t.reward = float(i % 2)
            t.token_ids += o.token_ids + obs
            t.loss_mask += [1] * len(o.token_ids) + [0] * len(obs)
            t.logprobs += o.logprobs + [0.0] * len(obs)
    return trajs


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_trainer_logprobs_equal_the_rollouts_bit_for_bit(model_dirs, family):
    d = model_dirs[family]
    for temperature, engine in ((1.0, {}), (0.7, dict(speculative="suffix", spec_controller="always"))):
        b = Batch.of(_rollouts(d, temperature, **engine))
        plain, exact = PolicyModel(d), PolicyModel(d)
        exact.enable_exact()
        lp_plain = plain.logprobs(b, temperature)
        lp = exact.logprobs(b, temperature)
        on = b.mask > 0
        assert torch.equal(lp.detach()[on], b.behaviour_logprobs[on])  # exact
        assert not torch.equal(lp_plain.detach()[on], b.behaviour_logprobs[on])  # transformers' rounding
        assert (lp_plain.detach() - lp.detach())[on].abs().max() < 1e-4
        # the gradient is transformers': the same as without exact values
        (lp_plain * b.mask).sum().backward()
        (lp * b.mask).sum().backward()
        for p, q in zip(plain.model.parameters(), exact.model.parameters()):
            assert torch.equal(p.grad, q.grad)


def test_the_shared_prefix_forward_keeps_the_values_exact(model_dir):
    """A group's common prompt runs once in the trainer (transformers' KV shared by the rows): the
    values are still the engine's."""
    b = Batch.of(_rollouts(model_dir, 1.0, shared=40))
    assert b.shared >= 40
    policy = PolicyModel(model_dir)
    policy.enable_exact()
    on = b.mask > 0
    assert torch.equal(policy.logprobs(b).detach()[on], b.behaviour_logprobs[on])


def test_exact_values_follow_the_trainers_weights(model_dir):
    """After an update (or under a kept older version) the values are those of the weights now held."""
    b = Batch.of(_rollouts(model_dir, 1.0))
    policy = PolicyModel(model_dir)
    policy.enable_exact()
    before = policy.logprobs(b).detach()
    assert torch.equal(policy.logprobs(b).detach(), before) and policy.exact.loads == 1  # unchanged: not copied again
    with torch.no_grad():
        for p in policy.model.parameters():
            p.mul_(1.01)
    after = policy.logprobs(b).detach()
    assert policy.exact.loads == 2
    plain = PolicyModel(model_dir)
    plain.model.load_state_dict(policy.model.state_dict())
    on = b.mask > 0
    assert not torch.equal(before[on], after[on])
    assert (plain.logprobs(b).detach() - after)[on].abs().max() < 1e-4


def test_a_true_on_policy_step_has_ratio_exactly_one_and_refuses_other_rounding(model_dir):
    policy = PolicyModel(model_dir)
    policy.enable_exact()
    trainer = GRPOTrainer(policy, GRPOConfig(logprob_tolerance=0.0))
    trajs = _rollouts(model_dir, 1.0)
    m = trainer.step([trajs[:3], trajs[3:]])
    assert m["logprob_diff"] == 0.0 and m["is_weight_mean"] == 1.0 and m["clip_frac"] == 0.0
    assert m["trained_tokens"] > 0 and m["grad_norm"] > 0
    # rollouts of a default engine: right to 1e-6, not to the bit
    other = _rollouts(model_dir, 1.0, invariant=False)
    for t in other:
        for tr in t.turns:
            tr.policy_version = trainer.version
    with pytest.raises(LogprobMismatch, match="batch-invariant"):
        trainer.step([other[:3], other[3:]])
