"""A user's environment named by file or module, and tasks read from files."""
from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from rollwise.agent.envs import load_tasks, make_env, resolve_env

EXAMPLE = Path(__file__).parents[2] / "examples" / "units_env.py"


def test_env_from_a_file_solves_its_tasks_file(expert_rewards):
    tasks = load_tasks(EXAMPLE.with_name("units-train.jsonl"))
    assert len(tasks) == 256 and tasks[0]["id"] == "units-train-0"
    env_class = resolve_env(f"{EXAMPLE}:UnitsEnv")
    assert resolve_env(f"{EXAMPLE}:UnitsEnv") is env_class  # loaded once
    assert expert_rewards(lambda: make_env(f"{EXAMPLE}:UnitsEnv", max_turns=3), tasks[:40]) == [1.0] * 40

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
    with pytest.raises(ValueError, match="available: .*'calculator'.*package.module:name"):
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


def test_dataset_env_prompt_reward_and_tools(tmp_path):
    (tmp_path / "mine.py").write_text(
        "from rollwise.agent.tools import tool\n"
        "def score(task, answer):\n    return 0.5 if task['city'] in answer else 0.0\n"
        "@tool(timeout=2.0)\ndef weather(city: str) -> str:\n    '''Today's weather in a city.'''\n"
        "    return {'Oslo': 'snow'}.get(city, 'sun')\n")
    env = make_env("dataset", reward="number", tools=["python", f"{tmp_path}/mine.py:weather"], answer_hint="")
    task = {"id": "t1", "prompt": "What is 2 ** 10?", "answer": 1024, "solution": "The answer is 1024."}

    async def go(env, task, actions):
        first = await env.reset(task)
        return first, [await env.step(a) for a in actions]
    py = '<tool_call>{"name": "python", "arguments": {"code": "print(2 ** 10)"}}</tool_call>'
    w = '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
    first, steps = asyncio.run(go(env, task, [py, w, "It is 1024."]))
    assert first[1] == {"role": "user", "content": "What is 2 ** 10?"}  # no hint when it is ""
    assert [t.name for t in env.tools] == ["python", "weather", "finish"]
    assert steps[0][0][0]["content"] == "1024" and steps[1][0][0]["content"] == "snow"
    assert steps[2][1:3] == (1.0, True) and env.expert(task) == ["The answer is 1024."]

    # a user's reward, other field names, and a task given as a conversation
    env = make_env("dataset", reward=f"{tmp_path}/mine.py:score", prompt_key="question")
    chat = {"id": "t2", "city": "Lima", "messages": [{"role": "user", "content": "Where?"}]}
    first, steps = asyncio.run(go(env, chat, ["Lima, I think."]))
    assert first == [{"role": "system", "content": env.system_prompt}, {"role": "user", "content": "Where?"}]
    assert steps[0][1:3] == (0.5, True)
    first, _ = asyncio.run(go(env, {"id": "t3", "question": "Q?", "city": "x"}, []))
    assert first[1]["content"].startswith("Q?")
    with pytest.raises(ValueError, match="no 'solution'"):
        env.expert(chat)
    with pytest.raises(ValueError, match="has no 'question'"):
        env.prompt({"id": "t4", "prompt": "?"})


def test_verl_and_search_r1_data_files_are_read_as_they_are(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq
    # verl's gsm8k layout: the prompt is a conversation, the answer is reward_model.ground_truth (text)
    gsm = [{"data_source": "openai/gsm8k", "ability": "math",
            "prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"split": "train", "index": i, "answer": f"{a} + {b} = {a + b}"}}
           for i, (a, b) in enumerate([(40, 32), (1000, 234)])]
    pq.write_table(pa.Table.from_pylist(gsm), tmp_path / "gsm.parquet")
    tasks = load_tasks(tmp_path / "gsm.parquet")
    assert tasks == [{"id": f"gsm-{i}", **row} for i, row in enumerate(gsm)]  # nested columns come back whole

    async def go(env, task, answer):
        first = await env.reset(task)
        return first, (await env.step(answer))[1]
    env = make_env("dataset", reward="number")
    first, reward = asyncio.run(go(env, tasks[0], "40 + 32 = 72"))
    assert first == [{"role": "system", "content": env.system_prompt}, {"role": "user", "content": "What is 40 + 32?"}]
    assert reward == 1.0 and asyncio.run(go(env, tasks[1], "It is 1,234."))[1] == 1.0
    assert asyncio.run(go(env, tasks[0], "73"))[1] == 0.0
    # a nested field named with dots; a conversation that brings its own system message keeps it
    nested = make_env("dataset", reward="contains", answer_key="extra_info.answer")
    own = {**tasks[0], "prompt": [{"role": "system", "content": "Be brief."}, *tasks[0]["prompt"]]}
    first, reward = asyncio.run(go(nested, own, "I get 40 + 32 = 72, so"))
    assert first[0] == {"role": "system", "content": "Be brief."} and reward == 1.0
    with pytest.raises(ValueError, match="has no 'extra_info.nope'"):
        make_env("dataset", reward="exact", answer_key="extra_info.nope").answer_of(tasks[0])

    # Search-R1's layout: ground_truth {"target": [golden answers]}, scored by exact match against any
    nq = [{"data_source": "nq", "prompt": [{"role": "user", "content": "Capital of France?"}],
           "reward_model": {"style": "rule", "ground_truth": {"target": ["Paris", "City of Paris"]}}}]
    pq.write_table(pa.Table.from_pylist(nq), tmp_path / "nq.parquet")
    task = load_tasks(tmp_path / "nq.parquet")[0]
    em = make_env("dataset", reward="em")
    assert em.answer_of(task) == ["Paris", "City of Paris"]
    assert asyncio.run(go(em, task, "the city of Paris."))[1] == 1.0 and asyncio.run(go(em, task, "Lyon"))[1] == 0.0
    # a reward file written for verl (compute_score) runs unchanged: the ground truth as the file has it
    (tmp_path / "verl_reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    hit = any(t.lower() in solution_str.lower() for t in ground_truth['target'])\n"
        "    return {'score': float(hit) + (0.5 if (extra_info or {}).get('bonus') else 0.0), 'acc': hit}\n"
        "async def by_source(data_source, solution_str, ground_truth):\n"
        "    return float(data_source == 'nq' and solution_str in ground_truth['target'])\n")
    verl = make_env("dataset", reward=f"{tmp_path}/verl_reward.py:compute_score")
    assert asyncio.run(go(verl, task, "I think Paris"))[1] == 1.0 and asyncio.run(go(verl, task, "Rome"))[1] == 0.0
    assert asyncio.run(go(verl, {**task, "extra_info": {"bonus": True}}, "Paris"))[1] == 1.5
    by_source = make_env("dataset", reward=f"{tmp_path}/verl_reward.py:by_source")
    assert asyncio.run(go(by_source, task, "Paris"))[1] == 1.0
    assert asyncio.run(go(by_source, {**task, "data_source": "hotpotqa"}, "Paris"))[1] == 0.0

    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match="bad.parquet: not a readable Parquet file"):
        load_tasks(tmp_path / "bad.parquet")
    with pytest.raises(FileNotFoundError):
        load_tasks(tmp_path / "missing.parquet")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as if pyarrow were not installed
    with pytest.raises(ValueError, match=r"needs pyarrow: pip install 'rollwise\[parquet\]'"):
        load_tasks(tmp_path / "gsm.parquet")


def test_number_answers_given_as_text():
    from rollwise.agent.env import number_reward
    assert number_reward("It is 1234.", "1,234") == 1.0 and number_reward("18", "$18") == 1.0
    assert number_reward("-350", "-3.5e2") == 1.0 and number_reward("72", 72) == 1.0 and number_reward("7", "72") == 0.0
    with pytest.raises(ValueError, match="'n/a' has no number"):
        number_reward("7", "n/a")


def test_dataset_env_bad_options_are_value_errors():
    with pytest.raises(ValueError, match=r"unknown reward 'exactly'; valid: \['auto', 'contains', 'em', 'exact', 'f1', "
                                         r"'judge', 'math', 'model', 'number', 'unit_tests'\]"):
        make_env("dataset", reward="exactly")
    with pytest.raises(ValueError, match="unknown tool 'bash'; valid: 'python'"):
        make_env("dataset", tools=["bash"])
    with pytest.raises(ValueError, match="cannot load tool"):
        make_env("dataset", tools=["nowhere_module:fn"])
    with pytest.raises(ValueError, match="environment 'dataset'.*rewrd"):
        make_env("dataset", rewrd="number")  # a typo in env_options


def test_dataset_env_unit_tests_reward_runs_the_answer_in_the_sandbox():
    env = make_env("dataset", reward="unit_tests", sandbox_timeout_s=2.0)
    task = {"id": "add", "prompt": "Write add(a, b).", "tests": "assert add(2, 3) == 5\nassert add(-1, 1) == 0"}
    answers = {"```python\ndef add(a, b):\n    return a + b\n```": 1.0,
               "First try:\n```python\ndef add(a, b):\n    return a - b\n```\nBetter:\n```py\ndef add(a, b):\n"
               "    return b + a\n```": 1.0,  # the last block
               "def add(a, b):\n    return a * b": 0.0,  # no fence: the whole answer, which fails a test
               "```python\ndef add(a, b):\n    while True:\n        pass\n```": 0.0,  # stopped at the deadline
               "```python\nimport sys\nsys.exit(0)\n```": 0.0}  # exits before the tests: no pass
    for answer, want in answers.items():
        assert asyncio.run(env.score(task, answer)) == want, answer


def test_a_slow_user_reward_holds_up_no_other_episode(tmp_path):
    (tmp_path / "slow.py").write_text(
        "import time\ndef score(task, answer):\n    t0 = time.monotonic()\n    time.sleep(0.5)\n"
        "    task['span'] = (t0, time.monotonic())\n    return 1.0\n"
        "async def judge(task, answer):\n    return 0.25 if 'yes' in answer else 0.0\n")
    env = make_env("dataset", reward=f"{tmp_path}/slow.py:score")
    tasks = [{"id": str(i), "prompt": "?"} for i in range(4)]

    async def go():
        return await asyncio.gather(*(env.score(t, "a") for t in tasks))
    assert asyncio.run(go()) == [1.0] * 4
    spans = [t["span"] for t in tasks]
    assert max(a for a, _ in spans) < min(b for _, b in spans)  # all four ran at once, off the event loop
    judge = make_env("dataset", reward=f"{tmp_path}/slow.py:judge")
    assert asyncio.run(judge.score(tasks[0], "yes")) == 0.25
