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
