"""Tools from MCP servers: real servers (the MCP SDK's MCPServer) in subprocesses, over stdio and HTTP."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import mcp_types
import pytest

from rollwise.agent.env import ToolEnv, loop_shared
from rollwise.agent.envs import load_tasks, make_env
from rollwise.agent.mcp_tools import MCPConnection, MCPTools, parse_servers, result_text
from rollwise.agent.tools import ServiceError, Tool
from rollwise.serve.process import free_port, wait_for_http

SERVER = str(Path(__file__).with_name("mcp_server.py"))
EXAMPLES = Path(__file__).parents[2] / "examples"
STDIO = {"test": {"command": sys.executable, "args": [SERVER]}}


class Plain(ToolEnv):
    """An env of its own tools (one) besides those of MCP servers."""

    def make_tools(self, task):
        def echo(text: str) -> str:
            """Echo the text."""
            return text
        return [Tool(echo)]

    def prompt(self, task):
        return "q"

    def score(self, task, answer):
        return float(answer == "ok")


def call(name, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


async def step(env, name, **arguments) -> str:
    obs, _, done, _ = await env.step(call(name, **arguments))
    assert not done
    return obs[0]["content"]


def test_an_env_calls_the_tools_of_a_stdio_server():
    async def go():
        env = Plain(mcp=STDIO, tool_timeout=3.0)
        await env.reset({})
        names = [t.name for t in env.tools]
        assert names == ["echo", "add", "fail", "slow", "count", "state", "pid", "crash", "header", "finish"]
        assert [t.name for t in env.tools if t.pure] == ["add"]  # (its readOnlyHint: reusable with tool_cache)
        add = env.tools[1].schema["function"]
        assert add["description"] == "Add two integers."
        assert add["parameters"]["required"] == ["a", "b"] and add["parameters"]["properties"]["a"]["type"] == "integer"
        out = {"add": await step(env, "add", a=2, b=40),
               "fail": await step(env, "fail", why="no reason"),
               "wrong type": await step(env, "add", a="2", b=1),  # checked here against the server's schema
               "unknown arg": await step(env, "add", a=1, b=2, c=3),
               "echo": await step(env, "echo", text="own tool")}
        assert out == {"add": "42", "fail": "error: Error executing tool fail: cannot: no reason",  # (its words)
                       "wrong type": "error: argument 'a' of 'add' must be integer, got str",
                       "unknown arg": "error: unknown arguments ['c'] for 'add'; expected ['a', 'b']",
                       "echo": "own tool"}
        # a call past its deadline is the model's to read, and the connection goes on serving
        assert await step(env, "slow", seconds=8.0) == "error: tool 'slow' timed out after 3s"
        assert await step(env, "add", a=1, b=1) == "2"
        # a second env of the run (the same event loop) shares the connection: one server process
        other = Plain(mcp=STDIO)
        await other.reset({})
        pids = {await step(env, "pid"), await step(other, "pid")}
        conn = loop_shared(("mcp", env.mcp.servers[0]), None)
        assert len(pids) == 1 and conn.connects == 1
        # concurrent calls run at once (the server runs its sync tools in threads)
        t0 = time.perf_counter()
        slept = await asyncio.gather(*(conn.call("slow", {"seconds": 0.5}) for _ in range(8)))
        assert slept == ["slept 0.5"] * 8 and time.perf_counter() - t0 < 3.0
        await env.close()  # a run-scoped server outlives its episodes
        assert await step(other, "add", a=3, b=4) == "7"
        await conn.close()
        return int(pids.pop())
    pid = asyncio.run(go())
    assert _gone(pid)


def test_a_lost_server_is_a_service_error_and_the_next_call_starts_it_again():
    async def go():
        env = Plain(mcp=STDIO)
        await env.reset({})
        before = await step(env, "pid")
        with pytest.raises(ServiceError, match="connection lost; its stderr ends: .*the test server crashes now"):
            await env.step(call("crash"))  # the episode ends in error and runs again
        after = await step(env, "pid")
        conn = loop_shared(("mcp", env.mcp.servers[0]), None)
        assert after != before and conn.connects == 2
        await conn.close()
    asyncio.run(go())


def test_a_server_that_cannot_start_is_a_service_error_naming_it(tmp_path):
    async def go(servers):
        with pytest.raises(ServiceError) as e:
            await MCPTools(servers).tools()
        return str(e.value)
    broken = tmp_path / "broken.py"
    broken.write_text("import sys\nprint('no such module: flux', file=sys.stderr)\nsys.exit(1)\n")
    said = asyncio.run(go({"b": {"command": sys.executable, "args": [str(broken)], "connect_timeout_s": 20}}))
    assert "MCP server 'b'" in said and "no such module: flux" in said
    said = asyncio.run(go({"gone": {"command": str(tmp_path / "no-such-program")}}))
    assert "MCP server 'gone'" in said and "could not be reached" in said
    said = asyncio.run(go({"h": {"url": f"http://127.0.0.1:{free_port()}/mcp", "connect_timeout_s": 5}}))
    assert "MCP server 'h'" in said


def test_episode_scoped_servers_start_and_stop_with_their_episode():
    """scope = "episode": a server of its own for each episode, from a fresh state, given the task's
    fields, stopped when the episode ends."""
    servers = {"test": {"command": sys.executable, "args": [SERVER, "--state", "${task.id}"], "scope": "episode",
                        "env": {"TEST_STATE": "db-${task.db}"}}}

    async def episode(task):
        env = Plain(mcp=servers)
        await env.reset(task)
        counts = [await step(env, "count") for _ in range(2)]
        state, pid = await step(env, "state"), int(await step(env, "pid"))
        await env.close()
        return counts, state, pid

    async def go():
        return await asyncio.gather(episode({"id": "t1", "db": 7}), episode({"id": "t2", "db": 8}))
    (c1, s1, p1), (c2, s2, p2) = asyncio.run(go())
    assert c1 == c2 == ["1", "2"] and p1 != p2  # each episode's own server, from a fresh state
    assert (s1, s2) == ("t1 db-7", "t2 db-8")
    assert _gone(p1) and _gone(p2)

    async def missing():
        await Plain(mcp=servers).reset({"id": "t3"})
    with pytest.raises(ValueError, match="the task has no field 'db'"):
        asyncio.run(missing())
    with pytest.raises(ValueError, match=r"names a task's field, which only a server with scope = 'episode' has"):
        parse_servers({"test": {**servers["test"], "scope": "run"}})


def test_episode_scoped_servers_start_a_few_at_a_time(monkeypatch):
    """max_starting bounds how many of a run's episode-scoped servers start at once; all start."""
    servers = {"test": {"command": sys.executable, "args": [SERVER], "scope": "episode", "max_starting": 2}}
    starting, most = 0, 0
    connect = MCPConnection._open

    async def counted(self):
        nonlocal starting, most
        starting += 1
        most = max(most, starting)
        try:
            await connect(self)
        finally:
            starting -= 1
    monkeypatch.setattr(MCPConnection, "_open", counted)

    async def episode(i):
        env = Plain(mcp=servers)
        await env.reset({"id": i})
        pid = int(await step(env, "pid"))
        await env.close()
        return pid

    async def go():
        return await asyncio.gather(*(episode(i) for i in range(6)))
    pids = asyncio.run(go())
    assert len(set(pids)) == 6 and most == 2
    with pytest.raises(ValueError, match="max_starting must be a positive number"):
        parse_servers({"test": {**servers["test"], "max_starting": 0}})
    with pytest.raises(ValueError, match="max_starting must be a whole number"):
        parse_servers({"test": {**servers["test"], "max_starting": 2.5}})


def test_a_server_over_http_with_headers_and_a_bearer_key(monkeypatch):
    port = free_port()
    proc = subprocess.Popen([sys.executable, SERVER, "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_for_http(f"http://127.0.0.1:{port}/mcp", proc, 30.0)
        monkeypatch.setenv("TEST_MCP_KEY", "s3cret")
        servers = {"mcpServers": {"web": {"type": "http", "url": f"http://127.0.0.1:{port}/mcp",
                                          "headers": {"X-Team": "rl"}, "api_key_env": "TEST_MCP_KEY",
                                          "tools": ["add", "header"]}}}

        async def go():
            env = Plain(mcp=servers)
            await env.reset({})
            assert [t.name for t in env.tools] == ["echo", "add", "header", "finish"]
            return [await step(env, "add", a=5, b=6), await step(env, "header", key="X-Team"),
                    await step(env, "header", key="Authorization")]
        assert asyncio.run(go()) == ["11", "rl", "Bearer s3cret"]
    finally:
        proc.terminate()
        proc.wait(10)


def test_server_configs_are_checked(tmp_path, monkeypatch):
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({"mcpServers": STDIO}))
    assert parse_servers(str(path)) == parse_servers(STDIO) == parse_servers({"mcpServers": STDIO})
    assert parse_servers({"s": {"command": "x", "pure": True}})[0].pure is True
    spec = parse_servers(STDIO)[0]
    assert spec.command == (sys.executable, SERVER) and spec.scope == "run" and spec.timeout_s == 10.0
    bad = [({"s": {"command": "x", "port": 1}}, r"unknown keys \['port'\]; valid: \["),
           ({"s": {"command": "x", "url": "http://h"}}, "either command .* or url"),
           ({"s": {}}, "either command"),
           ({"s": {"url": "http://h", "type": "sse"}}, r"type 'sse' is not supported; valid: \['stdio'"),
           ({"s": {"command": "x", "scope": "task"}}, r"scope 'task' is not one of \['run', 'episode'\]"),
           ({"s": {"command": "x", "timeout_s": 0}}, "timeout_s must be a positive number"),
           ({"s": {"command": ["x", 1]}}, "command must be a program"),
           ({"s": {"command": "x", "pure": "yes"}}, "pure must be true or false"),
           ({"mcpServers": {}}, "names no servers"),
           ([1], "a JSON file's path or a table"),
           (str(tmp_path / "none.json"), "cannot read the servers file")]
    for servers, message in bad:
        with pytest.raises(ValueError, match=message):
            parse_servers(servers)
    monkeypatch.delenv("NO_SUCH_KEY", raising=False)
    with pytest.raises(ValueError, match="api_key_env 'NO_SUCH_KEY' is not set"):
        Plain(mcp={"s": {"url": "http://127.0.0.1:1/mcp", "api_key_env": "NO_SUCH_KEY"}})

    async def listing(servers):
        await Plain(mcp=servers).reset({})
    with pytest.raises(ValueError, match=r"has no tools \['sub'\]; it has \['add', "):
        asyncio.run(listing({"t": {**STDIO["test"], "tools": ["add", "sub"]}}))
    with pytest.raises(ValueError, match=r"list tools of the same name \['add'\]"):
        asyncio.run(listing({"a": {**STDIO["test"], "tools": ["add"]}, "b": {**STDIO["test"], "tools": ["add"]}}))

    class Adder(Plain):
        def make_tools(self, task):
            return [Tool(lambda a, b: a + b, name="add", parameters={"type": "object", "properties": {}})]
    with pytest.raises(ValueError, match=r"MCP tools \['add'\] have the names of the env's own tools"):
        asyncio.run(Adder(mcp={"t": {**STDIO["test"], "tools": ["add"]}}).reset({}))


def test_what_the_model_reads_of_a_result():
    text = mcp_types.TextContent(type="text", text="hello")
    image = mcp_types.ImageContent(type="image", data="aGk=", mime_type="image/png")
    res = mcp_types.EmbeddedResource(type="resource", resource=mcp_types.TextResourceContents(
        uri="file:///a.txt", text="file text"))
    assert result_text(mcp_types.CallToolResult(content=[text, image, res])) == "hello\n[image image/png]\nfile text"
    assert result_text(mcp_types.CallToolResult(content=[], structured_content={"n": 1})) == '{"n": 1}'


def test_the_dataset_env_solves_the_units_tasks_with_the_example_mcp_server(expert_rewards):
    """examples/units_mcp_server.py serves the units example's convert tool; the dataset env with
    `mcp` (examples/train-units-mcp.toml's options) plays the tasks' solution transcripts through it."""
    import tomllib
    options = tomllib.loads((EXAMPLES / "train-units-mcp.toml").read_text())["env_options"]
    options["mcp"]["units"]["command"] = sys.executable  # ("python" on the PATH of an activated venv)
    tasks = load_tasks(EXAMPLES / "units-train.jsonl")[:24]
    assert expert_rewards(lambda: make_env("dataset", **options), tasks) == [1.0] * 24

    async def wrong():
        env = make_env("dataset", **options)
        await env.reset(tasks[0])
        return await step(env, "convert", value=1.0, from_unit="parsec", to_unit="m")
    assert "unknown unit 'parsec'" in asyncio.run(wrong())


def _gone(pid: int, wait_s: float = 10.0) -> bool:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # (a child of ours that exited stays a zombie until reaped)
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            pass
        time.sleep(0.05)
    return False


def test_connection_is_made_once_under_concurrent_first_calls():
    async def go():
        conn = MCPConnection(parse_servers(STDIO)[0])
        results = await asyncio.gather(*(conn.call("add", {"a": i, "b": 1}) for i in range(16)))
        assert results == [str(i + 1) for i in range(16)] and conn.connects == 1
        await conn.close()
    asyncio.run(go())
