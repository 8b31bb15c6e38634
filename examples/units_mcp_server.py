"""The units example's `convert` tool served by an MCP server of its own (the MCP SDK's MCPServer),
for envs that take their tools from MCP servers (examples/train-units-mcp.toml,
rollwise.agent.mcp_tools):

    python examples/units_mcp_server.py                 # over stdin/stdout: what `command` runs
    python examples/units_mcp_server.py --port 8765     # streamable HTTP at http://127.0.0.1:8765/mcp
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import ToolAnnotations

sys.path.insert(0, str(Path(__file__).parent))
from units_env import METERS, convert as convert_length  # noqa: E402

app = MCPServer("units")


@app.tool(annotations=ToolAnnotations(read_only_hint=True))  # (reusable by an env with tool_cache)
def convert(value: float, from_unit: str, to_unit: str) -> str:
    """Convert a length between units: m, km, mile, ft, yard."""
    try:
        return convert_length(value, from_unit, to_unit)
    except ValueError as e:  # (MCPServer reports a ToolError's message to the client, other errors' not)
        raise ToolError(str(e)) from e


@app.tool()
def units() -> list[str]:
    """The units convert knows."""
    return sorted(METERS)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, help="serve streamable HTTP on 127.0.0.1 at this port (default: stdio)")
    args = ap.parse_args()
    if args.port is None:
        app.run()
    else:
        app.run("streamable-http", host="127.0.0.1", port=args.port)
