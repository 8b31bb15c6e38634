"""env = "mix": several environments in one run, each task naming its own; drawn by weight, solved
by each env's expert, trained and evaluated together."""
from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import pytest

from rollwise.agent.envs import make_env
from rollwise.agent.episode import collect
from rollwise.agent.generator import ScriptedGenerator, expert_policy
from rollwise.engine.tokenizer import Tokenizer
from rollwise.evaluation import evaluate_model
from rollwise.rl import TrainConfig, train
from rollwise.types import SamplingParams

ENVS = {"phonebook": {}, "calculator": {"max_turns": 3}}


def mix(**kw):
    return make_env("mix", envs=ENVS, weights={"phonebook": 2}, max_turns=5, **kw)


def test_tasks_are_drawn_by_weight_tagged_and_each_runs_on_its_own_env(model_dir):
    tasks = mix().sample_tasks(30, seed=1)
    assert Counter(t["env"] for t in tasks) == {"phonebook": 20, "calculator": 10}
    assert len({t["id"] for t in tasks}) == 30 and all(t["id"].startswith(t["env"] + "/") for t in tasks)
    assert tasks == mix().sample_tasks(30, seed=1) and tasks != mix().sample_tasks(30, seed=2)
    gen = ScriptedGenerator(Tokenizer(model_dir), expert_policy(mix, tasks))

    async def go():
        return [t for g in [g async for g in collect(gen, mix, tasks, SamplingParams(max_tokens=128), group_size=1)]
                for t in g]
    trajs = asyncio.run(go())
    assert all(t.status == "done" and t.reward == 1.0 for t in trajs), [t.error for t in trajs if t.error]
    env = mix()
    asyncio.run(env.reset(tasks[[t["env"] for t in tasks].index("calculator")]))
    assert env.max_turns == 3 and "calculator" in [t.name for t in env.tools]  # its own options, its own tools
    env.bind_generator("generator", "tokenizer", "params", "traj")  # (the episode loop's, before reset)
    asyncio.run(env.reset(tasks[[t["env"] for t in tasks].index("phonebook")]))
    assert env.max_turns == 5  # the run's max_turns where the env sets none
    assert env.inner._policy == ("generator", "tokenizer", "params", "traj")  # handed on to the episode's env


def test_bad_mixes_and_tasks_are_value_errors(model_dir):
    with pytest.raises(ValueError, match="unknown environment 'calculater'"):
        make_env("mix", envs={"calculater": {}})
    with pytest.raises(ValueError, match="not among envs"):
        make_env("mix", envs=ENVS, weights={"sql": 1})
    with pytest.raises(ValueError, match="at least one env"):
        make_env("mix", envs={})
    with pytest.raises(ValueError, match='needs an "env" field'):
        asyncio.run(mix().reset({"id": 1, "question": "?"}))


def test_train_and_evaluate_a_mix(model_dir, tmp_path):
    cfg = TrainConfig.from_dict({"model": model_dir, "run_dir": str(tmp_path / "run"), "env": "mix",
                                 "env_options": {"envs": ENVS, "weights": {"phonebook": 2}},
                                 "sft_steps": 3, "sft_tasks": 8, "steps": 2, "groups_per_step": 2, "group_size": 2,
                                 "max_tokens": 16, "max_turns": 2, "eval_tasks": 6, "progress": False})
    report = train(cfg)
    assert len(report["steps"]) == 2 and report["eval_tasks"] == 6
    for key in ("sft_success_by_env", "rl_success_by_env"):  # success per env, before and after RL
        assert set(report[key]) <= {"phonebook", "calculator"} and report[key]
        assert all(0.0 <= v <= 1.0 for v in report[key].values())
    assert {t["env"] for t in make_env("mix", envs=ENVS).sample_tasks(8, seed=1)} == {"phonebook", "calculator"}
    example = TrainConfig.from_toml(Path(__file__).parents[2] / "examples" / "train-mix.toml", model=model_dir)
    assert example.env == "mix" and make_env("mix", **example.env_options).weights == {"phonebook": 2.0, "calculator": 1.0}
    got = evaluate_model(TrainConfig.from_dict({**cfg.__dict__, "model": str(Path(cfg.run_dir) / "final-model")}))
    assert set(got["success_by_env"]) <= {"phonebook", "calculator"} and got["tasks"] == 6
