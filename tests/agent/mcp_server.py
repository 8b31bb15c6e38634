"""An MCP server for tests (stdio, or streamable HTTP with --port): tools that answer, fail, take
their time, keep state, name their process and crash it."""
from __future__ import annotations

import os
import sys
import time

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import ToolAnnotations

app = MCPServer("test")
calls = 0
given = sys.argv[sys.argv.index("--state") + 1] if "--state" in sys.argv else ""


@app.tool(annotations=ToolAnnotations(read_only_hint=True))
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@app.tool()
def fail(why: str) -> str:
    """Fail with a reason."""
    raise ToolError(f"cannot: {why}")


@app.tool()
def slow(seconds: float) -> str:
    """Sleep, then answer."""
    time.sleep(seconds)
    return f"slept {seconds}"


@app.tool()
def count() -> int:
    """How many times this was called in this process."""
    global calls
    calls += 1
    return calls


@app.tool()
def state() -> str:
    """What the server was started with (--state VALUE) and its environment's TEST_STATE."""
    return f"{given} {os.environ.get('TEST_STATE', '')}".strip()


@app.tool()
def pid() -> int:
    """The server's process id."""
    return os.getpid()


@app.tool()
def crash() -> str:
    """Print a last word on stderr and exit at once."""
    print("the test server crashes now", file=sys.stderr, flush=True)
    os._exit(3)


@app.tool()
def header(key: str, ctx: Context) -> str:
    """A header of the HTTP request that called this (empty over stdio)."""
    return (ctx.headers or {}).get(key.lower(), "")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--port":
        app.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        app.run()
