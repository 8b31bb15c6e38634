"""The WAR sweep: for each load (prompts per step), one synchronous RL step under every
configuration, with the same trajectories; speedups are makespan ratios against `baseline` in the
same sweep. Writes `{"loads": {P: {CONFIG: {...}}}}`, a markdown table and a PNG of speedup vs load
with the crossover between the two regimes (where scheduling starts to pay more than speculation)."""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from rollwise.sim.run import SimConfig, simulate
from rollwise.sim.workload import mooncake_step, task_pool, tau_groups, war_step


def workload(cfg: SimConfig, load: int, pool=None) -> list:
    if cfg.workload == "mooncake":
        if not cfg.trace:
            raise ValueError("workload 'mooncake' needs trace = PATH (e.g. ../shared/data/mooncake-traces/conversation_trace.jsonl)")
        return mooncake_step(cfg.trace, limit=cfg.trace_limit, time_scale=1.0 / load)
    return war_step(pool if pool is not None else task_pool(tau_groups()), load, cfg.group_size, seed=cfg.seed,
                    context=cfg.context, turns=cfg.turns, obs_median=cfg.obs_median, latency=cfg.tool_latency)


def sweep(cfg: SimConfig, log=print, progress: bool = True) -> dict:
    pool = task_pool(tau_groups()) if cfg.workload == "war" else None
    out = {"profile": cfg.profile, "config": dataclasses.asdict(cfg), "loads": {}, "tool_bound_s": {}}
    for load in cfg.loads:
        step = workload(cfg, load, pool)
        log(f"load {load}: {len(step)} trajectories, {sum(len(t.turns) for t in step)} turns, "
            f"{sum(t.decode_tokens for t in step)} tokens to generate")
        # no configuration beats the slowest trajectory's tool time (its turns wait for the tools)
        out["tool_bound_s"][str(load)] = max((sum(t.tool_latency) for t in step), default=0.0)
        row = {}
        for name in cfg.configs:
            t0 = time.perf_counter()
            r = simulate(cfg, name, step, progress=progress)
            row[name] = r
            base = row.get("baseline", r)["makespan_s"]
            log(f"  {name:<11}{r['makespan_s']:>10.1f} s  x{base / r['makespan_s']:.2f}  prefill {int(r['prefill_tokens']):>11,}"
                f"  decode {int(r['generated_tokens']):>9,}  accepted/verify {r['accepted_per_verification']:.2f}"
                f"  truncated {r['truncated']}  ({time.perf_counter() - t0:.0f}s)")
        out["loads"][str(load)] = row
    return out


def speedups(result: dict) -> dict[str, dict[int, float]]:
    sp: dict[str, dict[int, float]] = {}
    for load, row in result["loads"].items():
        base = row.get("baseline")
        for name, r in row.items():
            if base is not None:
                sp.setdefault(name, {})[int(load)] = base["makespan_s"] / r["makespan_s"]
    return sp


def crossover(sp: dict[str, dict[int, float]]) -> int | None:
    """The first load at which scheduling alone beats speculation alone."""
    if "spec_only" not in sp or "sched_only" not in sp:
        return None
    return next((p for p in sorted(sp["spec_only"]) if sp["sched_only"][p] > sp["spec_only"][p]), None)


def table(result: dict) -> str:
    sp = speedups(result)
    names = list(next(iter(result["loads"].values())))
    cfg = result["config"]
    label = f"prompts x {cfg['group_size']}" if cfg["workload"] == "war" else "trace speed-up"
    lines = [f"| {label} | " + " | ".join(names) + " | work (turns / decode tok) | slowest trajectory's tool time |",
             "|---" * (len(names) + 3) + "|"]
    for load, row in result["loads"].items():
        cells = [f"{row[n]['makespan_s']:.0f} s (x{sp[n][int(load)]:.2f})" if n in sp else f"{row[n]['makespan_s']:.0f} s"
                 for n in names]
        r0 = row[names[0]]
        bound = result.get("tool_bound_s", {}).get(load)
        lines.append(f"| {load} | " + " | ".join(cells) + f" | {r0['turns']} / {int(r0['generated_tokens']):,} | "
                     + (f"{bound:.0f} s |" if bound is not None else "|"))
    return "\n".join(lines)


def plot(result: dict, path: str | Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sp = speedups(result)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, pts in sp.items():
        xs = sorted(pts)
        ax.plot(xs, [pts[x] for x in xs], marker="o", label=name, lw=2.5 if name == "rollwise" else 1.5)
    x = crossover(sp)
    if x is not None:
        ax.axvline(x, color="grey", ls=":", lw=1)
        ax.annotate("scheduling > speculation", (x, ax.get_ylim()[0]), xytext=(4, 6), textcoords="offset points",
                    fontsize=8, color="grey")
    ax.set_xscale("log", base=2)
    loads = sorted(int(p) for p in result["loads"])
    ax.set_xticks(loads, [str(p) for p in loads])
    ax.set_xlabel(f"prompts per step (x {result['config']['group_size']} rollouts)" if result["config"]["workload"] == "war"
                  else "trace speed-up (arrival times divided by)")
    ax.set_ylabel("speedup of the step vs baseline (makespan)")
    ax.set_title(f"Simulated synchronous RL step: {result['profile']}, {result['config']['replicas']} replicas", fontsize=10)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(result: dict, json_path: str | None = None, plot_path: str | None = None) -> None:
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=1))
    if plot_path:
        Path(plot_path).parent.mkdir(parents=True, exist_ok=True)
        plot(result, plot_path)
