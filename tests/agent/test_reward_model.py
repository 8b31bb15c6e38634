"""A learned reward model as the reward: a real sequence classifier (transformers), batched."""
from __future__ import annotations

import asyncio
import pytest
import torch

from rollwise.agent.envs import make_env
from rollwise.agent.reward_model import RewardModel, RewardModelConfig


def alone(rm: RewardModel, ids: list[int]) -> float:
    """The model's own forward of one sequence, unpadded, pooled at its last token."""
    with torch.inference_mode():
        return float(rm.model(input_ids=torch.tensor([ids])).logits[0, 0])


def test_batched_scores_equal_each_answers_forward_alone(rm_dir):
    answers = ["Paris.", "It is Paris, the capital of France, on the Seine." * 3, "", "Lyon? No: Paris."]
    convs = [[{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": a}] for a in answers]

    async def go():
        rm = await RewardModel.shared(RewardModelConfig.from_dict({"path": rm_dir, "batch_size": 8}))
        return rm, await asyncio.gather(*(rm.score(c) for c in convs))
    rm, got = asyncio.run(go())
    assert rm.forwards == 1  # the concurrent answers in one batch, padded on the left
    want = [alone(rm, rm.encode(c)) for c in convs]
    assert got == pytest.approx(want, abs=1e-5) and len(set(round(x, 4) for x in got)) == 4
    assert rm.encode(convs[1])[-3:] == rm.tokenizer.apply_chat_template(convs[1], tokenize=True)["input_ids"][-3:]
    short = RewardModel(RewardModelConfig.from_dict({"path": rm_dir, "max_length": 8, "scale": 2.0, "shift": 1.0}))
    ids = short.encode(convs[1])
    assert len(ids) == 8 and ids == rm.encode(convs[1])[-8:]  # cut from the left: the answer's end stays
    assert short.scores([ids]) == pytest.approx([2.0 * alone(rm, ids) + 1.0], abs=1e-5)


def test_the_dataset_env_scores_answers_with_the_reward_model(rm_dir):
    env = make_env("dataset", reward="model", reward_model={"path": rm_dir})
    task = {"id": "t", "prompt": "Capital of France?"}

    async def go():
        await env.reset(task)
        _, reward, done, _ = await env.step("<think>hmm</think> Paris.")
        rm = await RewardModel.shared(env.reward_model)
        return reward, done, rm
    reward, done, rm = asyncio.run(go())
    conv = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."}]
    assert done and reward == pytest.approx(alone(rm, rm.encode(conv)), abs=1e-5)


def test_bad_reward_model_options_are_value_errors(rm_dir, model_dir, tmp_path):
    for options, why in [({"reward": "model"}, "needs reward_model"),
                         ({"reward": "exact", "reward_model": {"path": rm_dir}}, "reward_model options need it"),
                         ({"reward": "model", "reward_model": {"path": rm_dir, "size": 3}}, "unknown reward_model"),
                         ({"reward": "model", "reward_model": {}}, "needs path"),
                         ({"reward": "model", "reward_model": {"path": str(tmp_path)}}, "no config.json"),
                         ({"reward": "model", "reward_model": {"path": rm_dir, "dtype": "fp8"}}, "not one of"),
                         ({"reward": "model", "reward_model": {"path": rm_dir, "max_length": 1}}, "max_length")]:
        with pytest.raises(ValueError, match=why):
            make_env("dataset", **options)
    with pytest.raises(ValueError, match="is not a reward model"):  # a causal LM's checkpoint
        RewardModel(RewardModelConfig.from_dict({"path": model_dir}))
