"""Episodes: exact token-in-token-out on real engine episodes, statuses, failures, collect."""
from __future__ import annotations

import asyncio
import json

import pytest

from rollwise.agent.env import NewContext, ToolEnv
from rollwise.agent.envs import ENVS, make_env
from rollwise.agent.episode import ChatRenderer, collect, run_episode
from rollwise.agent.generator import ForcedGenerator, RecordingGenerator, ScriptedGenerator, expert_policy
from rollwise.agent.tools import Tool
from rollwise.engine.async_engine import AsyncEngine
from rollwise.engine.tokenizer import Tokenizer
from rollwise.rollout.pipeline import Group
from rollwise.trainer.advantages import anchor_states
from rollwise.types import SamplingParams, TurnRecord


# (dataset reads its tasks from files; mix is made of these: tests/agent/test_mix.py)
SAMPLED = sorted(n for n, e in ENVS.items() if hasattr(e, "sample_tasks") and n != "mix")


@pytest.fixture(scope="module")
def engine(model_dir):
    e = AsyncEngine(model_dir, max_num_seqs=32)
    yield e
    e.shutdown()


@pytest.mark.parametrize("env_name", SAMPLED)
def test_token_in_token_out_on_engine_episodes(engine, env_name):
    tasks = make_env(env_name).sample_tasks(3, seed=1)
    gen = RecordingGenerator(ForcedGenerator(engine, expert_policy(lambda: make_env(env_name), tasks)))
    renderer = ChatRenderer(engine.tokenizer)
    params = SamplingParams(temperature=1.0, max_tokens=64, seed=5)

    async def go():
        return [await run_episode(gen, make_env(env_name), t, params, trajectory_id=f"{t['id']}/0",
                                  group_id=str(t["id"]), renderer=renderer) for t in tasks]
    trajs = asyncio.run(go())
    calls = iter(gen.calls)
    for traj in trajs:
        assert traj.status == "done" and traj.reward == 1.0 and len(traj.turns) >= 2
        assert len(traj.token_ids) == len(traj.loss_mask) == len(traj.logprobs)
        first = renderer.prompt_ids(traj.messages[:2], [t.schema for t in make_env(env_name).make_tools(traj.task)]
                                    + [_finish_schema()])
        assert traj.token_ids[:len(first)] == first
        for turn in traj.turns:
            req, out = next(calls)
            assert req.prompt_token_ids == traj.token_ids[:turn.start]  # exactly what the engine saw
            end = turn.start + turn.num_generated
            assert traj.token_ids[turn.start:end] == out.token_ids  # exactly what it produced
            assert traj.logprobs[turn.start:end] == out.logprobs and all(lp < 0 for lp in out.logprobs)
            assert traj.loss_mask[turn.start:end] == [1] * turn.num_generated
            obs = traj.token_ids[end:end + turn.num_observation]
            assert traj.loss_mask[end:end + turn.num_observation] == [0] * turn.num_observation
            assert set(traj.logprobs[end:end + turn.num_observation]) <= {0.0}
            if turn.num_observation:
                assert "<tool_response>" in engine.tokenizer.decode(obs, skip_special_tokens=False)
        assert sum(traj.loss_mask) == sum(t.num_generated for t in traj.turns)
        # the delta rendering adds up to the template's rendering of the whole transcript
        text = engine.tokenizer.decode(traj.token_ids, skip_special_tokens=False)
        full = engine.tokenizer.apply_chat_template(traj.messages, add_generation_prompt=False,
                                                    tools=[t.schema for t in make_env(env_name).make_tools(traj.task)]
                                                    + [_finish_schema()])
        assert full.startswith(text)


def _finish_schema():
    from rollwise.agent.env import _finish_tool
    return _finish_tool().schema


def test_same_seed_reproduces_a_sampled_engine_episode(engine):
    task = make_env("calculator").sample_tasks(1, seed=3)[0]
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=11)

    async def once():
        return await run_episode(engine, make_env("calculator", max_turns=3), task, params, trajectory_id="t")
    a, b = asyncio.run(once()), asyncio.run(once())
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs and a.num_generated > 0
    c = asyncio.run(run_episode(engine, make_env("calculator", max_turns=3), task,
                                SamplingParams(temperature=1.0, max_tokens=24, seed=12), trajectory_id="t"))
    assert c.token_ids != a.token_ids


class FlakyEnv(ToolEnv):
    name = "flaky"

    def make_tools(self, task):
        def boom() -> str:
            """Always fails."""
            raise RuntimeError("kaput")

        async def hang() -> str:
            """Never returns."""
            await asyncio.sleep(60)
            return "x"

        def garbage() -> object:
            """Returns something that is not text."""
            return {1, 2}
        return [Tool(boom), Tool(hang), Tool(garbage)]

    def prompt(self, task):
        return "go"

    def score(self, task, answer):
        return float(answer.strip() == "ok")


def _scripted(tokenizer, turns):
    return ScriptedGenerator(tokenizer, lambda req: turns[min(req.turn, len(turns) - 1)])


def test_tool_failures_are_observations_and_the_episode_goes_on(model_dir):
    tok = Tokenizer(model_dir)
    call = lambda name: f'<tool_call>{json.dumps({"name": name, "arguments": {}})}</tool_call>'  # noqa: E731
    turns = [call("boom"), call("hang"), call("garbage"), "<tool_call>{oops</tool_call>", call("nope"), "ok"]
    env = FlakyEnv(tool_timeout=0.2, max_turns=10)
    traj = asyncio.run(run_episode(_scripted(tok, turns), env, {}, SamplingParams(max_tokens=64)))
    assert traj.status == "done" and traj.reward == 1.0 and len(traj.turns) == 6
    tool_msgs = [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert "kaput" in tool_msgs[0] and "timed out" in tool_msgs[1] and "neither text nor JSON" in tool_msgs[2]
    assert "malformed tool call" in tool_msgs[3] and "unknown tool 'nope'" in tool_msgs[4]


def test_statuses_max_turns_max_context_timeout_error(model_dir):
    tok = Tokenizer(model_dir)
    loop_call = '<tool_call>{"name": "boom", "arguments": {}}</tool_call>'
    p = SamplingParams(max_tokens=64)
    t = asyncio.run(run_episode(_scripted(tok, [loop_call]), FlakyEnv(max_turns=3), {}, p))
    assert t.status == "max_turns" and len(t.turns) == 3
    first = len(asyncio.run(run_episode(_scripted(tok, ["x"]), FlakyEnv(), {}, p)).token_ids)
    t = asyncio.run(run_episode(_scripted(tok, [loop_call]), FlakyEnv(max_turns=50), {}, p, max_context=first + 200))
    assert t.status == "max_context" and first + 100 < len(t.token_ids) <= first + 200 and len(t.turns) > 1
    hang = '<tool_call>{"name": "hang", "arguments": {}}</tool_call>'
    t = asyncio.run(run_episode(_scripted(tok, [hang]), FlakyEnv(tool_timeout=30), {}, p, deadline_s=0.3))
    assert t.status == "timeout"

    class Broken(FlakyEnv):
        async def step(self, action):
            raise KeyError("env bug")
    t = asyncio.run(run_episode(_scripted(tok, ["x"]), Broken(), {}, p))
    assert t.status == "error" and "env bug" in t.error

    for bad in (float("nan"), float("inf"), "-inf"):  # an env's reward that would poison the group's advantages
        class NaN(FlakyEnv):
            async def step(self, action):
                return [], bad, True, {}
        t = asyncio.run(run_episode(_scripted(tok, ["x"]), NaN(), {}, p))
        assert t.status == "error" and "not a finite number" in t.error and t.reward == 0.0, bad


class Summarizing:
    """Each step starts a new context: the question and a running summary (the turn count)."""
    tools: list = []

    def __init__(self, max_turns=8, end_after=3):
        self.max_turns, self.end_after, self.n = max_turns, end_after, 0

    def reset(self, task):
        return [{"role": "system", "content": "sum up"}, {"role": "user", "content": "q"}]

    def step(self, action):
        self.n += 1
        if self.n == self.end_after:
            return [], 1.0, True, {}
        return NewContext([{"role": "user", "content": f"q; summary after {self.n} turns: {action}"}]), 0.0, False, {}


def test_a_new_context_closes_the_tokens_so_far_and_renders_a_fresh_prompt(model_dir, tmp_path):
    tok = Tokenizer(model_dir)
    r = ChatRenderer(tok)
    gen = RecordingGenerator(_scripted(tok, ["first", "second", "third"]))
    traj = asyncio.run(run_episode(gen, Summarizing(), {}, SamplingParams(max_tokens=64), trajectory_id="e"))
    assert traj.status == "done" and traj.reward == 1.0 and traj.num_turns == 3 and len(traj.earlier) == 2
    seqs = traj.sequences()
    prompts = [r.prompt_ids(Summarizing().reset({}), None),
               r.prompt_ids([{"role": "user", "content": "q; summary after 1 turns: first"}], None),
               r.prompt_ids([{"role": "user", "content": "q; summary after 2 turns: second"}], None)]
    for s, prompt, call, word in zip(seqs, prompts, gen.calls, ["first", "second", "third"]):
        req, out = call
        assert req.prompt_token_ids == prompt and s.token_ids == prompt + out.token_ids  # what the model saw
        assert s.loss_mask == [0] * len(prompt) + [1] * len(out.token_ids)
        assert s.logprobs[len(prompt):] == out.logprobs and len(s.turns) == 1 and s.turns[0].start == len(prompt)
        assert s.messages[-1] == {"role": "assistant", "content": word} and s.trajectory_id == "e"
    assert [req.turn for req, _ in gen.calls] == [0, 1, 2]
    assert traj.num_generated == sum(len(out.token_ids) for _, out in gen.calls)
    # max_turns counts the episode's turns, whatever the context
    t = asyncio.run(run_episode(_scripted(tok, ["x"]), Summarizing(max_turns=2), {}, SamplingParams(max_tokens=8)))
    assert t.status == "max_turns" and t.num_turns == 2 and len(t.earlier) == 2 and not t.turns
    # a rollout log keeps the contexts
    g = Group(seq=0, task_index=0, task={}, admitted_version=0, trajectories=[traj])
    back = Group.from_json(g.to_json()).trajectories[0]
    assert back == traj and isinstance(back.earlier[0].turns[0], TurnRecord)


class Returning(Summarizing):
    """Turn 2 reads a side conversation; turn 3 takes the first one up again, extended."""

    def step(self, action):
        self.n += 1
        if self.n == 1:
            self.first = action
            return NewContext([{"role": "user", "content": "side question"}]), 0.0, False, {}
        if self.n == 2:
            return NewContext(self.reset({}) + [{"role": "assistant", "content": self.first},
                                                {"role": "user", "content": f"the side said {action}"}]), 0.0, False, {}
        return [], 1.0, True, {}


def test_a_context_whose_tokens_a_new_prompt_extends_is_taken_up_again(model_dir):
    tok = Tokenizer(model_dir)
    gen = RecordingGenerator(_scripted(tok, ["first", "aside", "last"]))
    traj = asyncio.run(run_episode(gen, Returning(), {}, SamplingParams(max_tokens=64)))
    assert traj.status == "done" and traj.num_turns == 3 and len(traj.earlier) == 1
    side, main = traj.sequences()
    (r0, o0), (r1, o1), (r2, o2) = gen.calls
    assert side.token_ids == r1.prompt_token_ids + o1.token_ids and len(side.turns) == 1
    assert main.token_ids == r2.prompt_token_ids + o2.token_ids and r2.prompt_token_ids[:len(r0.prompt_token_ids)] == r0.prompt_token_ids
    assert [t.start for t in main.turns] == [len(r0.prompt_token_ids), len(r2.prompt_token_ids)]
    assert main.loss_mask == [0] * len(r0.prompt_token_ids) + [1] * len(o0.token_ids) + \
        [0] * (len(r2.prompt_token_ids) - len(r0.prompt_token_ids) - len(o0.token_ids)) + [1] * len(o2.token_ids)
    assert main.messages[-2] == {"role": "user", "content": "the side said aside"}


def test_collect_returns_complete_groups_with_bounded_concurrency(model_dir):
    tok = Tokenizer(model_dir)
    env_name = "sql"
    tasks = make_env(env_name).sample_tasks(12, seed=2)
    gen = ScriptedGenerator(tok, expert_policy(lambda: make_env(env_name), tasks), delay=0.01)

    async def go():
        return [g async for g in collect(gen, lambda: make_env(env_name), tasks, SamplingParams(max_tokens=64),
                                         group_size=4, max_concurrency=10)]
    groups = asyncio.run(go())
    assert len(groups) == 12 and all(len(g) == 4 for g in groups)
    assert {g[0].group_id for g in groups} == {t["id"] for t in tasks}
    assert all(t.reward == 1.0 and t.status == "done" for g in groups for t in g)
    assert gen.max_in_flight <= 10 and gen.max_in_flight >= 8  # the pool stays full


def test_sql_tool_cannot_modify_the_database(tmp_path, monkeypatch):
    from rollwise.agent.envs.sql import build_db, run_query
    monkeypatch.chdir(tmp_path)
    task = make_env("sql").sample_tasks(1, seed=9)[0]
    path = build_db(task)
    before = run_query(path, "SELECT COUNT(*) FROM orders")
    for stmt in ("DELETE FROM orders", "DROP TABLE orders", "INSERT INTO orders VALUES (999, 1, 1, 1)",
                 "UPDATE products SET price = 0", "ATTACH DATABASE 'x.db' AS x"):
        with pytest.raises(Exception):
            run_query(path, stmt)
    assert run_query(path, "SELECT COUNT(*) FROM orders") == before
    assert not list(tmp_path.iterdir())  # ATTACH created no file
    env = make_env("sql")

    async def go():
        await env.reset(task)
        return await env.step('<tool_call>{"name": "sql_query", "arguments": {"query": "DELETE FROM orders"}}</tool_call>')
    obs, reward, done, _ = asyncio.run(go())
    assert not done and "not authorized" in obs[0]["content"]


@pytest.mark.parametrize("env_name", SAMPLED)
def test_every_expert_solves_200_seeded_tasks(env_name, expert_rewards):
    n = 40 if env_name == "bugfix" else 200  # (three sandboxed runs an episode)
    tasks = make_env(env_name).sample_tasks(n, seed=0)
    assert len({json.dumps(t, sort_keys=True) for t in tasks}) > 0.75 * n  # varied tasks
    assert expert_rewards(lambda: make_env(env_name), tasks) == [1.0] * n


def test_frozenlake_local_view_shows_the_neighbours_and_the_goal(expert_rewards):
    env = make_env("frozenlake", view="local")
    task = {"id": "t", "grid": ["SFH", "HFF", "FGF"]}
    assert env.prompt(task).endswith("Next to you: left edge, right ice, up edge, down hole. "
                                     "The goal is down and right.")

    async def go():
        await env.reset(task)
        obs, _, done, _ = await env.step('<tool_call>{"name": "move", "arguments": {"direction": "right"}}</tool_call>')
        return obs[0]["content"], done
    obs, done = asyncio.run(go())
    assert not done and obs == ("You are at row 0, column 1. Next to you: left ice, right hole, up edge, down ice. "
                                "The goal is down.")
    tasks = env.sample_tasks(50, seed=1)
    assert expert_rewards(lambda: make_env("frozenlake", view="local"), tasks) == [1.0] * 50
    with pytest.raises(ValueError, match="valid.*position.*local"):
        make_env("frozenlake", view="map")


def test_frozenlake_names_its_state_by_the_cell_whatever_the_text():
    env = make_env("frozenlake")
    task = {"id": "t", "grid": ["SFH", "HFF", "FGF"]}

    def move(d):
        return env.step('<tool_call>{"name": "move", "arguments": {"direction": "%s"}}</tool_call>' % d)

    async def go():
        await env.reset(task)
        keys, texts = [env.state_key()], []
        for d in ("up", "right", "left"):  # an edge bump, a move, back to the start
            obs, _, done, _ = await move(d)
            assert not done
            keys.append(env.state_key())
            texts.append(obs[0]["content"])
        return keys, texts
    keys, texts = asyncio.run(go())
    assert keys == ["row 0, column 0", "row 0, column 0", "row 0, column 1", "row 0, column 0"]
    assert len(set(texts)) == 3  # the same cell reached with other words: one GiGPO anchor


def test_make_env_names_the_valid_options():
    with pytest.raises(ValueError, match="calculator"):
        make_env("chess")


class Shaped:
    """A gym-style env that rewards every step on the way (0.25 each), and 1 at the end."""
    tools: list = []

    def __init__(self, max_turns=3):
        self.max_turns, self.n = max_turns, 0

    def reset(self, task):
        return [{"role": "user", "content": "walk"}]

    def step(self, action):
        self.n += 1
        if action.strip() == "stop":
            return [], 1.0, True, {}
        return [{"role": "user", "content": "go on"}], 0.25, False, {}


def test_the_episode_reward_is_the_sum_of_its_steps_rewards(model_dir):
    tok = Tokenizer(model_dir)
    t = asyncio.run(run_episode(_scripted(tok, ["step", "step", "stop"]), Shaped(), {}, SamplingParams(max_tokens=8)))
    assert t.status == "done" and t.reward == 1.5 and [r.reward for r in t.turns] == [0.25, 0.25, 1.0]
    t = asyncio.run(run_episode(_scripted(tok, ["step"]), Shaped(max_turns=2), {}, SamplingParams(max_tokens=8)))
    assert t.status == "max_turns" and t.reward == 0.5  # what it earned before the limit
    back = Group.from_json(Group(0, 0, {}, 0, [t]).to_json()).trajectories[0]
    assert [r.reward for r in back.turns] == [0.25, 0.25]


class Clocked(Shaped):
    """Observations that carry a changing clock; the state is how far the walk has come."""

    def step(self, action):
        obs, reward, done, info = super().step(action)
        return [{"role": "user", "content": f"go on (t={self.n * 7})"}] if obs else obs, reward, done, info

    async def state_key(self):  # (may be a coroutine)
        return f"cell {self.n}"


def test_an_envs_state_key_is_each_turns_anchor(model_dir):
    tok = Tokenizer(model_dir)
    t = asyncio.run(run_episode(_scripted(tok, ["step", "step", "stop"]), Clocked(), {}, SamplingParams(max_tokens=8)))
    assert [r.state for r in t.turns] == ["cell 0", "cell 1", "cell 2"]
    assert anchor_states(t) == [("state", "cell 0"), ("state", "cell 1"), ("state", "cell 2")]
    assert all(r.state is None for r in asyncio.run(run_episode(_scripted(tok, ["stop"]), Shaped(), {},
                                                                SamplingParams(max_tokens=8))).turns)
    back = Group.from_json(Group(0, 0, {}, 0, [t]).to_json()).trajectories[0]
    assert [r.state for r in back.turns] == ["cell 0", "cell 1", "cell 2"]
