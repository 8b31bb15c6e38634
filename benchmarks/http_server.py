"""What the HTTP layer costs `rollwise serve`, against how it ran before, side by side in one run:

- now: the API-key check as plain ASGI (`rollwise.serve.auth.AuthMiddleware`), uvicorn on uvloop
  and httptools (dependencies; uvicorn takes them when installed, as `uvicorn[standard]` and vLLM do);
- middleware: the same check through starlette's `@app.middleware("http")` (before 2026-12-07),
  which runs every request, and every piece of a streamed reply, through a task and a memory stream
  of its own;
- asyncio: uvicorn on asyncio's own loop and h11, its pure-Python HTTP parser (before 2026-12-07);
- before: both, as the server ran before 2026-12-07.

Servers of the same code on the same model, each with an API key (every request checked); the
client's two loads take turns on them (median of --reps, each run after every server is idle):
`--streams` concurrent streamed completions of `--tokens` tokens each (a chunk a token), and
`--requests` small requests (GET /v1/models) over 16 keep-alive connections. Reports each side's
events (chunks or replies) per second and its server's CPU seconds per 1,000, and now's ratios
against each. The model is the 2-layer test size, so the HTTP work is most of the server's.

    python benchmarks/http_server.py [--smoke] [--reps 5] [--json PATH]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time

import httpx

from rollwise.omp import passive_env
from rollwise.serve.process import free_port, wait_for_http

from common import _cpu_ticks, engine_model, settle, write_json  # (benchmarks/common.py)

KEY = "bench-key"
LAUNCH = r"""
import sys, uvicorn
from starlette.middleware.base import BaseHTTPMiddleware
from rollwise.config import ServerConfig
from rollwise.engine.async_engine import AsyncEngine
from rollwise.serve.auth import AuthMiddleware
from rollwise.serve.server import build_app
model, port, key, side = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
cfg = ServerConfig(port=port, api_key=key)
app = build_app(AsyncEngine(model), cfg, "m")
if side in ("middleware", "before"):  # the same check, through starlette's @app.middleware("http") as it ran before
    check = AuthMiddleware(None, cfg)
    async def auth(request, call_next):
        return check.refused(request.url.path, request.method, request.headers) or await call_next(request)
    app.user_middleware = [m for m in app.user_middleware if m.cls is not AuthMiddleware]
    app.add_middleware(BaseHTTPMiddleware, dispatch=auth)
io = {"loop": "asyncio", "http": "h11"} if side in ("asyncio", "before") else {}  # (else uvicorn's choice)
uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", **io)
"""
SIDES = ("now", "middleware", "asyncio", "before")


async def streams(url: str, n: int, tokens: int) -> int:
    async with httpx.AsyncClient(timeout=600, headers={"Authorization": f"Bearer {KEY}"},
                                 limits=httpx.Limits(max_connections=n + 8)) as c:
        async def one(i: int) -> int:
            body = {"model": "m", "prompt": [5, 6, 7, 10 + i % 50], "max_tokens": tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            async with c.stream("POST", url + "/v1/completions", json=body) as r:
                r.raise_for_status()
                return sum([line.startswith("data: {") async for line in r.aiter_lines()])
        return sum(await asyncio.gather(*(one(i) for i in range(n))))


async def small(url: str, n: int, workers: int = 16) -> int:
    """`n` GET /v1/models over `workers` keep-alive connections, a plain HTTP/1.1 client (httpx's pool
    with hundreds of requests waiting on it costs more than the server does)."""
    host, port = url.removeprefix("http://").split(":")
    request = (f"GET /v1/models HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n\r\n").encode()

    async def worker(count: int) -> int:
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            for _ in range(count):
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200"), head[:80]
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                await reader.readexactly(length)
        finally:
            writer.close()
        return count
    return sum(await asyncio.gather(*(worker(n // workers + (i < n % workers)) for i in range(workers))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="small loads, one run each")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.smoke:
        args.reps, args.streams, args.tokens, args.requests = 1, 2, 8, 20
    model = engine_model("smoke")
    procs, urls, logs = {}, {}, {}
    try:
        for side in SIDES:
            port = free_port()
            logs[side] = tempfile.TemporaryFile()
            procs[side] = subprocess.Popen([sys.executable, "-c", LAUNCH, model, str(port), KEY, side],
                                           env=passive_env(), stdout=subprocess.DEVNULL, stderr=logs[side])
            urls[side] = f"http://127.0.0.1:{port}"
            wait_for_http(urls[side] + "/health", procs[side], 120, ok=lambda r: r.status_code == 200, log=logs[side])
        pids = [p.pid for p in procs.values()]
        loads = {"stream_chunks": lambda u: streams(u, args.streams, args.tokens),
                 "small_requests": lambda u: small(u, args.requests)}
        runs: dict = {load: {side: [] for side in procs} for load in loads}
        for rep in range(args.reps + 1):  # (the first round warms both up, untimed)
            for load, fn in loads.items():
                for side, url in urls.items():
                    settle(pids)
                    cpu0, t0 = _cpu_ticks(procs[side].pid), time.perf_counter()
                    events = asyncio.run(fn(url))
                    dt, cpu = time.perf_counter() - t0, (_cpu_ticks(procs[side].pid) - cpu0) / os.sysconf("SC_CLK_TCK")
                    if rep:
                        runs[load][side].append((events / dt, 1000 * cpu / events, events))
    finally:
        for p in procs.values():
            p.terminate()
            p.wait()
    out = {"model": model, "reps": args.reps, "streams": args.streams, "tokens": args.tokens,
           "requests": args.requests, "loads": {}}
    for load, sides in runs.items():
        row = {side: {"per_s": median([r[0] for r in rs]), "server_cpu_s_per_1000": median([r[1] for r in rs]),
                      "events": rs[-1][2]} for side, rs in sides.items()}
        now = row["now"]
        line = [f"{load} ({now['events']} a run): now {now['per_s']:.0f}/s, {now['server_cpu_s_per_1000']:.3f} server "
                "CPU s per 1000"]
        for side in SIDES[1:]:
            old = row[side]
            old["ratio_per_s"] = now["per_s"] / old["per_s"]  # (now's against it)
            old["ratio_cpu"] = old["server_cpu_s_per_1000"] / max(now["server_cpu_s_per_1000"], 1e-9)
            line.append(f"{side} {old['per_s']:.0f}/s, {old['server_cpu_s_per_1000']:.3f} (now: "
                        f"{old['ratio_per_s']:.2f}x the rate, {old['ratio_cpu']:.2f}x less CPU)")
        out["loads"][load] = row
        print("; ".join(line))
    write_json(args.json, out)


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


if __name__ == "__main__":
    main()
