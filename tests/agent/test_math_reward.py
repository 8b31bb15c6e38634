"""The `math` reward: math-verify's equivalence in worker processes, under a deadline."""
from __future__ import annotations

import asyncio
import sys
import time

import pytest

from rollwise.agent.envs import make_env
from rollwise.agent.math_reward import MathVerifier


@pytest.fixture(scope="module")
def verifier():
    v = MathVerifier(timeout_s=5.0, workers=2)
    yield v
    v.close()


def test_answers_equal_as_mathematics(verifier):
    cases = [("\\frac{1}{2}", "So the answer is $\\boxed{0.5}$.", 1.0),
             ("72", "She sold 48 + 24 = 72 clips. \\boxed{72}", 1.0),
             ("72", "\\boxed{71}", 0.0),
             ("(1, 3]", "The set is $\\boxed{(1,3]}$", 1.0),
             ("(1, 3]", "The set is $\\boxed{[1,3]}$", 0.0),
             ("2\\sqrt{2}", "$\\boxed{\\sqrt{8}}$", 1.0),
             (["x = 4", "4"], "Thus $\\boxed{4}$", 1.0),  # any of a list
             ("5", "no answer at all", 0.0)]

    async def go():
        return await asyncio.gather(*(verifier.score(want, answer) for want, answer, _ in cases))
    assert asyncio.run(go()) == [r for *_, r in cases]


def test_a_comparison_past_its_deadline_scores_nothing_and_the_pool_is_replaced(verifier):
    async def go():
        t0 = time.perf_counter()
        # a worker stuck for a minute, beside another episode's work in the other worker
        stuck, other = await asyncio.gather(verifier.run(time.sleep, 60, deadline_s=1.0),
                                            verifier.run(time.sleep, 3, deadline_s=20.0), return_exceptions=True)
        stuck_for = time.perf_counter() - t0
        # the next comparison runs on a fresh pool
        return stuck, other, stuck_for, await verifier.score("3", "\\boxed{3}")
    before = verifier.timeouts
    stuck, other, stuck_for, score = asyncio.run(go())
    assert isinstance(stuck, asyncio.TimeoutError) and verifier.timeouts == before + 1
    assert other is None  # killed with the stuck one's pool, and run again on a fresh one
    assert stuck_for < 30 and score == 1.0


def test_the_dataset_env_scores_math(monkeypatch):
    env = make_env("dataset", reward="math", math_timeout_s=3.0)
    task = {"id": "m1", "prompt": [{"role": "user", "content": "What is 1/2 + 1/4?"}],
            "reward_model": {"style": "rule", "ground_truth": "\\frac{3}{4}"}}

    async def go(answer):
        await env.reset(task)
        return (await env.step(answer))[1]
    assert asyncio.run(go("1/2 + 1/4 = \\boxed{0.75}")) == 1.0
    assert asyncio.run(go("\\boxed{\\frac{2}{3}}")) == 0.0
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        MathVerifier(timeout_s=0)
    monkeypatch.setitem(sys.modules, "math_verify", None)  # as if it were not installed
    with pytest.raises(ValueError, match=r"needs math-verify: pip install 'rollwise\[math\]'"):
        make_env("dataset", reward="math")


def test_auto_picks_the_rule_by_data_source_as_verl_does(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from rollwise.agent.envs import load_tasks
    # one file mixing sources (as Search-R1's NQ + HotpotQA training file does, or a math mix)
    rows = [("openai/gsm8k", "72", "48 + 24 = 72 clips", "48 + 24 = 70"),  # number: its last number
            ("lighteval/MATH", "\\frac{3}{4}", "so \\boxed{0.75}", "so \\boxed{0.7}"),  # math
            ("numina_olympiads", "2\\sqrt{2}", "\\boxed{\\sqrt{8}}", "\\boxed{3}"),  # math, by prefix
            ("searchR1_nq", "Paris", "The Paris.", "Lyon"),  # em (case, articles, punctuation), by prefix
            ("hotpotqa", "Ada Lovelace", "Ada Lovelace.", "Ada")]  # em
    pq.write_table(pa.Table.from_pylist([
        {"data_source": src, "prompt": [{"role": "user", "content": f"question {i}"}],
         "reward_model": {"style": "rule", "ground_truth": gt}} for i, (src, gt, _, _) in enumerate(rows)]),
        tmp_path / "mix.parquet")
    tasks = load_tasks(tmp_path / "mix.parquet")
    env = make_env("dataset", reward="auto")

    async def go(task, answer):
        await env.reset(task)
        return (await env.step(answer))[1]
    assert [asyncio.run(go(t, right)) for t, (*_, right, _) in zip(tasks, rows)] == [1.0] * 5
    assert [asyncio.run(go(t, wrong)) for t, (*_, wrong) in zip(tasks, rows)] == [0.0] * 5
    with pytest.raises(ValueError, match="no rule for data_source 'my_source'.*name a reward instead"):
        asyncio.run(go({**tasks[0], "data_source": "my_source"}, "72"))
