"""Episodes run again when their environment raises or no replica serves them (`run_attempts`)."""
from __future__ import annotations

import asyncio

import pytest

from rollwise.agent.env import ToolEnv
from rollwise.agent.episode import GenerationError, collect, run_attempts
from rollwise.agent.generator import ScriptedGenerator
from rollwise.engine.tokenizer import Tokenizer
from rollwise.agent.tools import Tool
from rollwise.rl_config import TrainConfig
from rollwise.rollout.pipeline import Group
from rollwise.types import SamplingParams


class FlakyEnv(ToolEnv):
    name = "flaky"

    def make_tools(self, task):
        def boom() -> str:
            """Always fails."""
            raise RuntimeError("kaput")
        return [Tool(boom)]

    def prompt(self, task):
        return "go"

    def score(self, task, answer):
        return float(answer.strip() == "ok")


class Seeds(ScriptedGenerator):
    """Answers "ok"; records each request's seed; raises for its first `fail` calls."""

    def __init__(self, tok, fail=0, delay=0.0):
        super().__init__(tok, lambda req: "ok", delay=delay)
        self.seeds, self.fail = [], fail

    async def generate(self, request):
        self.seeds.append(request.params.seed)
        if self.fail > 0:
            self.fail -= 1
            raise ConnectionError("no replica")
        return await super().generate(request)


def crashing(first_n: int):
    """An env factory whose first `first_n` envs raise in step (an env bug, a crashed agent)."""
    made = []

    class Crashing(FlakyEnv):
        async def step(self, action):
            if made.index(self) < first_n:
                raise KeyError("env bug")
            return await super().step(action)

    def make():
        made.append(Crashing())
        return made[-1]
    return make, made


def test_an_episode_whose_env_raised_is_run_again_on_a_fresh_env_with_another_seed(model_dir):
    tok = Tokenizer(model_dir)
    make, made = crashing(1)
    gen = Seeds(tok)
    t = asyncio.run(run_attempts(gen, make, {}, SamplingParams(seed=3), retries=2))
    assert t.status == "done" and t.reward == 1.0 and len(made) == 2
    assert t.retried == ["error: KeyError: 'env bug'"] and t.error is None
    assert len(gen.seeds) == 2 and gen.seeds[0] != gen.seeds[1]
    # reproducible: the same failures give the same seeds; attempt 0 is the plain episode's
    make, _ = crashing(1)
    again = Seeds(tok)
    asyncio.run(run_attempts(again, make, {}, SamplingParams(seed=3), retries=2))
    assert again.seeds == gen.seeds
    plain = Seeds(tok)
    asyncio.run(run_attempts(plain, crashing(0)[0], {}, SamplingParams(seed=3)))
    assert plain.seeds == gen.seeds[:1]


def test_when_every_attempt_fails_the_last_one_stands(model_dir):
    tok = Tokenizer(model_dir)
    make, made = crashing(10)
    t = asyncio.run(run_attempts(Seeds(tok), make, {}, SamplingParams(seed=1), retries=2))
    assert t.status == "error" and "env bug" in t.error and len(made) == 3 and len(t.retried) == 2
    make, made = crashing(10)
    t = asyncio.run(run_attempts(Seeds(tok), make, {}, SamplingParams(seed=1), retries=0))
    assert t.status == "error" and len(made) == 1 and t.retried == []


def test_only_the_named_statuses_are_retried(model_dir):
    tok = Tokenizer(model_dir)
    loop = ScriptedGenerator(tok, lambda req: '<tool_call>{"name": "boom", "arguments": {}}</tool_call>')
    made = []

    def make():
        made.append(FlakyEnv(max_turns=2))
        return made[-1]
    t = asyncio.run(run_attempts(loop, make, {}, SamplingParams(), retries=3))
    assert t.status == "max_turns" and len(made) == 1 and t.retried == []
    t = asyncio.run(run_attempts(loop, make, {}, SamplingParams(), retries=1, retry_on=("max_turns", "error")))
    assert t.status == "max_turns" and len(made) == 3 and t.retried == ["max_turns"]
    with pytest.raises(ValueError, match="valid statuses"):
        asyncio.run(run_attempts(loop, make, {}, SamplingParams(), retry_on=("done",)))


def test_a_generator_failure_is_retried_after_a_wait_then_raised(model_dir):
    tok = Tokenizer(model_dir)
    gen = Seeds(tok, fail=1)
    t = asyncio.run(run_attempts(gen, FlakyEnv, {}, SamplingParams(seed=2), retries=1, backoff_s=0.01))
    assert t.status == "done" and t.retried == ["generation: no replica"]
    gen = Seeds(tok, fail=5)
    with pytest.raises(GenerationError, match="no replica"):
        asyncio.run(run_attempts(gen, FlakyEnv, {}, SamplingParams(seed=2), retries=2, backoff_s=0.01))
    assert len(gen.seeds) == 3


def test_collect_retries_and_the_rollout_log_keeps_why(model_dir):
    tok = Tokenizer(model_dir)
    make, made = crashing(3)

    async def go():
        return [g async for g in collect(Seeds(tok, delay=0.01), make, [{"id": 0}], SamplingParams(seed=0), group_size=4,
                                         retries=1)]
    [group] = asyncio.run(go())  # (the four start at once: the first three envs fail, their second ones do not)
    assert [t.status for t in group] == ["done"] * 4 and len(made) == 7
    assert sum(len(t.retried) for t in group) == 3
    back = Group.from_json(Group(0, 0, {"id": 0}, 0, group).to_json())
    assert [t.retried for t in back.trajectories] == [t.retried for t in group]


def test_train_config_checks_the_retry_keys():
    assert TrainConfig(model="m").episode_retries == 2 and TrainConfig(model="m").retry_statuses == ["error"]
    with pytest.raises(ValueError, match="valid statuses"):
        TrainConfig.from_dict({"model": "m", "retry_statuses": ["done"]})
    with pytest.raises(ValueError, match="episode_retries"):
        TrainConfig.from_dict({"model": "m", "episode_retries": -1})
