"""A user's environment named by file or module, and tasks read from files."""
from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from rollwise.agent.envs import load_tasks, make_env, resolve_env

EXAMPLE = Path(__file__).parents[2] / "examples" / "units_env.py"


def test_env_from_a_file_solves_its_tasks_file():
    tasks = load_tasks(EXAMPLE.with_name("units-train.jsonl"))
    assert len(tasks) == 256 and tasks[0]["id"] == "units-train-0"
    env_class = resolve_env(f"{EXAMPLE}:UnitsEnv")
    assert resolve_env(f"{EXAMPLE}:UnitsEnv") is env_class  # loaded once

    async def solve(task) -> float:
        env = make_env(f"{EXAMPLE}:UnitsEnv", max_turns=3)
        await env.reset(task)
        for action in env.expert(task):
            _, reward, done, _ = await env.step(action)
            if done:
                return reward
        return 0.0

    async def go():
        return [await solve(t) for t in tasks[:40]]
    assert asyncio.run(go()) == [1.0] * 40

    async def wrong():  # a wrong unit is the model's error, not a crash
        env = make_env(f"{EXAMPLE}:UnitsEnv")
        await env.reset(tasks[0])
        call = {"name": "convert", "arguments": {"value": 1.0, "from_unit": "parsec", "to_unit": "m"}}
        return await env.step(f"<tool_call>{json.dumps(call)}</tool_call>")
    obs, _, done, _ = asyncio.run(wrong())
    assert not done and "unknown unit 'parsec'" in obs[0]["content"]


def test_env_from_a_module_or_a_factory_function(tmp_path, monkeypatch):
    (tmp_path / "my_envs.py").write_text(
        "from rollwise.agent.envs.calculator import CalculatorEnv\n"
        "class Short(CalculatorEnv):\n    name = 'short'\n"
        "def make(max_turns=2):\n    return Short(max_turns=max_turns)\n"
        "not_callable = 3\n"
        "class NoStep:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    env = make_env("my_envs:make", max_turns=5)
    assert type(env).__name__ == "Short" and env.max_turns == 5
    assert make_env("my_envs:Short").name == "short"
    with pytest.raises(ValueError, match="no class or function 'not_callable'"):
        resolve_env("my_envs:not_callable")
    with pytest.raises(ValueError, match=r"without \['reset', 'step'\]"):
        make_env("my_envs:NoStep")
    sys.modules.pop("my_envs", None)


def test_bad_env_names_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="available: .*'calculator'.*package.module:Name"):
        resolve_env("calculater")
    with pytest.raises(ValueError, match="cannot load .*ModuleNotFoundError"):
        resolve_env("no_such_module_here:Env")
    with pytest.raises(ValueError, match="no such file"):
        resolve_env(f"{tmp_path}/missing.py:Env")
    (tmp_path / "broken.py").write_text("def f(:\n")
    with pytest.raises(ValueError, match="SyntaxError"):
        resolve_env(f"{tmp_path}/broken.py:Env")


def test_task_files(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([{"q": 1}, {"id": "x", "q": 2}]))
    assert load_tasks(tmp_path / "a.json") == [{"id": "a-0", "q": 1}, {"id": "x", "q": 2}]
    (tmp_path / "b.jsonl").write_text('{"q": 1}\n\n{"q": 2\n')
    with pytest.raises(ValueError, match="b.jsonl:3: not JSON"):
        load_tasks(tmp_path / "b.jsonl")
    (tmp_path / "c.jsonl").write_text('{"id": 1}\n{"id": 1}\n')
    with pytest.raises(ValueError, match="ids repeat"):
        load_tasks(tmp_path / "c.jsonl")
    (tmp_path / "d.json").write_text('{"q": 1}')
    with pytest.raises(ValueError, match="JSON list"):
        load_tasks(tmp_path / "d.json")
    (tmp_path / "e.jsonl").write_text('[1]\n')
    with pytest.raises(ValueError, match="task 0 is list"):
        load_tasks(tmp_path / "e.jsonl")
