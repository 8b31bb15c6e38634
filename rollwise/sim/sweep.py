"""The WAR sweep: for each load (prompts per step), one synchronous RL step under every
configuration, with the same trajectories; speedups are makespan ratios against `baseline` in the
same sweep. Writes `{"loads": {P: {CONFIG: {...}}}}`, a markdown table and a PNG of speedup vs load
with the crossover between the two regimes (where scheduling starts to pay more than speculation)."""
from __future__ import annotations

import dataclasses
import json
import multiprocessing
import time
from multiprocessing.connection import wait
from pathlib import Path

from rollwise.serve.process import exit_reason
from rollwise.sim.run import SimConfig, simulate
from rollwise.sim.workload import mooncake_step, task_pool, tau_groups, war_step


def workload(cfg: SimConfig, load: int, pool=None) -> list:
    if cfg.workload == "mooncake":
        if not cfg.trace:
            raise ValueError("workload 'mooncake' needs trace = PATH (e.g. ../shared/data/mooncake-traces/conversation_trace.jsonl)")
        return mooncake_step(cfg.trace, limit=cfg.trace_limit, time_scale=1.0 / load)
    return war_step(pool if pool is not None else task_pool(tau_groups()), load, cfg.group_size, seed=cfg.seed,
                    context=cfg.context, turns=cfg.turns, obs_median=cfg.obs_median, latency=cfg.tool_latency,
                    tool_scale=cfg.tool_scale)


def isolated(fn, *args, **kwargs):
    """fn(*args, **kwargs) in a forked child process (which inherits the arguments, unpickled), its
    result sent back. What a simulation leaves allocated (the allocator keeps freed suffix-tree and
    token-list memory) goes with the child, so a sweep's peak is its largest run, not their sum."""
    return _collect(_spawn(fn, *args, **kwargs))


def _spawn(fn, *args, **kwargs):
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)

    def child() -> None:
        try:
            send.send((True, fn(*args, **kwargs)))
        except BaseException as e:  # noqa: BLE001 - handed to the parent, which raises it
            send.send((False, e))

    proc = ctx.Process(target=child, daemon=True)
    proc.start()
    send.close()  # (so a child that dies leaves the pipe at EOF)
    return proc, recv


def _collect(handle):
    proc, recv = handle
    try:
        ok, value = recv.recv()
    except EOFError:
        proc.join()
        raise RuntimeError(f"the simulation's process died ({exit_reason(proc.exitcode)})") from None
    finally:
        recv.close()
    proc.join()
    if not ok:
        raise value
    return value


def sweep(cfg: SimConfig, log=print, progress: bool = True, jobs: int = 1) -> dict:
    """jobs: simulations run at once, each in its own process (results are the same: simulated time);
    their progress bars are shown only when one runs at a time."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    pool = task_pool(tau_groups()) if cfg.workload == "war" else None
    out = {"profile": cfg.profile, "config": dataclasses.asdict(cfg), "loads": {}, "tool_bound_s": {}}
    for load in cfg.loads:
        step = workload(cfg, load, pool)
        log(f"load {load}: {len(step)} trajectories, {sum(len(t.turns) for t in step)} turns, "
            f"{sum(t.decode_tokens for t in step)} tokens to generate")
        # no configuration beats the slowest trajectory's tool time (its turns wait for the tools)
        out["tool_bound_s"][str(load)] = max((sum(t.tool_latency) for t in step), default=0.0)
        names, done, running = list(cfg.configs), {}, {}
        todo, logged = list(names), 0

        def launch() -> None:
            name = todo.pop(0)
            running[name] = time.perf_counter(), _spawn(simulate, cfg, name, step, progress=progress and jobs == 1)
        while todo and len(running) < jobs:
            launch()
        while running:  # whichever ends first makes room for the next; logged in configuration order
            ready = wait([h[1] for _, h in running.values()])
            for name in [n for n, (_, h) in running.items() if h[1] in ready]:
                t0, handle = running.pop(name)
                done[name] = _collect(handle), time.perf_counter() - t0
                if todo:
                    launch()
            while logged < len(names) and names[logged] in done:
                name = names[logged]
                logged += 1
                log(_line(name, *done[name], done.get("baseline", done[name])[0]))
        out["loads"][str(load)] = {name: done[name][0] for name in names}
    return out


def _line(name: str, r: dict, wall_s: float, base: dict) -> str:
    last = r["last"]
    crit = f"  last {last['trajectory_id']}: tools {last['tool_s']:.0f} s + generation {last['generate_s']:.0f} s" \
        if last else ""
    return (f"  {name:<11}{r['makespan_s']:>10.1f} s  x{base['makespan_s'] / r['makespan_s']:.2f}"
            f"  prefill {int(r['prefill_tokens']):>11,}  decode {int(r['generated_tokens']):>9,}"
            f"  accepted/verify {r['accepted_per_verification']:.2f}  truncated {r['truncated']}{crit}  ({wall_s:.0f}s)")


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
    lines = [f"| {label} | " + " | ".join(names) + " | work (turns / decode tok) | slowest trajectory's tool time "
             f"| {names[-1]}'s last trajectory: tools + generation |", "|---" * (len(names) + 4) + "|"]
    for load, row in result["loads"].items():
        cells = [f"{row[n]['makespan_s']:.0f} s (x{sp[n][int(load)]:.2f})" if n in sp else f"{row[n]['makespan_s']:.0f} s"
                 for n in names]
        r0 = row[names[0]]
        bound = result.get("tool_bound_s", {}).get(load)
        lines.append(f"| {load} | " + " | ".join(cells) + f" | {r0['turns']} / {int(r0['generated_tokens']):,} | "
                     + (f"{bound:.0f} s |" if bound is not None else "|") + _critical(row[names[-1]]))
    return "\n".join(lines)


def _critical(r: dict) -> str:
    last = r.get("last")  # (results written before the critical path was recorded have none)
    return f" {last['tool_s']:.0f} + {last['generate_s']:.0f} s |" if last else " |"


def plot(result: dict, path: str | Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sp = speedups(result)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, pts in sp.items():
        xs = sorted(pts)
        ax.plot(xs, [pts[x] for x in xs], marker="o", label=name, lw=2.5 if name == "rollwise" else 1.5)
    top = max(v for pts in sp.values() for v in pts.values()) * 1.12
    bound = {int(p): row["baseline"]["makespan_s"] / result["tool_bound_s"][p] for p, row in result["loads"].items()
             if "baseline" in row and result.get("tool_bound_s", {}).get(p)}
    if bound:  # no configuration can beat the slowest trajectory's own tool time
        xs = sorted(bound)
        ax.plot(xs, [bound[x] for x in xs], color="black", ls="--", lw=1, label="bound: slowest trajectory's tool time")
        ax.set_ylim(top=top)
        ax.axhline(1.8, color="black", lw=0.8, ls="-.", label="1.8x target")
    x = crossover(sp)
    if x is not None:
        ax.axvline(x, color="grey", ls=":", lw=1)
        ax.annotate("scheduling > speculation", (x, ax.get_ylim()[0]), xytext=(4, 6), textcoords="offset points",
                    fontsize=8, color="grey")
    _load_axis(ax, result)
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


def _load_axis(ax, result: dict) -> None:
    """The x axis of a sweep's plot: its loads, log 2."""
    ax.set_xscale("log", base=2)
    loads = sorted(int(p) for p in result["loads"])
    ax.set_xticks(loads, [str(p) for p in loads])
    ax.set_xlabel(f"prompts per step (x {result['config']['group_size']} rollouts)" if result["config"]["workload"] == "war"
                  else "trace speed-up (arrival times divided by)")


def tool_sweep(cfg: SimConfig, scales: list[float], log=print, progress: bool = True, jobs: int = 1) -> dict:
    """The same sweep with every tool latency scaled (0: instant tools): how far the step is from
    tool-bound decides what generation speed-ups can give. Same tokens and turns at every scale."""
    out = {"profile": cfg.profile, "scales": {}}
    for s in scales:
        log(f"tool latency x{s:g} ({cfg.tool_latency[0] * s:g}-{cfg.tool_latency[1] * s:g} s log-uniform)")
        out["scales"][f"{s:g}"] = sweep(dataclasses.replace(cfg, tool_scale=s), log, progress, jobs)
    return out


def _bound(res: dict, load: str) -> float | None:
    """The best speedup any configuration can reach: baseline makespan / slowest trajectory's tool time."""
    t = res.get("tool_bound_s", {}).get(load)
    base = res["loads"][load].get("baseline")
    return base["makespan_s"] / t if t and base else None


def tool_table(out: dict, names: tuple[str, ...] = ("war", "rollwise")) -> str:
    first = next(iter(out["scales"].values()))
    loads = list(first["loads"])
    lines = ["| tool latency | " + " | ".join(f"P = {p}: {' / '.join(names)} (bound)" for p in loads) + " |",
             "|---" * (len(loads) + 1) + "|"]
    for s, res in out["scales"].items():
        sp = speedups(res)
        lo, hi = res["config"]["tool_latency"]
        cells = []
        for p in loads:
            b = _bound(res, p)
            cells.append(" / ".join(f"{sp[n][int(p)]:.2f}x" for n in names)
                         + (f" ({b:.2f}x)" if b else " (no bound)"))
        lines.append(f"| x{s} ({lo * float(s):g}-{hi * float(s):g} s) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tool_plot(out: dict, path: str | Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2))
    top = 1.0
    for i, (s, res) in enumerate(out["scales"].items()):
        sp, c = speedups(res), f"C{i}"
        xs = sorted(sp["rollwise"])
        ax.plot(xs, [sp["rollwise"][x] for x in xs], marker="o", color=c, lw=2, label=f"rollwise, tools x{s}")
        if "war" in sp:
            ax.plot(xs, [sp["war"][x] for x in xs], ls="--", color=c, lw=1, label=f"war, tools x{s}")
        top = max(top, *(v for pts in sp.values() for v in pts.values()))
        bounds = [_bound(res, str(x)) for x in xs]
        if all(bounds):
            ax.plot(xs, bounds, ls=":", color=c, lw=1)
    ax.axhline(1.8, color="black", lw=0.8, ls="-.")
    ax.set_ylim(0.9, top * 1.25)  # bounds far above every configuration run off the top
    _load_axis(ax, next(iter(out["scales"].values())))
    ax.set_ylabel("speedup vs baseline (makespan)")
    ax.set_title(f"Tool latency scaled ({out['profile']}); dotted: tool-time bound, dash-dot: 1.8x", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
