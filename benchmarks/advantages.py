"""Advantage estimators against each other on multi-turn tasks, same run: GRPO's episode-level
advantages, GiGPO's step-level ones, PPO's from a critic (GAE), REINFORCE++'s.

    python benchmarks/advantages.py [--advantages grpo,gigpo] [--env phonebook|frozenlake] [--seeds 0,1]
                                    [--steps N] [--set KEY=VALUE] [--json PATH] [--plot PNG]

Each run starts from one cached SFT warm start per seed and is the same deterministic RL run
(lockstep pipeline, staleness 1, 8 groups x 8 episodes a step) with each `advantage` named (default
"grpo" and "gigpo"; "gae" trains a critic beside the policy). `phonebook`: the demo's run
(examples/train-phonebook.toml, 240 steps; its grpo run is `rollwise demo`'s), where the turns that
answer after the same lookup result form GiGPO's step groups.
`frozenlake`: examples/train-frozenlake.toml (4x4 and 5x5 grids with holes, a `move` tool per
turn, reward 1 at the goal; 60 steps), where every cell of a task's grid is a state the group's
walks share. Reports per run: held-out success (sampled and greedy) after SFT and after RL, the
success curve (`eval_every`), the training episodes' success and turns in the first and last 5
steps, the share of turns GiGPO found a step group for (`anchored_turns`), the critic's explained
variance of the returns in the last 5 steps (gae), generated tokens and wall time.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
import tomllib
from pathlib import Path

from rollwise.omp import passive_unless_chosen
passive_unless_chosen()  # before torch loads

from rollwise.cli import DEMO_DIR, DEMO_SFT_CACHE, _overrides, demo_model  # noqa: E402
from rollwise.rl import TrainConfig, train  # noqa: E402
from rollwise.rollout.pipeline import read_log  # noqa: E402
from rollwise.trainer.advantages import ADVANTAGES  # noqa: E402
from common import write_json  # noqa: E402  (benchmarks/common.py)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
ENVS = {"phonebook": (EXAMPLES / "train-phonebook.toml", DEMO_SFT_CACHE),
        "frozenlake": (EXAMPLES / "train-frozenlake.toml", str(DEMO_DIR.parent / "frozenlake-sft"))}


def training_episodes(groups, steps) -> dict:
    per = [t for g in groups for t in g.trajectories]
    return {"success": sum(t.reward > 0 for t in per) / max(len(per), 1),
            "turns": statistics.mean(t.num_turns for t in per) if per else 0.0,
            "turns_when_solved": statistics.mean([t.num_turns for t in per if t.reward > 0] or [0]),
            "steps": steps}


def run(advantage: str, seed: int, args) -> dict:
    config, sft_cache = ENVS[args.env]
    base = tomllib.loads(config.read_text())
    with tempfile.TemporaryDirectory(prefix="rollwise-advantages-") as tmp:
        cfg = TrainConfig.from_dict({**base, **args.overrides, "model": demo_model(), "run_dir": tmp,
                                     "sft_cache": sft_cache, "advantage": advantage, "seed": seed,
                                     "steps": args.steps or base["steps"], "eval_every": args.eval_every,
                                     "progress": False})
        t0 = time.perf_counter()
        rep = train(cfg)
        wall = time.perf_counter() - t0
        by_step: dict[int, list] = {}
        for g in read_log(Path(tmp) / "groups.jsonl"):
            by_step.setdefault(g.seq // cfg.groups_per_step, []).append(g)
    steps = rep["steps"]
    k = min(5, len(steps))
    first = [g for s in range(k) for g in by_step.get(s, [])]
    last = [g for s in range(len(steps) - k, len(steps)) for g in by_step.get(s, [])]
    return {"env": args.env, "advantage": advantage, "seed": seed, "sft_success": rep["sft_success"],
            "sft_greedy_success": rep["sft_greedy_success"], "rl_success": rep["rl_success"],
            "rl_greedy_success": rep["rl_greedy_success"],
            "curve": [[0, rep["sft_success"]]] + [[s["step"] + 1, s["eval_success"]] for s in steps
                                                  if "eval_success" in s],
            "first_steps": training_episodes(first, f"1-{k}"),
            "last_steps": training_episodes(last, f"{len(steps) - k + 1}-{len(steps)}"),
            "anchored_turns": statistics.mean(s.get("anchored_turns", 0.0) for s in steps) if steps else 0.0,
            "explained_var": statistics.mean(ev) if (ev := [s["explained_var"] for s in steps[-k:]
                                                            if "explained_var" in s]) else None,
            "generated_tokens": steps[-1].get("generated_tokens", 0.0) if steps else 0.0,
            # the policy's mean entropy on its trained tokens in the first and last k steps
            "entropy": [finite_mean(s["entropy"] for s in part) for part in (steps[:k], steps[-k:])]
            if steps and "entropy" in steps[0] else None,
            "trained_trajectories": sum(s["trained_trajectories"] for s in steps),
            "wall_s": wall, "rl_wall_s": steps[-1]["wall_s"] if steps else 0.0,
            # KL in the reward: the per-token KL to the reference in the first and last k steps, and beta's path
            "reward_kl": [statistics.mean(s["reward_kl"] for s in part) for part in (steps[:k], steps[-k:])]
            if steps and "reward_kl" in steps[0] else None,
            "reward_kl_coef": [steps[0]["reward_kl_coef"], steps[-1]["reward_kl_coef"]]
            if steps and "reward_kl_coef" in steps[0] else None}


COLORS = {"grpo": "tab:blue", "gigpo": "tab:orange", "gae": "tab:green", "rloo": "tab:red", "dr_grpo": "tab:purple",
          "reinforce_plus_plus": "tab:brown", "reinforce_plus_plus_baseline": "tab:pink", "remax": "tab:olive"}


def plot(runs: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for r in runs:
        xs, ys = zip(*r["curve"])
        ax.plot(xs, ys, color=COLORS.get(r["advantage"], "tab:gray"), marker="o", ms=3,
                ls=("-", "--", ":", "-.")[r["seed"] % 4], alpha=0.8, label=f"{r['advantage']} (seed {r['seed']})")
    ax.set_xlabel("RL step")
    ax.set_ylabel("held-out success (sampled)")
    ax.set_title(f"{runs[0]['env']}: " + " vs ".join(dict.fromkeys(r["advantage"] for r in runs)))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def finite_mean(xs) -> float | None:
    """The mean of the finite values (a step that trained no token logs its entropy as NaN); None if none."""
    xs = [x for x in xs if math.isfinite(x)]
    return statistics.mean(xs) if xs else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--advantages", default="grpo,gigpo", help=f"comma-separated, of {list(ADVANTAGES)}")
    p.add_argument("--env", choices=sorted(ENVS), default="phonebook")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--steps", type=int, help="RL steps (default: the example config's)")
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a TrainConfig key for every run (e.g. reward_kl_coef=0.01)")
    p.add_argument("--smoke", action="store_true", help="a tiny run of each, to check the benchmark works")
    p.add_argument("--json")
    p.add_argument("--plot")
    args = p.parse_args()
    args.overrides = _overrides(args.set)
    chosen = args.advantages.split(",")
    if not chosen or set(chosen) - set(ADVANTAGES):
        p.error(f"--advantages: {args.advantages!r}; valid: {list(ADVANTAGES)}")
    if args.smoke:
        args.steps, args.eval_every = 2, 1
        args.overrides = {"sft_steps": 2, "sft_tasks": 8, "groups_per_step": 2, "group_size": 2, "eval_tasks": 4,
                          "max_turns": 3, **args.overrides}
    runs = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for advantage in chosen:
            r = run(advantage, seed, args)
            runs.append(r)
            ev = "" if r["explained_var"] is None else f"; critic explains {r['explained_var']:.2f} of the returns"
            if r["reward_kl"] is not None:
                ev += (f"; KL per token {r['reward_kl'][0]:.4f} -> {r['reward_kl'][1]:.4f}, beta "
                       f"{r['reward_kl_coef'][0]:.4f} -> {r['reward_kl_coef'][1]:.4f}")
            print(f"seed {seed} {advantage}: success {r['sft_success']:.3f} -> {r['rl_success']:.3f} "
                  f"(greedy {r['sft_greedy_success']:.3f} -> {r['rl_greedy_success']:.3f}); training episodes "
                  f"{r['first_steps']['success']:.3f} -> {r['last_steps']['success']:.3f} solved, "
                  f"{r['first_steps']['turns_when_solved']:.2f} -> {r['last_steps']['turns_when_solved']:.2f} turns "
                  f"when solved; anchored turns {r['anchored_turns']:.2f}{ev}; {r['generated_tokens']:.0f} tokens, "
                  f"{r['wall_s']:.0f} s", flush=True)
    out = {"env": args.env, "config": ENVS[args.env][0].name, "set": args.set, "runs": runs}
    for adv in chosen:
        mine = [r for r in runs if r["advantage"] == adv]
        out[adv] = {k: statistics.mean(r[k] for r in mine) for k in ("rl_success", "rl_greedy_success", "wall_s")}
    print(json.dumps({a: out[a] for a in chosen}, indent=1))
    write_json(args.json, out)
    if args.plot:
        plot(runs, args.plot)


if __name__ == "__main__":
    main()
