"""Synchronous vs asynchronous RL in one run: the same environment, model, fleet and work per step
(B groups x n episodes), max_staleness 0 (synchronous, WAR's setting) vs 1 and 2, each with the
streamed trainer (it trains each group as it completes; the default), the synchronous run also
with the whole batch trained once complete (`sync_batch`: verl's and WAR's step), staleness 1 with
partial rollout (turns in flight at a weight update continue under the new weights instead of
finishing under the old ones), and the lockstep (reproducible, `deterministic=True`) pipeline at
staleness 1, which the demo runs.

    python benchmarks/pipeline.py [--quick | --smoke] [--advantage NAME] [--configs A,B] [--set KEY=VALUE]
                                  [--compare KEY=VALUE] [--repeats N] [--json PATH] [--plot PNG]

`--advantage` trains every configuration with that estimator (default grpo). With a whitened one
(gae, reinforce_plus_plus[_baseline]) two more run, `sync_after` and `async_k1_after`, whose first
pass waits for the batch's last group (`stream_whitened = false`), beside `sync` and `async_k1`, which
run each group's pass as it arrives and whiten its gradients at the end. `--configs`: run only these;
`--set`: a TrainConfig key for every configuration (e.g. replicas=1, replica_threads=1,
trainer_threads=1: the replica and the trainer each on a core of their own). `--compare KEY=VALUE`:
each configuration also with that key (named `CONFIG+KEY=VALUE`, run beside it: e.g.
`trainer_apart=true`, the trainer in a process of its own). `--repeats N`: the
configurations N times, interleaved (A B A B ...), each figure the median run's (by seconds per
step; of an even N, the faster middle one), with every run's seconds per step (`runs_step_s`).

Environment: phonebook (the demo's) with tool latency 50-500 ms, log-normal (heavy tail, capped at
2 s). Every configuration starts GRPO from the demo's SFT warm start (cached; built on first use,
about 4.5 minutes), so rewards vary within groups and the trainer really trains (an untrained
model earns reward 0 everywhere, and GRPO then has nothing to learn and no work to do). Reports
per configuration: wall seconds per training step (after the first), trajectories/s, the
trainer's own seconds per step, trainer idle fraction (waiting for rollouts), rollout idle
fraction (no episode in flight), generated tokens, trajectories trained on, mean reward, the
staleness actually seen, and the bound AReaL's admission rule puts on each asynchronous
configuration: batch T must hold the groups admitted k versions earlier, so a step lasts at least
(D + t) / (k + 1) for the synchronous run's rollout time D and the configuration's own training
step t (2x over `sync_batch` at k = 1 only if running both at once slowed neither), a bound for a
trainer that takes the batch whole: the streamed one hides all but its last group and the optimizer
step behind the rollouts.
"""
from __future__ import annotations

import argparse
import tempfile
import time

from rollwise.omp import passive_unless_chosen
passive_unless_chosen()  # before torch loads

from rollwise.cli import DEMO_FULL, DEMO_SFT, DEMO_SFT_CACHE, _overrides, demo_model  # noqa: E402
from rollwise.rl import TrainConfig, train  # noqa: E402
from rollwise.trainer.advantages import ADVANTAGES, WHITENED  # noqa: E402
from common import write_json  # noqa: E402  (benchmarks/common.py)


def run(k: int, args, deterministic: bool = False, partial: bool = False, stream: bool = True,
        early: bool = True, more: tuple[str, ...] = ()) -> dict:
    with tempfile.TemporaryDirectory(prefix="rollwise-pipeline-") as tmp:
        cfg = TrainConfig.from_dict({**dict(
            model=demo_model(), run_dir=tmp, env="phonebook", sft_cache=DEMO_SFT_CACHE, **args.sft, steps=args.steps,
            groups_per_step=args.groups, group_size=args.group_size, lr=DEMO_FULL["lr"], max_staleness=k,
            deterministic=deterministic, partial_rollout=partial, stream_trainer=stream, tool_latency=(0.05, 0.5),
            tool_latency_kind="lognormal", advantage=args.advantage, stream_whitened=early,
            eval_tasks=args.eval_tasks, max_concurrent_groups=args.groups * 3, progress=False, seed=0),
            **_overrides(args.set + list(more))})
        t0 = time.perf_counter()
        rep = train(cfg)
        total = time.perf_counter() - t0
    steps = rep["steps"]
    wall = steps[-1]["wall_s"] - steps[0]["wall_s"]  # from the end of step 0 (warm) to the end
    n = len(steps) - 1
    trajs = sum(s["trajectories"] for s in steps[1:])
    return {"max_staleness": k, "partial_rollout": partial, "stream_trainer": stream, "step_s": wall / n,
            "trajectories_per_s": trajs / wall,
            "trainer_idle_frac": sum(s["wait_s"] for s in steps[1:]) / wall,
            "rollout_idle_frac": rep["queue"]["rollout_idle_s"] / steps[-1]["wall_s"],
            "generated_tokens": steps[-1].get("generated_tokens", 0.0), "trajectories": trajs,
            "trajectories_per_step": steps[-1]["trajectories"], "max_staleness_seen": rep["queue"]["max_staleness_seen"],
            "stale_trajectories": rep["queue"]["stale_trajectories"], "reward_last": steps[-1]["reward"],
            "reward_mean": sum(s["reward"] for s in steps) / len(steps),
            "train_s_per_step": sum(s["train_s"] for s in steps[1:]) / n,  # the trainer's own work
            "tail_s_per_step": sum(s["tail_s"] for s in steps[1:]) / n,  # training after the last group
            "sync_s_per_step": sum(s["sync_s"] for s in steps[1:]) / n,  # new weights to both replicas
            "trained_trajectories": sum(s["trained_trajectories"] for s in steps[1:]), "total_s": total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--advantage", default="grpo", choices=ADVANTAGES)
    ap.add_argument("--configs", help="comma-separated: run only these configurations")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a TrainConfig key for every configuration")
    ap.add_argument("--compare", action="append", default=[], metavar="KEY=VALUE",
                    help="each configuration also with this TrainConfig key (CONFIG+KEY=VALUE)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json")
    ap.add_argument("--plot", help="PNG: seconds per step of each configuration, split into the trainer's waiting "
                    "and the rest")
    args = ap.parse_args()
    args.steps, args.groups, args.group_size = (3, 2, 2) if args.smoke else (6, 4, 8) if args.quick else (24, 8, 8)
    args.sft = dict(sft_steps=5, sft_tasks=8) if args.smoke else {k: DEMO_FULL[k] for k in DEMO_SFT}
    args.eval_tasks = 0 if args.smoke else 16  # (no figure here reads them: the smoke skips them)
    print(f"{args.steps} steps ({args.advantage}) of {args.groups} groups x {args.group_size} episodes; phonebook, "
          "tool latency 50-500 ms log-normal")
    out = {"advantage": args.advantage, "set": args.set, "configs": {}}
    configs = [("sync_batch", 0, False, False, False, True), ("sync", 0, False, False, True, True),
               ("async_k1", 1, False, False, True, True), ("async_k1_partial", 1, False, True, True, True),
               ("async_k2", 2, False, False, True, True), ("lockstep_k1", 1, True, False, True, True)]
    if args.advantage in WHITENED:
        configs[2:2] = [("sync_after", 0, False, False, True, False)]
        configs[4:4] = [("async_k1_after", 1, False, False, True, False)]
    if args.configs:
        configs = [c for c in configs if c[0] in args.configs.split(",")]
    configs = [(*c, ()) for c in configs]
    if args.compare:  # each beside its twin
        configs = [x for c in configs for x in (c, (f"{c[0]}+{'+'.join(args.compare)}", *c[1:-1], tuple(args.compare)))]
    w = max(17, *(len(c[0]) + 1 for c in configs))  # the names' column
    print(f"{'config':<{w}}{'s/step':>8}{'traj/s':>8}{'train s':>8}{'tail s':>7}{'sync s':>7}{'trainer idle':>13}"
          f"{'rollout idle':>13}"
          f"{'gen tokens':>11}{'trained':>8}{'reward':>7}{'stale':>6}")
    runs: dict[str, list[dict]] = {}
    for rep in range(args.repeats):
        for name, k, det, partial, stream, early, more in configs:
            runs.setdefault(name, []).append(run(k, args, det, partial, stream, early, more))
            if args.repeats > 1:
                print(f"  {name}, run {rep + 1} of {args.repeats}: {runs[name][-1]['step_s']:.2f} s/step", flush=True)
    for name, *_ in configs:
        r = dict(sorted(runs[name], key=lambda x: x["step_s"])[(len(runs[name]) - 1) // 2])  # the median run
        r["runs_step_s"] = [x["step_s"] for x in runs[name]]
        out["configs"][name] = r
        print(f"{name:<{w}}{r['step_s']:>8.2f}{r['trajectories_per_s']:>8.1f}{r['train_s_per_step']:>8.2f}"
              f"{r['tail_s_per_step']:>7.2f}"
              f"{r['sync_s_per_step']:>7.3f}"
              f"{r['trainer_idle_frac']:>13.2f}{r['rollout_idle_frac']:>13.2f}{int(r['generated_tokens']):>11}"
              f"{r['trained_trajectories']:>8}{r['reward_mean']:>7.2f}{r['max_staleness_seen']:>6}", flush=True)
    c = out["configs"]
    for name in [n for n in c if "+" in n]:
        a, r = c[name.split("+")[0]], c[name]
        r["speedup_vs_without"] = a["step_s"] / r["step_s"]
        print(f"{name}: {r['speedup_vs_without']:.2f}x per step vs without ({r['step_s']:.2f} vs {a['step_s']:.2f} s; "
              f"generated tokens {int(r['generated_tokens'])} vs {int(a['generated_tokens'])}; trainer's own "
              f"{r['train_s_per_step']:.2f} vs {a['train_s_per_step']:.2f} s/step)"
              + (f" (runs, s/step: {[round(x, 2) for x in r['runs_step_s']]} vs "
                 f"{[round(x, 2) for x in a['runs_step_s']]})" if args.repeats > 1 else ""))
    for name in ("sync", "async_k1"):
        if name in c and name + "_after" in c:
            a, r = c[name + "_after"], c[name]
            print(f"{name}: each group's pass as it arrives vs after the batch: {a['step_s'] / r['step_s']:.2f}x per "
                  f"step, training after the last group {r['tail_s_per_step']:.2f} s vs {a['tail_s_per_step']:.2f} s"
                  + (f" (runs, s/step: {[round(x, 2) for x in r['runs_step_s']]} vs "
                     f"{[round(x, 2) for x in a['runs_step_s']]})" if args.repeats > 1 else ""))
    if "sync_batch" not in c or "sync" not in c:
        return finish(out, args)
    b, s = out["configs"]["sync_batch"], out["configs"]["sync"]
    rollout_s = b["step_s"] - b["train_s_per_step"]  # D: a step's rollout, synchronously
    print(f"sync vs sync_batch: {b['step_s'] / s['step_s']:.2f}x per step (the streamed trainer)")
    for name in [n for n in ("async_k1", "async_k1_partial", "async_k2", "lockstep_k1") if n in c]:
        r = out["configs"][name]
        # under the admission rule a step lasts at least (D + t) / (k + 1), t: this run's own training
        # step (a streamed trainer hides part of t behind the rollouts: the bound is then not strict)
        r["rule_bound_step_s"] = (rollout_s + r["train_s_per_step"]) / (r["max_staleness"] + 1)
        print(f"{name}: {b['step_s'] / r['step_s']:.2f}x per step vs sync_batch, {s['step_s'] / r['step_s']:.2f}x "
              f"vs sync (the admission rule's bound with the whole batch trained at once: "
              f"{b['step_s'] / r['rule_bound_step_s']:.2f}x)")
    finish(out, args)


def finish(out: dict, args) -> None:
    write_json(args.json, out)
    if args.plot:
        plot(out, args.plot)


def plot(out: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    c = out["configs"]
    names = list(c)[::-1]
    step = [c[n]["step_s"] for n in names]
    idle = [c[n]["trainer_idle_frac"] * c[n]["step_s"] for n in names]  # the trainer waiting for groups
    fig, ax = plt.subplots(figsize=(8, 3.8))
    ax.barh(names, [s - i for s, i in zip(step, idle)], color="tab:blue", label="trainer working (or syncing)")
    ax.barh(names, idle, left=[s - i for s, i in zip(step, idle)], color="tab:gray", alpha=0.5,
            label="trainer waiting for rollouts")
    ref = "sync_batch" if "sync_batch" in c else max(c, key=lambda n: c[n]["step_s"])  # the ratios' baseline
    base = c[ref]["step_s"]
    ax.axvline(base / 2, ls="--", c="tab:red", label=f"2x over {ref}")
    for y, s in enumerate(step):
        ax.text(s, y, f" {s:.2f} s  {base / s:.2f}x", va="center", fontsize=8,
                bbox=dict(facecolor="white", edgecolor="none", pad=1))
    name = out.get("advantage", "grpo")
    ax.set(xlabel="seconds per training step (same work per step)", xlim=(0, base * 1.3),
           title=f"synchronous vs asynchronous {'GRPO' if name == 'grpo' else name} (phonebook, tools 50-500 ms)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
