"""What a tool costs when an MCP server serves it: the units example's `convert` called by concurrent
episodes as an env calls its tools (`Tool.call`: the argument check, the deadline), three ways, taking
turns within each repetition: in process (the units env's own function, in a worker thread: the
baseline), from an MCP server over stdio (a subprocess: examples/units_mcp_server.py) and from the
same server over streamable HTTP on 127.0.0.1. Every side must return the same results. Also the
time to connect (start the server, list its tools).

    python benchmarks/mcp_tools.py [--concurrency 1,16,128] [--calls 1024] [--repeats 3] [--smoke] [--json PATH]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rollwise.agent.mcp_tools import MCPConnection, parse_servers
from rollwise.agent.tools import Tool
from rollwise.serve.process import free_port, wait_for_http

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
from units_env import METERS, convert  # noqa: E402
from common import write_json  # noqa: E402  (benchmarks/common.py)


def workload(n: int) -> list[dict]:
    units = sorted(METERS)
    return [{"value": round(0.5 + i * 0.37, 2), "from_unit": units[i % 5], "to_unit": units[(i // 5) % 5]}
            for i in range(n)]


async def run_side(tool: Tool, calls: list[dict], concurrency: int) -> tuple[float, list[float], list[str]]:
    """Seconds for `concurrency` episodes to make every call (each its own share, one after another);
    each call's latency; the results in call order."""
    results: list[str] = [""] * len(calls)
    latencies: list[float] = []

    async def episode(i0: int) -> None:
        for i in range(i0, len(calls), concurrency):
            t = time.perf_counter()
            r = await tool.call(calls[i])
            latencies.append(time.perf_counter() - t)
            assert r.ok, r.content
            results[i] = r.content
    t0 = time.perf_counter()
    await asyncio.gather(*(episode(i) for i in range(concurrency)))
    return time.perf_counter() - t0, latencies, results


async def measure(args, port: int) -> dict:
    server = [sys.executable, str(EXAMPLES / "units_mcp_server.py")]
    conns = {"stdio": MCPConnection(parse_servers({"units": {"command": server[0], "args": server[1:]}})[0]),
             "http": MCPConnection(parse_servers({"units": {"url": f"http://127.0.0.1:{port}/mcp"}})[0])}
    connect_s = {}
    tools = {"in_process": Tool(convert)}
    for name, conn in conns.items():
        t0 = time.perf_counter()
        tools[name] = next(t for t in await conn.tools() if t.name == "convert")
        connect_s[name] = time.perf_counter() - t0
    calls = workload(args.calls)
    want = [convert(**c) for c in calls]
    out = {"connect_s": connect_s, "calls": len(calls), "concurrency": {}}
    for c in args.concurrency:
        secs = {name: [] for name in tools}
        lats = {name: [] for name in tools}
        for rep in range(args.repeats):
            for name, tool in tools.items():
                s, lat, got = await run_side(tool, calls, c)
                assert got == want, f"{name} returned other results"
                secs[name].append(s)
                lats[name] += lat
            print(f"  concurrency {c} repeat {rep + 1}/{args.repeats}: "
                  + ", ".join(f"{n} {secs[n][-1]:.2f}s" for n in tools), flush=True)
        row = {}
        for name in tools:
            best = min(secs[name])
            lat = sorted(lats[name])
            row[name] = {"seconds": best, "calls_per_s": len(calls) / best,
                         "p50_ms": 1e3 * statistics.median(lat), "p99_ms": 1e3 * lat[int(0.99 * (len(lat) - 1))]}
        for name in ("stdio", "http"):
            row[name]["time_vs_in_process"] = row[name]["seconds"] / row["in_process"]["seconds"]
        out["concurrency"][c] = row
    for conn in conns.values():
        await conn.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,16,128")
    ap.add_argument("--calls", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="a few calls, one repeat (tests)")
    ap.add_argument("--json")
    args = ap.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if args.smoke:
        args.calls, args.repeats, args.concurrency = 32, 1, [1, 8]
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(EXAMPLES / "units_mcp_server.py"), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_http(f"http://127.0.0.1:{port}/mcp", proc, 60.0)
        out = asyncio.run(measure(args, port))
    finally:
        proc.terminate()
        proc.wait(10)
    print(f"connect: stdio {out['connect_s']['stdio']:.2f}s (starts the server), http {out['connect_s']['http']:.2f}s")
    print(f"{'concurrency':>11} {'side':>10} {'calls/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'time vs in process':>19}")
    for c, row in out["concurrency"].items():
        for name, r in row.items():
            ratio = f"{r['time_vs_in_process']:.1f}x" if "time_vs_in_process" in r else "1.0x"
            print(f"{c:>11} {name:>10} {r['calls_per_s']:>9.0f} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} {ratio:>19}")
    write_json(args.json, out)


if __name__ == "__main__":
    main()
