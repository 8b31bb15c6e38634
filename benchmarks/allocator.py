"""glibc's malloc and the engine's prefill over HTTP (rollwise/engine/allocator.py): `rollwise serve`
as it starts (its `allocator.settle()`: one arena, chunks below 32 MiB from it, its free top kept up
to 128 MiB) against the same server under glibc's defaults (GLIBC_TUNABLES naming a malloc tunable
at its default value, so `settle()` leaves them be). Both servers are up at once and take turns, each run's
concurrent /v1/completions prompts new to both (one token each: the prefill alone), after a round untimed.

    python benchmarks/allocator.py [--smoke] [--json PATH] [--reps N]

Reports, per case and side, prefill tokens/s (median of the runs) with the tokens, and per run the
server process's minor page faults and system CPU seconds (medians): what a step's activations cost
when their pages go back to the OS and are faulted in again, zeroed, at the next step.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path

from rollwise.omp import passive_unless_chosen
passive_unless_chosen()  # before torch loads

from rollwise.serve.process import ServerProcess  # noqa: E402

from common import engine_model, paired, rand_prompts, write_json  # noqa: E402  (benchmarks/common.py)

# glibc's defaults: a malloc tunable at its default value (settle() leaves glibc be wherever one is set).
# (Not MALLOC_TOP_PAD_ at its default: setting it also turns glibc's growing mmap threshold off.)
SIDES = {"settled": {}, "glibc_defaults": {"GLIBC_TUNABLES": "glibc.malloc.perturb=0"}}


def counters(pid: int) -> tuple[int, float]:
    """A process's minor page faults and system CPU seconds so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[7]), int(fields[12]) / os.sysconf("SC_CLK_TCK")


async def prefill(url: str, model_name: str, prompts: list[list[int]]) -> int:
    import httpx
    async with httpx.AsyncClient(timeout=600) as c:
        async def one(p):
            r = await c.post(url + "/v1/completions", json={"model": model_name, "prompt": p, "max_tokens": 1,
                                                           "temperature": 0, "ignore_eos": True})
            r.raise_for_status()
            return r.json()["usage"]["prompt_tokens"]
        return sum(await asyncio.gather(*(one(p) for p in prompts)))


def bench(servers: dict, name: str, cases: list[tuple[int, int]], vocab: int, reps: int) -> dict:
    """servers: side -> ServerProcess of model `name`. Per case "BxL": side -> tok/s, tokens, s, and
    page faults and system seconds a run."""
    out: dict = {}
    for srv in servers.values():  # (a first request of each server's: its warm-up)
        asyncio.run(prefill(srv.url, name, rand_prompts(2, 64, vocab, 1)))
    for b, plen in cases:
        seen: dict = {k: [] for k in servers}
        runs = {k: iter(range(reps + 1)) for k in servers}

        def run(k: str) -> int:
            srv, rep = servers[k], next(runs[k])
            before = counters(srv.proc.pid)
            n = asyncio.run(prefill(srv.url, name, rand_prompts(b, plen, vocab, 1000 * plen + rep)))
            after = counters(srv.proc.pid)
            seen[k].append((after[0] - before[0], after[1] - before[1]))
            return n
        pids = [s.proc.pid for s in servers.values()]
        r = paired({k: (lambda k=k: run(k)) for k in servers}, reps, pids, warmup=True)  # (a round untimed)
        seen = {k: v[1:] for k, v in seen.items()}  # (the timed runs')
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        out[f"{b}x{plen}"] = {k: {"tok_s": n / dt, "prompt_tokens": n, "seconds": dt,
                                  "page_faults": med([f for f, _ in seen[k]]), "system_s": med([s for _, s in seen[k]]),
                                  "runs": seen[k]}
                              for k, (n, dt) in r.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: build the engine benchmark's with make-model)")
    ap.add_argument("--smoke", action="store_true", help="tiny model and sizes (CI)")
    ap.add_argument("--reps", type=int, default=5, help="runs per side and case (median)")
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()
    model = engine_model("smoke" if args.smoke else "bench", args.model)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    cases = [(2, 40)] if args.smoke else [(4, 1024), (64, 128)]
    reps = 1 if args.smoke else args.reps
    servers: dict = {}
    try:
        for side, env in SIDES.items():
            servers[side] = ServerProcess(model, "--max-model-len", "2048", env=env)
        results = {"model": model, "sides": SIDES, "cases": bench(servers, Path(model).name, cases, vocab, reps)}
    finally:
        for srv in servers.values():
            srv.stop()
    print(f"{'case':>9} {'side':>15} {'tok/s':>8} {'tokens':>7} {'faults/run':>11} {'system s/run':>13}")
    for case, sides in results["cases"].items():
        for side, r in sides.items():
            print(f"{case:>9} {side:>15} {r['tok_s']:8.0f} {r['prompt_tokens']:7d} {r['page_faults']:11d} "
                  f"{r['system_s']:13.2f}")
        ratio = sides["settled"]["tok_s"] / sides["glibc_defaults"]["tok_s"]
        print(f"{case:>9} settled / glibc defaults: {ratio:.2f}x")
        sides["ratio"] = ratio
    write_json(args.json, results)


if __name__ == "__main__":
    main()
