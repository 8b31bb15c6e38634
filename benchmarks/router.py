"""One synchronous agentic-RL step on 2 real replicas (one core each) under every routing policy,
in one run: makespan, throughput, prefill tokens computed, prefix-cache hit rate, replica busy
time, p99 turn latency, and the work done (turns, decode tokens: equal across policies).

    python benchmarks/router.py [--quick | --smoke] [--workload tau|swe] [--json PATH] [--policies a,b]

Workloads: `tau` replays real tau-bench trajectories (trials of a task are GRPO siblings; every
task shares the airline policy prompt); `swe` is SWE-like (8 prompts x 8 rollouts, a long task
context per prompt shared by its siblings, 2-10 turns set by the task, long tool outputs). Tool
latency 50-500 ms between turns. Each replica's KV budget is `--kv-frac` (default 40%) of the live
working set (distinct blocks of all final contexts), so the two replicas hold 80% of it (at 0.2,
40%: most contexts cannot stay through their tool calls) and placement decides what is recomputed;
the work done is read from the replicas' own counters and must match across runs. A control
workload with no shared prefixes checks that locality policies do not lose to least_load there.
Also measures the routing decision cost at 64 replicas and 10,000 live trajectories.

    python benchmarks/router.py --workload swe --kv-frac 0.2 --repeats 3   # high load (README)

`--trace DIR` records every replica step under DIR/<policy>/ (what the simulator's CPU profile is
fitted on: `python -m rollwise.sim.fit MODEL --trace DIR/verl ...`).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import time
from pathlib import Path

from rollwise.omp import passive_unless_chosen
passive_unless_chosen()  # before torch loads

from rollwise.router.policies import POLICIES  # noqa: E402
from rollwise.router.prefix_index import PrefixIndex  # noqa: E402
from rollwise.router.replica import HttpReplica, LoadSnapshot  # noqa: E402
from rollwise.router.router import Router  # noqa: E402
from rollwise.router.workload import replayed_step, run_step, swe_step, synthetic_step  # noqa: E402
from rollwise.serve.process import ServerProcess  # noqa: E402
from rollwise.spec.bench import load_groups  # noqa: E402
from rollwise.types import GenerateRequest, SamplingParams  # noqa: E402

from common import cached_model, sglang_router_command, write_json  # noqa: E402  (benchmarks/common.py)

COUNTERS = {"rollwise:prefill_tokens_computed_total": "prefill_tokens", "vllm:prefix_cache_queries_total": "queries",
            "vllm:prefix_cache_hits_total": "hits", "rollwise:engine_step_seconds_total": "busy_s",
            "vllm:num_preemptions_total": "preemptions", "vllm:spec_decode_num_drafts_total": "drafts",
            "vllm:spec_decode_num_accepted_tokens_total": "accepted", "rollwise:engine_steps_total": "steps",
            "vllm:generation_tokens_total": "generated"}


def scrape(url: str) -> dict[str, float]:
    import httpx
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, v = line.rpartition(" ")
            key = COUNTERS.get(name.split("{")[0])
            if key:
                out[key] = float(v)
    return out


def drive(router: Router, step, servers) -> dict:
    """Run the step through the router, then read the work each replica did from its counters."""
    async def go():
        try:
            return await run_step(router, step)
        finally:
            await router.close()
    res = asyncio.run(go())
    m = [scrape(s.url) for s in servers]
    busy = [x["busy_s"] for x in m]
    q = sum(x["queries"] for x in m)
    return {**res, "prefill_tokens": sum(x["prefill_tokens"] for x in m), "hit_rate": sum(x["hits"] for x in m) / max(q, 1),
            "max_busy_s": max(busy), "mean_busy_s": sum(busy) / len(busy), "preemptions": sum(x["preemptions"] for x in m),
            "tok_s": res["decode_tokens"] / res["makespan_s"], "steps": sum(x["steps"] for x in m),
            "generated_tokens": int(sum(x["generated"] for x in m)),  # what the replicas say they generated
            "accepted_per_draft": sum(x.get("accepted", 0) for x in m) / max(sum(x.get("drafts", 0) for x in m), 1)}


@contextlib.contextmanager
def traced(args, label: str):
    """With --trace DIR, the replicas started inside record every engine step to DIR/label/
    (`$ROLLWISE_STEP_TRACE`: what `python -m rollwise.sim.fit --trace` fits the simulator's profile on)."""
    if not getattr(args, "trace", None):
        yield
        return
    d = Path(args.trace) / label
    d.mkdir(parents=True, exist_ok=True)
    os.environ["ROLLWISE_STEP_TRACE"] = str(d)
    try:
        yield
    finally:
        os.environ.pop("ROLLWISE_STEP_TRACE", None)


def run_policy(model: str, policy: str, step, args, speculative: bool = False, share: bool = True,
               label: str | None = None) -> dict:
    serve_args = ("--max-num-seqs", "32", "--num-kv-blocks", str(args.kv_blocks), "--max-model-len", "8192")
    if speculative:
        serve_args += ("--speculative", "suffix", "--spec-controller", "always")
    with traced(args, label or policy), ServerProcess(model, *serve_args, threads=1) as a, \
            ServerProcess(model, *serve_args, threads=1) as b:
        router = Router([HttpReplica(a.url), HttpReplica(b.url)], policy, max_inflight_per_replica=32,
                        share_drafts=share)
        res = drive(router, step, (a, b))
    return {**res, "failovers": router.metrics()["failovers"],
            "fitted_cost_s": dict(zip(("per_prefill_token", "per_decode_token", "per_step"), router.cost_model.fit()))}


def median_run(model: str, policy: str, step, args, label: str | None = None) -> dict:
    """`--repeats` runs on fresh replicas; the median run by makespan, with every run's figures."""
    runs = sorted((run_policy(model, policy, step, args, label=label) for _ in range(args.repeats)),
                  key=lambda r: r["makespan_s"])
    r = dict(runs[len(runs) // 2])
    r["makespan_runs_s"] = [x["makespan_s"] for x in runs]
    r["prefill_runs"] = [x["prefill_tokens"] for x in runs]
    return r


def run_sglang_router(model: str, step, args) -> dict | None:
    """sglang-router (Rust, cache_aware) in front of the same kind of replicas, if the peers venv has it."""
    import subprocess
    from rollwise.serve.process import free_port
    if sglang_router_command([], 0, model) is None:
        return None
    serve_args = ("--max-num-seqs", "32", "--num-kv-blocks", str(args.kv_blocks), "--max-model-len", "8192")
    with traced(args, "sglang-router"), ServerProcess(model, *serve_args, threads=1) as a, \
            ServerProcess(model, *serve_args, threads=1) as b:
        port = free_port()
        proc = subprocess.Popen(sglang_router_command([a.url, b.url], port, model), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=dict(os.environ, HF_HUB_OFFLINE="1"))
        try:
            front = HttpReplica(f"http://127.0.0.1:{port}")
            for _ in range(120):
                if asyncio.run(front.health()):
                    break
                time.sleep(0.5)
            router = Router([HttpReplica(f"http://127.0.0.1:{port}")], "round_robin", max_inflight_per_replica=64,
                            share_drafts=False)  # a pass-through: sglang-router places the requests

            return drive(router, step, (a, b))
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def kv_budget(step, fraction: float = 0.4) -> tuple[int, int]:
    """The live working set (distinct KV blocks of every trajectory's final context, shared
    prefixes once) and the KV blocks per replica: `fraction` of it (0.4: 2 replicas hold 80%)."""
    index = PrefixIndex(16)
    working = len({h for t in step for h in index.hashes(t.turns[-1][0] + t.turns[-1][1])})
    return working, max(int(working * fraction), 256)


class _Null:
    def __init__(self, name):
        self.name = name

    async def load(self):
        return LoadSnapshot()


def decision_cost(policy: str, replicas: int = 64, trajectories: int = 10_000, samples: int = 2000) -> float:
    """µs per routing decision with `trajectories` live (sticky entries and indexed prefixes)."""
    rng = random.Random(0)
    router = Router([_Null(f"r{i}") for i in range(replicas)], policy, max_inflight_per_replica=10**9)
    prompts = [[rng.randrange(50_000) for _ in range(256)] for _ in range(64)]
    for t in range(trajectories):
        name = f"r{t % replicas}"
        router.sticky[f"t{t}"] = name
        router.turns[f"t{t}"] = 1
        router.index.insert(name, router.index.hashes(prompts[t % 64] + [t] * 512))
    from rollwise.router.router import _Waiter
    from rollwise.router.policies import RouteInfo
    names = list(router.replicas)
    t0 = time.perf_counter()
    for i in range(samples):
        tid = f"t{rng.randrange(trajectories)}"
        req = GenerateRequest(prompt_token_ids=prompts[i % 64] + [i] * 512, params=SamplingParams(max_tokens=64),
                              trajectory_id=tid)
        info = RouteInfo(request=req, prompt_len=768, arrival=time.monotonic(), sticky=router.sticky.get(tid),
                         turns_done=1, expected_turns=None)
        w = _Waiter(info, router.index.hashes(req.prompt_token_ids), 0, None)
        name = router._choose(w, names)
        router._release(name, w.work)  # keep the load steady
    return 1e6 * (time.perf_counter() - t0) / samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="finishes in under 5 minutes")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--kv-blocks", type=int, default=None, help="KV blocks per replica (default: --kv-frac of the working set)")
    ap.add_argument("--kv-frac", type=float, default=0.4,
                    help="each replica's KV as a share of the live working set (0.4: the fleet holds 80%%; 0.2: 40%%)")
    ap.add_argument("--tasks", type=int, help="prompts per step (override)")
    ap.add_argument("--siblings", type=int, help="rollouts per prompt (override; at most 4 for tau)")
    ap.add_argument("--turns", type=int, help="turns per trajectory at most (override)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per policy (fresh replicas each); medians reported")
    ap.add_argument("--workload", choices=("tau", "swe"), default="tau",
                    help="tau: replayed tau-bench trajectories; swe: SWE-like groups with long shared task contexts")
    ap.add_argument("--json")
    ap.add_argument("--trace", help="record every replica step under DIR/<policy>/ (to fit the simulator: "
                                    "python -m rollwise.sim.fit MODEL --trace DIR/verl --trace ...)")
    args = ap.parse_args()
    model = cached_model("router-bench-model", family="llama", layers=2, hidden=128, heads=4, kv_heads=2,
                         vocab=8192, seed=0, max_positions=8192)
    if args.workload == "swe":  # P x n with n = 8 as in GRPO; turns 2..2*T
        n_tasks, n_sib, turns, resp = (2, 2, 2, 0) if args.smoke else (6, 4, 4, 0) if args.quick else (8, 8, 5, 0)
    else:
        n_tasks, n_sib, turns, resp = (2, 2, 2, 16) if args.smoke else (6, 4, 4, 48) if args.quick else (10, 4, 6, 64)
    n_tasks, n_sib, turns = args.tasks or n_tasks, args.siblings or n_sib, args.turns or turns
    # the airline policy (system prompt) is cut to 1500 characters to keep prefill affordable on one core;
    # every turn's prompt still extends the previous turn's, as in a real episode
    if args.workload == "swe":
        step = swe_step(n_tasks, n_sib, vocab=8000, seed=0, turns=(2, 2 * turns))
    else:
        groups = load_groups(None, model, group_size=n_sib, limit=n_tasks * 4, system_chars=1500)
        step = replayed_step(groups[:n_tasks], max_turns=turns, max_response=resp, latency=(0.05, 0.5))
    working, blocks = kv_budget(step, args.kv_frac)
    args.kv_blocks = args.kv_blocks or blocks
    print(f"{len(step)} trajectories ({n_tasks} prompts x {n_sib}), {sum(len(t.turns) for t in step)} turns; "
          f"live working set {working} distinct KV blocks, {args.kv_blocks} per replica")
    policies = [p for p in args.policies.split(",") if p]
    out: dict = {"policies": {}, "control": {}, "decision_us": {}, "shared_drafts": {}}
    hdr = f"{'policy':<20}{'makespan s':>11}{'tok/s':>8}{'prefill tok':>12}{'hit rate':>9}{'busy max/mean':>15}{'p99 turn s':>11}{'turns':>7}{'decode tok':>11}"
    print(hdr)
    for p in policies:
        r = out["policies"][p] = median_run(model, p, step, args)
        print(f"{p:<20}{r['makespan_s']:>11.2f}{r['tok_s']:>8.1f}{int(r['prefill_tokens']):>12}{r['hit_rate']:>9.2f}"
              f"{r['max_busy_s']:>8.1f}/{r['mean_busy_s']:<6.1f}{r['p99_turn_latency_s']:>11.2f}{r['turns']:>7}{r['decode_tokens']:>11}",
              flush=True)
    sgl = None if args.smoke else run_sglang_router(model, step, args)
    if sgl is not None:
        out["sglang_router_cache_aware"] = sgl
        print(f"{'sglang-router (peer)':<20}{sgl['makespan_s']:>11.2f}{sgl['tok_s']:>8.1f}{int(sgl['prefill_tokens']):>12}"
              f"{sgl['hit_rate']:>9.2f}{sgl['max_busy_s']:>8.1f}/{sgl['mean_busy_s']:<6.1f}{sgl['p99_turn_latency_s']:>11.2f}"
              f"{sgl['turns']:>7}{sgl['decode_tokens']:>11}")
    # the work each run did, as the replicas counted it (the peer forwards only SGLang's fields, so it
    # must still generate exactly the recorded lengths: max_new_tokens + ignore_eos)
    work = {(r["turns"], r["decode_tokens"], r["generated_tokens"]) for r in [*out["policies"].values(), *([sgl] if sgl else [])]}
    assert len(work) == 1, f"policies did different work: {work}"
    ref = out["policies"].get("verl")
    if ref and "rollwise" in out["policies"]:
        rw = out["policies"]["rollwise"]
        print(f"rollwise vs verl: makespan {ref['makespan_s'] / rw['makespan_s']:.2f}x, prefill tokens "
              f"{ref['prefill_tokens'] / max(rw['prefill_tokens'], 1):.2f}x fewer")
    if not args.smoke:
        control = synthetic_step(n_tasks, n_sib, vocab=8000, seed=1)
        for p in [x for x in ("least_load", "rollwise") if x in policies]:
            r = out["control"][p] = median_run(model, p, control, args, label=f"control-{p}")
            print(f"control (no shared prefixes) {p:<12} makespan {r['makespan_s']:.2f}s, prefill {int(r['prefill_tokens'])}"
                  f" (runs: {', '.join(f'{x:.2f}' for x in r['makespan_runs_s'])})")
    # shared drafting material: siblings spread by least_load, speculation on (not on the SWE step:
    # its tokens are random, so nothing drafted is ever accepted)
    if not args.smoke and args.workload != "swe":
        for share in (False, True):
            r = run_policy(model, "least_load", step, args, speculative=True, share=share,
                           label=f"speculating-shared-{'on' if share else 'off'}")
            out["shared_drafts"]["on" if share else "off"] = r
            print(f"speculating replicas, least_load, shared drafts {'on ' if share else 'off'}: accepted per draft "
                  f"{r['accepted_per_draft']:.2f}, {int(r['steps'])} engine steps, makespan {r['makespan_s']:.2f}s")
    for p in policies:
        out["decision_us"][p] = decision_cost(p, samples=200 if args.smoke else 2000)
    print("routing decision µs (64 replicas, 10,000 live trajectories): " +
          ", ".join(f"{p} {v:.0f}" for p, v in out["decision_us"].items()))
    write_json(args.json, out)


if __name__ == "__main__":
    main()
