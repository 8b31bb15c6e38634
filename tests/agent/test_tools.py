"""Tools: schemas from signatures; failures become error observations, never crashes."""
from __future__ import annotations

import asyncio
import time
from typing import Literal

from rollwise.agent.parsing import HermesParser
from rollwise.agent.tools import Latency, Tool, tool


def test_schema_from_typed_function():
    @tool(timeout=2.0)
    def search(query: str, limit: int = 5, mode: Literal["fast", "deep"] = "fast", tags: list[str] | None = None) -> str:
        """Search the catalogue.

        Longer text the model does not need."""
        return query
    s = search.schema["function"]
    assert s["name"] == "search" and s["description"] == "Search the catalogue."
    p = s["parameters"]
    assert p["required"] == ["query"]
    assert p["properties"]["limit"] == {"type": "integer", "default": 5}
    assert p["properties"]["mode"]["enum"] == ["fast", "deep"]
    assert p["properties"]["tags"]["type"] == "array"


def _run(coro):
    return asyncio.run(coro)


def test_failures_come_back_as_error_results():
    def boom(x: int) -> str:
        raise RuntimeError("database on fire")

    async def hang() -> str:
        await asyncio.sleep(10)
        return "never"

    def garbage() -> object:
        return object()

    def slow_sync() -> str:
        time.sleep(2)
        return "late"

    r = _run(Tool(boom).call({"x": 1}))
    assert not r.ok and "database on fire" in r.content and r.content.startswith("error:")
    t0 = time.perf_counter()
    r = _run(Tool(hang, timeout=0.2).call({}))
    assert not r.ok and "timed out" in r.content and time.perf_counter() - t0 < 2
    r = _run(Tool(slow_sync, timeout=0.2).call({}))
    assert not r.ok and "timed out" in r.content
    r = _run(Tool(garbage).call({}))
    assert not r.ok and "neither text nor JSON" in r.content
    r = _run(Tool(boom).call({"x": "one"}))
    assert not r.ok and "must be integer" in r.content
    r = _run(Tool(boom).call({"y": 1}))
    assert not r.ok and "unknown arguments" in r.content
    r = _run(Tool(boom).call("not a dict"))
    assert not r.ok and "JSON object" in r.content


def test_latency_is_simulated():
    def ok() -> str:
        return "ok"
    t = Tool(ok, latency=Latency(0.05, 0.1))
    t0 = time.perf_counter()
    r = _run(t.call({}))
    assert r.ok and 0.05 <= time.perf_counter() - t0 < 1.0
    heavy = Latency(0.05, 0.5, kind="lognormal")
    xs = [heavy.sample() for _ in range(2000)]
    assert min(xs) >= 0.05 and max(xs) <= heavy.cap and max(xs) > 3 * sorted(xs)[1000]  # a heavy tail


def test_hermes_parser():
    p = HermesParser()
    ok = p.parse('I will look.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>')
    assert [(c.name, c.arguments) for c in ok.calls] == [("f", {"a": 1})] and ok.text == "I will look." and not ok.errors
    enc = p.parse('<tool_call>{"name": "f", "arguments": "{\\"a\\": 2}"}</tool_call>')
    assert enc.calls[0].arguments == {"a": 2}
    bad = p.parse("<tool_call>{name: f}</tool_call><tool_call>[1]</tool_call><tool_call>{\"name\": \"g\"")
    assert not bad.calls and len(bad.errors) == 3
    assert all(e.startswith("malformed tool call") for e in bad.errors)
    assert p.parse("The answer is 4.").calls == []


def test_tool_cache_runs_a_pure_call_once_per_task_and_arguments():
    """tool_cache: a GRPO group's samples making the same pure call (the same task, tool and
    arguments) run it once, whether they ask at once or later; impure tools, other arguments, other
    tasks and failed calls run again; without tool_cache every call runs."""
    import json

    from rollwise.agent.env import ToolEnv
    runs: list[tuple] = []

    class Env(ToolEnv):
        def make_tools(self, task):
            async def square(x: int) -> str:
                """Square x."""
                runs.append(("square", task["id"], x))
                await asyncio.sleep(0.05)
                if x < 0:
                    raise ValueError("negative")
                return str(x * x)

            def note(text: str) -> str:
                """Write a note (a side effect: never reused)."""
                runs.append(("note", task["id"], text))
                return "noted"
            return [Tool(square, pure=True), Tool(note)]

        def prompt(self, task):
            return "q"

        def score(self, task, answer):
            return 0.0

    def call(name, **args):
        return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"

    async def episode(task, actions, cache=True):
        env = Env(tool_cache=cache)
        await env.reset(task)
        out = []
        for a in actions:
            obs, _, _, info = await env.step(a)
            out.append((obs[0]["content"], info.get("tool_cache_hits")))
        return out

    async def go():
        t1, t2 = {"id": "t1"}, {"id": "t2"}
        group = await asyncio.gather(*(episode(t1, [call("square", x=3), call("note", text="a")]) for _ in range(8)))
        later = await episode(t1, [call("square", x=3), call("square", x=4), call("square", x=-1),
                                   call("square", x=-1)])
        other = await episode(t2, [call("square", x=3)])
        off = await episode(t1, [call("square", x=3)], cache=False)
        return group, later, other, off
    group, later, other, off = asyncio.run(go())
    assert all(g == [("9", g[0][1]), ("noted", 0)] for g in group) and sum(g[0][1] for g in group) == 7
    assert later == [("9", 1), ("16", 0), ("error: tool 'square' failed: ValueError: negative", 0),
                     ("error: tool 'square' failed: ValueError: negative", 0)]
    assert other == [("9", 0)] and off == [("9", None)]
    assert runs.count(("square", "t1", 3)) == 2  # the group's once, and the run without the cache
    assert runs.count(("note", "t1", "a")) == 8 and runs.count(("square", "t1", -1)) == 2


def test_which_built_in_tools_are_pure():
    """Pure: their result depends on the task and arguments alone (the tool cache may reuse it)."""
    from rollwise.agent.envs import make_env
    pure = {}
    for name in ("calculator", "countdown", "phonebook", "sql", "code", "search", "frozenlake", "bugfix"):
        env = make_env(name)
        task = env.sample_tasks(1, seed=0)[0]
        pure.update({t.name: t.pure for t in env.make_tools(task)})
    assert pure == {"calculator": True, "evaluate": True, "lookup": True, "sql_query": True, "python": True,
                    "search": True, "move": False, "bash": False, "edit_file": False}
