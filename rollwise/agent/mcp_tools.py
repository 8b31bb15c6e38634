"""Tools from MCP servers (the Model Context Protocol: a server lists its tools, each with a JSON
schema for its input, and runs them when asked), for any `ToolEnv`: `env_options = { mcp =
"mcp.json" }` adds every tool of every server the file names to the env's own, shown to the model
in the chat template and called like them (`pip install 'rollwise[mcp]'` for the SDK).

Servers are given as Claude Desktop, Cursor and verl's MCP tools write them, in a JSON file or inline:

    {"mcpServers": {"units": {"command": "python", "args": ["units_server.py"], "env": {"KEY": "..."}},
                    "docs": {"url": "http://127.0.0.1:8000/mcp", "headers": {"X-Team": "rl"}}}}

A server with `command` runs as a subprocess talking over stdin/stdout (its stderr goes to a
temporary file, whose tail a failure quotes, or to `log`); one with `url` is reached by streamable
HTTP (`api_key_env` names a variable holding a bearer key). Per server, also: `tools` (the names to
keep; default all), `timeout_s` (each call's deadline, default 10 s, within the env's
`tool_timeout`), `max_concurrency` (calls in flight at once), `connect_timeout_s`, `pure` (its
tools' results may be reused by an env with `tool_cache`; default: each tool's `readOnlyHint`) and `scope`:
`"run"` (default) shares one connection among all of a run's episodes (one event loop), `"episode"`
starts a server for each episode and stops it when the episode ends (a server that keeps state; at
most `max_starting`, default 8, start at once in a run); an episode's server may be given its task's
fields: `${task.FIELD}` in `args`, `env` values or `cwd` (e.g. `args = ["db_server.py", "--db",
"${task.db_path}"]`).

What a server reports as a failed call (its `isError` results, a JSON-RPC error) is the model's to
read, as `error: ...`; a server that cannot be reached, or whose connection is lost, raises
`ServiceError`: the episode ends with status `error` and runs again, and the next call connects anew.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import tempfile
from pathlib import Path

from rollwise.agent.tools import ServiceError, Tool, ToolError

SERVER_KEYS = {"command", "args", "env", "cwd", "url", "headers", "api_key_env", "type", "tools", "timeout_s",
               "max_concurrency", "connect_timeout_s", "scope", "log", "pure", "max_starting"}
SCOPES = ("run", "episode")
_TASK_FIELD = re.compile(r"\$\{task\.([A-Za-z0-9_]+)\}")
TRANSPORTS = ("stdio", "http", "streamable-http", "streamable_http")


@dataclasses.dataclass(frozen=True)
class MCPServerSpec:
    """One server of a config (hashable: a run's episodes share the connection to equal specs)."""

    name: str
    command: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    cwd: str | None = None
    url: str | None = None
    headers: tuple[tuple[str, str], ...] = ()
    api_key_env: str | None = None
    tools: tuple[str, ...] | None = None
    timeout_s: float = 10.0
    max_concurrency: int | None = None
    connect_timeout_s: float = 30.0
    scope: str = "run"
    log: str | None = None
    pure: bool | None = None  # its tools' results reusable (`tool_cache`); None: as each tool's readOnlyHint says
    max_starting: int = 8  # scope "episode": at most this many of its servers start at once (a run's)

    def for_task(self, task: dict) -> MCPServerSpec:
        """This episode-scoped server with `${task.FIELD}` replaced by the task's fields."""
        def fill(text):
            def field(m):
                if m.group(1) not in task:
                    raise ValueError(f"{self.where}: the task has no field {m.group(1)!r} (fields: {sorted(task)})")
                return str(task[m.group(1)])
            return None if text is None else _TASK_FIELD.sub(field, text)
        return dataclasses.replace(self, command=tuple(map(fill, self.command)), cwd=fill(self.cwd),
                                   env=tuple((k, fill(v)) for k, v in self.env))

    @property
    def where(self) -> str:
        return f"MCP server {self.name!r} ({self.url or ' '.join(self.command)})"


def parse_servers(spec) -> list[MCPServerSpec]:
    """The servers of `mcp = ...`: a path to a JSON file or a dict, either `{"mcpServers": {name:
    server}}` or `{name: server}`; a ValueError says what is wrong and what is valid."""
    if isinstance(spec, (str, Path)):
        try:
            spec = json.loads(Path(spec).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"mcp: cannot read the servers file {str(spec)!r}: {e}") from e
    if not isinstance(spec, dict):
        raise ValueError(f"mcp must be a JSON file's path or a table of servers, got {type(spec).__name__}")
    servers = spec.get("mcpServers", spec)
    if not isinstance(servers, dict) or not servers:
        raise ValueError("mcp names no servers: give {name = { command = ..., args = [...] }} or "
                         "{name = { url = ... }}")
    return [_server(name, cfg) for name, cfg in servers.items()]


def _server(name: str, cfg) -> MCPServerSpec:
    if not isinstance(cfg, dict):
        raise ValueError(f"MCP server {name!r} must be a table, got {type(cfg).__name__}")
    unknown = sorted(set(cfg) - SERVER_KEYS)
    if unknown:
        raise ValueError(f"MCP server {name!r}: unknown keys {unknown}; valid: {sorted(SERVER_KEYS)}")
    if ("command" in cfg) == ("url" in cfg):
        raise ValueError(f"MCP server {name!r} needs either command (a subprocess) or url (streamable HTTP)")
    if cfg.get("type", "stdio" if "command" in cfg else "http") not in TRANSPORTS:
        raise ValueError(f"MCP server {name!r}: type {cfg['type']!r} is not supported; valid: {list(TRANSPORTS)} "
                         "(SSE, the older HTTP transport, is not)")
    command = cfg.get("command", ())
    command = (command,) if isinstance(command, str) else tuple(command)
    if "command" in cfg and (not command or not all(isinstance(c, str) for c in command)):
        raise ValueError(f"MCP server {name!r}: command must be a program (and args a list of strings)")
    scope = cfg.get("scope", "run")
    if scope not in SCOPES:
        raise ValueError(f"MCP server {name!r}: scope {scope!r} is not one of {list(SCOPES)}")
    if not isinstance(cfg.get("pure", False), bool):
        raise ValueError(f"MCP server {name!r}: pure must be true or false, got {cfg['pure']!r}")
    for key in ("timeout_s", "connect_timeout_s", "max_concurrency", "max_starting"):
        if key in cfg and not (isinstance(cfg[key], (int, float)) and cfg[key] > 0):
            raise ValueError(f"MCP server {name!r}: {key} must be a positive number, got {cfg[key]!r}")
    if not isinstance(cfg.get("max_starting", 1), int):
        raise ValueError(f"MCP server {name!r}: max_starting must be a whole number, got {cfg['max_starting']!r}")
    tools = cfg.get("tools")
    templated = [str(v) for v in (*command, *cfg.get("args", ()), *cfg.get("env", {}).values(), cfg.get("cwd"))
                 if v is not None and _TASK_FIELD.search(str(v))]
    if templated and scope != "episode":
        raise ValueError(f"MCP server {name!r}: {templated[0]!r} names a task's field, which only a server with "
                         "scope = 'episode' has")
    return MCPServerSpec(
        name=name, command=command + tuple(cfg.get("args", ())), env=tuple(sorted(cfg.get("env", {}).items())),
        cwd=cfg.get("cwd"), url=cfg.get("url"), headers=tuple(sorted(cfg.get("headers", {}).items())),
        api_key_env=cfg.get("api_key_env"), tools=None if tools is None else tuple(tools),
        timeout_s=float(cfg.get("timeout_s", 10.0)), max_concurrency=cfg.get("max_concurrency"),
        connect_timeout_s=float(cfg.get("connect_timeout_s", 30.0)), scope=scope, log=cfg.get("log"),
        pure=cfg.get("pure"), max_starting=cfg.get("max_starting", 8))


def _client_module():
    try:
        import mcp
        from mcp.client.stdio import stdio_client
        from mcp.shared.exceptions import MCPError
    except ImportError as e:
        raise ValueError("MCP tools need the MCP SDK: pip install 'rollwise[mcp]'") from e
    return mcp, stdio_client, MCPError


class MCPConnection:
    """A connection to one server, held open by a task of its own (the SDK's client must be left
    in the task that entered it); it connects on first use and again after it was lost."""

    def __init__(self, spec: MCPServerSpec) -> None:
        self.spec = spec
        self._client = None
        self._tools: list[Tool] | None = None
        self._task: asyncio.Task | None = None
        self._stop: asyncio.Event | None = None
        self._lock = asyncio.Lock()
        self._errlog = None
        self._slots = asyncio.Semaphore(spec.max_concurrency) if spec.max_concurrency else None
        self.connects = 0  # (how many times it connected: tests, and a user's curiosity)

    async def tools(self) -> list[Tool]:
        """The server's tools (listed once per connection), as `Tool`s that call it."""
        await self._connected()
        return self._tools

    async def call(self, name: str, arguments: dict) -> str:
        _, _, MCPError = _client_module()
        client = await self._connected()
        try:
            if self._slots is None:
                result = await client.call_tool(name, arguments)
            else:
                async with self._slots:
                    result = await client.call_tool(name, arguments)
        except MCPError as e:
            if e.code == _CONNECTION_CLOSED:
                await self._lost(client)
                raise ServiceError(f"{self.spec.where}: connection lost{self._stderr_tail()}") from e
            raise ToolError(f"{name}: {e.message}") from e  # a JSON-RPC error: the call's, not the server's
        except Exception as e:  # noqa: BLE001 - the transport's (an HTTP error, a malformed message): the server's
            await self._lost(client)
            raise ServiceError(f"{self.spec.where}: {_describe(_unwrap(e))}{self._stderr_tail()}") from e
        text = result_text(result)
        if result.is_error:
            raise ToolError(text or f"{name} failed")
        return text

    async def close(self) -> None:
        async with self._lock:
            await self._shut()
            if self._errlog is not None:
                self._errlog.close()
                self._errlog = None

    # ----------------------------------------------------------------------------------------------
    async def _connected(self):
        client = self._client
        if client is not None:
            return client
        async with self._lock:
            if self._client is None:
                await self._shut()
                await self._open()
            return self._client

    async def _open(self) -> None:
        ready, self._stop = asyncio.Event(), asyncio.Event()
        failure: list[BaseException] = []
        self._task = asyncio.create_task(self._hold(ready, failure), name=f"mcp:{self.spec.name}")
        try:
            await asyncio.wait_for(ready.wait(), self.spec.connect_timeout_s)
        except asyncio.TimeoutError:
            await self._shut()
            raise ServiceError(f"{self.spec.where} did not connect within {self.spec.connect_timeout_s:g}s"
                               f"{self._stderr_tail()}") from None
        if self._client is None:
            err = _unwrap(failure[0]) if failure else RuntimeError("closed")
            await self._shut()
            if isinstance(err, (ValueError, ServiceError)):
                raise err
            raise ServiceError(f"{self.spec.where} could not be reached: {_describe(err)}"
                               f"{self._stderr_tail()}") from err
        self.connects += 1

    async def _hold(self, ready: asyncio.Event, failure: list) -> None:
        """Enter the client, list the tools, and hold the connection until `_stop` (or until it breaks)."""
        try:
            async with contextlib.AsyncExitStack() as stack:
                client = await stack.enter_async_context(await self._make_client(stack))
                self._tools = await self._list(client)
                self._client = client
                ready.set()
                await self._stop.wait()
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits in _open
            failure.append(e)
            if isinstance(e, asyncio.CancelledError):
                raise
        finally:
            self._client = None
            ready.set()

    async def _make_client(self, stack: contextlib.AsyncExitStack):
        mcp, stdio_client, _ = _client_module()
        spec = self.spec
        if spec.url is not None:
            headers = dict(spec.headers)
            if spec.api_key_env:
                headers["Authorization"] = f"Bearer {_api_key(spec)}"
            if not headers:
                return mcp.Client(spec.url)
            import httpx2
            from mcp.client.streamable_http import streamable_http_client
            http = await stack.enter_async_context(  # (the SDK's timeouts)
                httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30.0, read=300.0)))
            return mcp.Client(streamable_http_client(spec.url, http_client=http))
        if self._errlog is None:
            self._errlog = open(spec.log, "a") if spec.log else tempfile.TemporaryFile("w+")  # noqa: SIM115
        params = mcp.StdioServerParameters(command=spec.command[0], args=list(spec.command[1:]),
                                           env=dict(spec.env) or None, cwd=spec.cwd)
        return mcp.Client(stdio_client(params, errlog=self._errlog))

    async def _list(self, client) -> list[Tool]:
        listed, cursor = [], None
        while True:
            page = await client.list_tools(cursor=cursor)
            listed += page.tools
            cursor = page.next_cursor
            if not cursor:
                break
        names = [t.name for t in listed]
        if self.spec.tools is not None:
            missing = sorted(set(self.spec.tools) - set(names))
            if missing:
                raise ValueError(f"{self.spec.where} has no tools {missing}; it has {sorted(names)}")
            listed = [t for t in listed if t.name in self.spec.tools]
        return [self._tool(t) for t in listed]

    def _tool(self, listed) -> Tool:
        name = listed.name

        async def call(**arguments):
            return await self.call(name, arguments)
        read_only = bool(getattr(getattr(listed, "annotations", None), "read_only_hint", False))
        return Tool(call, name=name, description=listed.description or "",
                    parameters=dict(listed.input_schema or {"type": "object", "properties": {}}),
                    timeout=self.spec.timeout_s, pure=read_only if self.spec.pure is None else self.spec.pure)

    async def _lost(self, client) -> None:
        async with self._lock:
            if self._client is client:
                await self._shut()

    async def _shut(self) -> None:
        task, self._task = self._task, None
        self._client = None
        if task is not None:
            self._stop.set()
            try:
                await asyncio.wait_for(asyncio.shield(task), 10.0)
            except BaseException:  # noqa: BLE001 - a broken connection's exit may raise; it is gone either way
                task.cancel()

    def _stderr_tail(self, chars: int = 600) -> str:
        log = self._errlog
        if log is None or self.spec.log:
            return f" (its stderr: {self.spec.log})" if self.spec.log else ""
        try:
            log.flush()
            log.seek(0, os.SEEK_END)
            size = log.tell()
            log.seek(max(0, size - chars))
            tail = log.read().strip()
            log.seek(0, os.SEEK_END)
        except (OSError, ValueError):
            return ""
        return f"; its stderr ends: {tail}" if tail else ""


def _api_key(spec: MCPServerSpec) -> str:
    key = os.environ.get(spec.api_key_env or "")
    if not key:
        raise ValueError(f"{spec.where}: api_key_env {spec.api_key_env!r} is not set")
    return key


_CONNECTION_CLOSED = -32000  # JSON-RPC's code for it in the SDK (mcp_types.CONNECTION_CLOSED)


def _unwrap(e: BaseException) -> BaseException:
    """The one exception inside (nested) groups of one, as anyio's task groups raise them."""
    while isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
        e = e.exceptions[0]
    return e


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def result_text(result) -> str:
    """What the model reads of a call's result: its text (and embedded text resources), a note for
    what it cannot read (images, audio), the structured content as JSON if there is nothing else."""
    parts = []
    for item in result.content:
        kind = getattr(item, "type", "")
        if kind == "text":
            parts.append(item.text)
        elif kind == "resource" and getattr(item.resource, "text", None) is not None:
            parts.append(item.resource.text)
        elif kind == "resource_link":
            parts.append(f"[resource {item.uri}]")
        else:
            parts.append(f"[{kind or 'content'} {getattr(item, 'mime_type', '') or ''}]".replace(" ]", "]"))
    if not parts and result.structured_content is not None:
        return json.dumps(result.structured_content)
    return "\n".join(parts)


class MCPTools:
    """The tools of a config's servers for one env: shared connections for `scope = "run"`
    servers (one per event loop), the env's own for `scope = "episode"` ones, closed by `close()`."""

    def __init__(self, servers) -> None:
        self.servers = parse_servers(servers)
        _client_module()  # (a missing SDK or key is a config error, said at once)
        for spec in self.servers:
            if spec.api_key_env:
                _api_key(spec)
        self._own: list[MCPConnection] = []

    async def tools(self, task: dict | None = None) -> list[Tool]:
        """The servers' tools for an episode of `task` (whose fields episode-scoped servers may take)."""
        from rollwise.agent.env import loop_shared
        await self.close()  # (an env reset for another episode: the last one's servers stop)
        out: list[Tool] = []
        for spec in self.servers:
            if spec.scope == "run":
                out += await loop_shared(("mcp", spec), lambda spec=spec: MCPConnection(spec)).tools()
                continue
            conn = MCPConnection(spec.for_task(task or {}))
            self._own.append(conn)
            # it starts (connects and lists its tools) with at most max_starting others of the run's
            async with loop_shared(("mcp-starting", spec), lambda spec=spec: asyncio.Semaphore(spec.max_starting)):
                out += await conn.tools()
        names = [t.name for t in out]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"MCP servers {[s.name for s in self.servers]} list tools of the same name {dup}; keep "
                             "one with a server's `tools = [...]`")
        return out

    async def close(self) -> None:
        own, self._own = self._own, []
        for conn in own:
            await conn.close()
