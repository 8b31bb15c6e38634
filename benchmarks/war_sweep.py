"""WAR's two regimes on modeled GPUs, driven by the real router policies and speculation controllers
(`rollwise.sim`): one synchronous RL step at each load (P prompts x 8 rollouts of SWE-like episodes
with real agent text) under baseline (verl router, no speculation), spec_only, sched_only, war and
rollwise; speedup = makespan ratio against baseline in the same sweep, with the work done alongside.

    python benchmarks/war_sweep.py [--quick | --smoke] [--profile h100-qwen3-32b-tp4] [--json PATH] [--plot PATH]
    python benchmarks/war_sweep.py --validate [--measured results/router_swe.json] [--measured-tau results/router.json] [--kv-frac 0.4]
    python benchmarks/war_sweep.py --scale [--repeats 3]   # 64 replicas, 10,000 trajectories: simulator speed
    python benchmarks/war_sweep.py --tool-scales 1,0.3,0.1,0 [--loads 4,8,16,32]   # tool latency x s

--validate runs the simulator on the CPU cost profile fitted from our engine (`rollwise.sim.fit`) with
the router benchmark's exact workloads and settings, and compares per policy its makespan and
prefill tokens with what `benchmarks/router.py` measured on 2 real replicas, and its acceptance with
the real engine's (router.py's speculating replicas on replayed tau-bench trajectories).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rollwise.omp import passive_unless_chosen
passive_unless_chosen()  # before torch loads

from rollwise.router.workload import replayed_step, swe_step  # noqa: E402
from rollwise.sim import sweep  # noqa: E402
from rollwise.sim.run import SimConfig, simulate  # noqa: E402
from rollwise.sim.workload import from_replay, synthetic_scale  # noqa: E402

from router import kv_budget  # noqa: E402  (benchmarks/router.py: its KV budget per replica)


def validate(measured: str, measured_tau: str | None, kv_frac: float = 0.4, profile: str = "cpu-fitted") -> dict:
    out: dict = {"profile": profile, "makespan": {}, "acceptance": {}}
    cpu = dict(profile=profile, replicas=2, max_num_seqs=32, max_num_batched_tokens=1024, max_inflight_per_replica=32,
               sandbox_ttl_s=0.0)
    m = json.loads(Path(measured).read_text())
    step = swe_step(8, 8, vocab=8000, seed=0, turns=(2, 10))  # router.py --workload swe (full)
    cfg = SimConfig(kv_blocks=kv_budget(step, kv_frac)[1], **cpu)
    print(f"{'policy':<20}{'sim s':>8}{'real s':>8}{'error':>8}{'sim prefill':>13}{'real prefill':>13}")
    for p, real in m["policies"].items():
        r = simulate(cfg, p, from_replay(step), policy=p, spec="off")
        err = r["makespan_s"] / real["makespan_s"] - 1
        out["makespan"][p] = {"sim_s": r["makespan_s"], "real_s": real["makespan_s"], "error": err,
                              "sim_prefill": r["prefill_tokens"], "real_prefill": real["prefill_tokens"]}
        print(f"{p:<20}{r['makespan_s']:>8.2f}{real['makespan_s']:>8.2f}{err:>+8.1%}{int(r['prefill_tokens']):>13}"
              f"{int(real['prefill_tokens']):>13}")
    if measured_tau:  # router.py --workload tau (full): speculating replicas, least_load, shared drafts off / on
        from common import cached_model  # noqa: E402  (benchmarks/common.py)
        from rollwise.spec.bench import load_groups
        model = cached_model("router-bench-model", family="llama", layers=2, hidden=128, heads=4, kv_heads=2,
                             vocab=8192, seed=0, max_positions=8192)
        groups = load_groups(None, model, group_size=4, limit=40, system_chars=1500)
        tau = replayed_step(groups[:10], max_turns=6, max_response=64, latency=(0.05, 0.5))
        t = json.loads(Path(measured_tau).read_text())["shared_drafts"]
        cfg = SimConfig(kv_blocks=kv_budget(tau)[1], spec_max_tokens=16, **cpu)
        for share in ("off", "on"):
            r = simulate(cfg, "x", from_replay(tau), policy="least_load", spec="always", share_drafts=share == "on")
            real = t[share]["accepted_per_draft"]
            out["acceptance"][share] = {"sim": r["accepted_per_verification"], "real": real,
                                        "error": r["accepted_per_verification"] / real - 1}
            print(f"acceptance (tokens accepted per verification), shared drafts {share}: sim "
                  f"{r['accepted_per_verification']:.2f}, engine {real:.2f} ({r['accepted_per_verification'] / real - 1:+.1%})")
    return out


def _timed(cfg: SimConfig) -> dict:
    step = synthetic_scale(10_000, seed=0)  # built in the run's own process (none of it copied on write)
    t0 = time.perf_counter()
    r = simulate(cfg, "baseline", step)
    return {**r, "wall_s": time.perf_counter() - t0, "trajectories": len(step)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="loads 4, 16, 64 with shorter episodes")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--profile", help="default: h100-qwen3-32b-tp4 (sweep), cpu-fitted (--validate)")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    ap.add_argument("--validate", action="store_true")
    ap.add_argument("--measured", default="results/router_swe.json")
    ap.add_argument("--measured-tau", default="results/router.json")
    ap.add_argument("--kv-frac", type=float, default=0.4, help="the --kv-frac router.py measured --measured with")
    ap.add_argument("--scale", action="store_true")
    ap.add_argument("--repeats", type=int, default=1, help="--scale: runs (the median is reported)")
    ap.add_argument("--tool-scales", help="comma-separated factors on every tool latency (0: instant tools); "
                    "baseline, war and rollwise at each")
    ap.add_argument("--loads", help="comma-separated prompts per step (default: the sweep's; 4,8,16,32 with --tool-scales)")
    ap.add_argument("--jobs", type=int, default=1, help="simulations run at once, each in its own process (same results)")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    gpu_profile = args.profile or "h100-qwen3-32b-tp4"
    if args.validate:
        res = validate(args.measured, args.measured_tau if Path(args.measured_tau).exists() else None, args.kv_frac,
                       args.profile or "cpu-fitted")
    elif args.scale:
        cfg = SimConfig(profile=gpu_profile, replicas=64, max_num_seqs=256, max_inflight_per_replica=256)
        walls = []
        for _ in range(args.repeats):  # each in a fresh process: this machine's speed drifts between runs
            r = sweep.isolated(_timed, cfg)
            walls.append(r["wall_s"])
            print(f"64 replicas, {r['trajectories']} trajectories, {r['turns']} turns, {int(r['generated_tokens']):,} tokens: "
                  f"simulated makespan {r['makespan_s']:.0f} s in {r['wall_s']:.1f} s of wall time "
                  f"(routing decision {r['decision_us']:.0f} µs)", flush=True)
        walls.sort()
        res = {"replicas": 64, **r, "wall_s": walls[len(walls) // 2], "walls_s": walls}
        if args.repeats > 1:
            print(f"wall time over {len(walls)} runs: median {res['wall_s']:.1f} s, {walls[0]:.1f}-{walls[-1]:.1f} s")
    else:
        kw = dict(profile=gpu_profile)
        if args.smoke:
            kw.update(loads=(2,), turns=(2, 4), context=(256, 512), obs_median=64)
        elif args.quick:
            kw.update(loads=(4, 16, 64), turns=(5, 25))
        elif args.tool_scales:
            kw.update(loads=(4, 8, 16, 32))
        if args.loads:
            kw.update(loads=tuple(int(x) for x in args.loads.split(",")))
        if args.tool_scales:  # the same steps with every tool latency scaled: how tool-bound is the step?
            cfg = SimConfig(**kw, configs=("baseline", "war", "rollwise"))
            res = sweep.tool_sweep(cfg, [float(x) for x in args.tool_scales.split(",")], jobs=args.jobs)
            print(sweep.tool_table(res))
            if args.plot:
                sweep.tool_plot(res, args.plot)
        else:
            res = sweep.sweep(SimConfig(**kw), jobs=args.jobs)
            print(sweep.table(res))
            sp = sweep.speedups(res)
            print(f"crossover (scheduling beats speculation) at P = {sweep.crossover(sp)}")
            if args.plot:
                sweep.plot(res, args.plot)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
