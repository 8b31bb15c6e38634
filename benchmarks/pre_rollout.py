"""What the pre-rollout filter (`pre_rollout_explore`, GRESO's) saves over DAPO's dynamic sampling alone,
same run: the demo's RL (examples/train-phonebook.toml: its cached SFT warm start, 8 groups x 8
episodes a step) over a task file of `--tasks` training tasks cycled for several epochs, with
`dynamic_sampling = true` both ways (groups whose episodes all got the same reward are dropped after
they ran) and the filter off (the baseline) or on (such tasks skipped before they run, with
probability 1 - explore^z after z such groups in a row), and with `--target T` also GRESO's adaptive
explore (`pre_rollout_target`: the easy and hard tasks' probabilities, from `--explore`, moved each
step toward T/3 and 2T/3 of the step's groups).

    python benchmarks/pre_rollout.py [--tasks 64] [--steps 40] [--explore 0.5] [--target 0.25] [--smoke]
                                     [--json PATH]

Reported for each: the RL phase's wall time, the groups run (and so the episodes), the groups
dynamic sampling dropped, the tasks skipped before running, the groups trained, held-out success
(sampled and greedy, 200 tasks) after RL; then the filter's run against the baseline's.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
import tomllib
from pathlib import Path

from rollwise.omp import passive_unless_chosen
passive_unless_chosen()  # before torch loads

from rollwise.agent.envs import make_env  # noqa: E402
from rollwise.cli import DEMO_SFT_CACHE, demo_model  # noqa: E402
from rollwise.rl import TrainConfig, train  # noqa: E402
from rollwise.rollout.pipeline import read_log  # noqa: E402

from common import engine_model, write_json  # noqa: E402  (benchmarks/common.py)

CONFIG = Path(__file__).resolve().parent.parent / "examples" / "train-phonebook.toml"


def run(explore: float, tasks_file: Path, args, target: float = 0.0) -> dict:
    base = tomllib.loads(CONFIG.read_text())
    with tempfile.TemporaryDirectory(prefix="rollwise-pre-rollout-") as tmp:
        size = dict(sft_steps=2, sft_tasks=8, groups_per_step=2, group_size=4, eval_tasks=4, max_tokens=16,
                    replicas=1) if args.smoke else {}
        model = engine_model("smoke", args.model) if args.smoke else args.model or demo_model()
        cfg = TrainConfig.from_dict({**base, **size, "model": model, "run_dir": tmp,
                                     "sft_cache": None if args.smoke else DEMO_SFT_CACHE, "steps": args.steps,
                                     "lr": args.lr, "deterministic": False, "dynamic_sampling": True,
                                     "train_tasks_file": str(tasks_file), "pre_rollout_explore": explore,
                                     "pre_rollout_target": target, "progress": False})
        rep = train(cfg)
        groups = read_log(Path(tmp) / "groups.jsonl")
        skips = Path(tmp) / "pre_rollout.jsonl"
        steps = rep["steps"]
        return {"explore": explore, "target": target, "rl_wall_s": steps[-1]["wall_s"], "groups_run": len(groups),
                "episodes": sum(len(g.trajectories) for g in groups),
                "generated_tokens": sum(t.num_generated for g in groups for t in g.trajectories),
                "dropped_after_running": sum(s["skipped_groups"] for s in steps),
                "skipped_before_running": len(skips.read_text().splitlines()) if skips.exists() else 0,
                "trained_groups": len(steps) * cfg.groups_per_step,
                "sft_success": rep["sft_success"], "rl_success": rep["rl_success"],
                "rl_greedy_success": rep.get("rl_greedy_success"),
                **({"p_easy_last": steps[-1]["pre_rollout_p_easy"], "p_hard_last": steps[-1]["pre_rollout_p_hard"]}
                   if target else {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=64, help="training tasks, cycled")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--explore", type=float, default=0.5)
    ap.add_argument("--target", type=float, default=0.0,
                    help="also run GRESO's adaptive explore toward this share of groups teaching nothing (e.g. 0.25)")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--model", help="a model directory (default: the demo's; with --smoke, the 2-layer one, made once)")
    ap.add_argument("--smoke", action="store_true", help="a seconds-long run for tests")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.smoke:
        args.tasks, args.steps = 4, 3
    with tempfile.TemporaryDirectory() as tmp:
        tasks_file = Path(tmp) / "tasks.jsonl"
        tasks = make_env("phonebook").sample_tasks(args.tasks, seed=100)
        tasks_file.write_text("".join(json.dumps(t) + "\n" for t in tasks))
        res = {}
        sides = [("dynamic_sampling", 1.0, 0.0), ("pre_rollout_filter", args.explore, 0.0)]
        sides += [("adaptive", args.explore, args.target)] if args.target else []
        for name, explore, target in sides:
            t0 = time.perf_counter()
            res[name] = run(explore, tasks_file, args, target)
            r = res[name]
            print(f"{name:>18}: RL {r['rl_wall_s']:6.1f} s, {r['groups_run']} groups run ({r['episodes']} episodes, "
                  f"{r['generated_tokens']:,} tokens), {r['dropped_after_running']} dropped after running, "
                  f"{r['skipped_before_running']} skipped before; success after RL {r['rl_success']:.3f} (greedy "
                  f"{r['rl_greedy_success']:.3f}); {time.perf_counter() - t0:.0f} s in all", flush=True)
    b, f = res["dynamic_sampling"], res["pre_rollout_filter"]
    res["ratio"] = {"rl_wall_s": b["rl_wall_s"] / f["rl_wall_s"], "episodes": b["episodes"] / f["episodes"]}
    res["settings"] = {"tasks": args.tasks, "steps": args.steps, "explore": args.explore, "target": args.target,
                       "lr": args.lr, "smoke": args.smoke}
    print(f"the filter against dynamic sampling alone: {res['ratio']['rl_wall_s']:.2f}x less RL time, "
          f"{res['ratio']['episodes']:.2f}x fewer episodes run, for {args.steps} steps of the same size")
    if args.target:
        a = res["adaptive"]
        res["ratio_adaptive"] = {"rl_wall_s": b["rl_wall_s"] / a["rl_wall_s"],
                                 "episodes": b["episodes"] / a["episodes"]}
        print(f"adaptive against dynamic sampling alone: {res['ratio_adaptive']['rl_wall_s']:.2f}x less RL time, "
              f"{res['ratio_adaptive']['episodes']:.2f}x fewer episodes (explore at the end: easy "
              f"{a['p_easy_last']:.2f}, hard {a['p_hard_last']:.2f})")
    write_json(args.json, res)


if __name__ == "__main__":
    main()
