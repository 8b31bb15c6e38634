"""Synchronous vs asynchronous RL in one run: the same environment, model, fleet and work per step
(B groups x n episodes), max_staleness 0 (synchronous, WAR's setting) vs 1 and 2.

    python benchmarks/pipeline.py [--quick | --smoke] [--json PATH]

Environment: calculator with tool latency 50-500 ms, log-normal (heavy tail, capped at 2 s). The
model is SFT-warm-started once (so that it calls tools), then every configuration starts GRPO from
the same weights. Reports per configuration: wall seconds per training step (after the first),
trajectories/s, trainer idle fraction (waiting for rollouts), rollout idle fraction (no episode in
flight), generated tokens, and the staleness actually seen.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from rollwise.agent.envs import make_env  # noqa: E402
from rollwise.engine.tokenizer import Tokenizer  # noqa: E402
from rollwise.rl import TrainConfig, expert_trajectories, train  # noqa: E402
from rollwise.trainer.grpo import sft  # noqa: E402
from rollwise.trainer.policy import PolicyModel  # noqa: E402

from common import cached_model  # noqa: E402  (benchmarks/common.py)


def warm_started(base: str, steps: int) -> str:
    """The base model after `steps` of SFT on calculator expert transcripts (cached)."""
    out = Path(base + f"-sft{steps}")
    if (out / "config.json").exists():
        return str(out)
    tok = Tokenizer(base)
    demos = asyncio.run(expert_trajectories(tok, lambda: make_env("calculator"),
                                            make_env("calculator").sample_tasks(512, seed=1)))
    policy = PolicyModel(base)
    sft(policy, demos, steps=steps, lr=3e-3, batch_size=16)
    policy.save(str(out))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(base) / f, out / f)
    return str(out)


def run(model: str, k: int, args) -> dict:
    with tempfile.TemporaryDirectory(prefix="rollwise-pipeline-") as tmp:
        cfg = TrainConfig.from_dict(dict(
            model=model, run_dir=tmp, env="calculator", sft_steps=0, steps=args.steps, groups_per_step=args.groups,
            group_size=args.group_size, max_staleness=k, tool_latency=(0.05, 0.5), tool_latency_kind="lognormal",
            max_tokens=48, max_turns=3, eval_tasks=args.eval_tasks, max_concurrent_groups=args.groups * 3,
            progress=False, seed=0))
        t0 = time.perf_counter()
        rep = train(cfg)
        total = time.perf_counter() - t0
    steps = rep["steps"]
    wall = steps[-1]["wall_s"] - steps[0]["wall_s"]  # from the end of step 0 (warm) to the end
    n = len(steps) - 1
    trajs = sum(s["trajectories"] for s in steps[1:])
    return {"max_staleness": k, "step_s": wall / n, "trajectories_per_s": trajs / wall,
            "trainer_idle_frac": sum(s["wait_s"] for s in steps[1:]) / wall,
            "rollout_idle_frac": rep["queue"]["rollout_idle_s"] / steps[-1]["wall_s"],
            "generated_tokens": steps[-1].get("generated_tokens", 0.0), "trajectories": trajs,
            "trajectories_per_step": steps[-1]["trajectories"], "max_staleness_seen": rep["queue"]["max_staleness_seen"],
            "stale_trajectories": rep["queue"]["stale_trajectories"], "reward_last": steps[-1]["reward"],
            "total_s": total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    args.steps, args.groups, args.group_size, sft_steps = (3, 2, 2, 5) if args.smoke else (6, 4, 8, 150) if args.quick \
        else (12, 8, 8, 150)
    args.eval_tasks = 4 if args.smoke else 16
    base = cached_model("pipeline-bench-model", family="qwen3", layers=2, hidden=128, heads=4, kv_heads=2, vocab=2048,
                        seed=0)
    model = warm_started(base, sft_steps)
    print(f"{args.steps} GRPO steps of {args.groups} groups x {args.group_size} episodes; calculator, tool latency "
          "50-500 ms log-normal")
    out = {"configs": {}}
    print(f"{'config':<12}{'s/step':>8}{'traj/s':>8}{'trainer idle':>13}{'rollout idle':>13}{'gen tokens':>11}{'stale':>7}")
    for k in (0, 1, 2):
        r = run(model, k, args)
        name = "sync" if k == 0 else f"async_k{k}"
        out["configs"][name] = r
        print(f"{name:<12}{r['step_s']:>8.2f}{r['trajectories_per_s']:>8.1f}{r['trainer_idle_frac']:>13.2f}"
              f"{r['rollout_idle_frac']:>13.2f}{int(r['generated_tokens']):>11}{r['max_staleness_seen']:>7}", flush=True)
    s = out["configs"]["sync"]
    for name in ("async_k1", "async_k2"):
        print(f"{name} vs sync: {s['step_s'] / out['configs'][name]['step_s']:.2f}x per step")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
