"""Another attempt after feedback (`env_options = { user = "feedback" }`), trained and evaluated in
the same run: does a policy that may correct itself learn to, and what does it cost?

    python benchmarks/feedback.py [--steps N] [--attempts 3] [--discount 0.5] [--json PATH]

The demo's RL (examples/train-phonebook.toml, from its cached SFT warm start, deterministic) is run
twice: `plain`, each episode's first answer scored, and `feedback`, a wrong answer told so and tried
again, up to `--attempts`, the reward discounted by `--discount` per extra attempt. The warm start
and both trained models are then evaluated on the same held-out tasks both ways: first answer only,
and with up to `--attempts` answers (discount 1: solved at all). Reports success, the share of first
answers that were wrong and then corrected, turns and generated tokens per episode, and wall time.
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

from rollwise.cli import DEMO_SFT_CACHE, demo_model  # noqa: E402
from rollwise.evaluation import evaluate_model  # noqa: E402
from rollwise.rl import TrainConfig, train  # noqa: E402
from common import write_json  # noqa: E402  (benchmarks/common.py)

CONFIG = Path(__file__).resolve().parent.parent / "examples" / "train-phonebook.toml"


def evaluate(base: dict, model: str, user: dict | None, out: Path) -> dict:
    """The held-out tasks of the run's config (the same for every model), with or without the user."""
    cfg = TrainConfig.from_dict({**base, "model": model, "run_dir": str(out.parent), "env_options": {"user": user}
                                 if user else {}})
    rep = evaluate_model(cfg, out=out)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    fixed = sum(r["reward"] >= 1.0 and r["env_stats"].get("user_replies", 0) > 0 for r in rows)
    return {"success": rep["success"], "corrected": fixed / len(rows),
            "turns": sum(r["turns"] for r in rows) / len(rows),
            "generated_per_episode": sum(r["generated_tokens"] for r in rows) / len(rows)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, help="RL steps (default: the example config's)")
    p.add_argument("--attempts", type=int, default=3)
    p.add_argument("--discount", type=float, default=0.5)
    p.add_argument("--smoke", action="store_true", help="a tiny run, to check the benchmark works")
    p.add_argument("--json")
    args = p.parse_args()
    base = {**tomllib.loads(CONFIG.read_text()), "model": demo_model(), "sft_cache": DEMO_SFT_CACHE,
            "progress": False}
    if args.steps is not None:
        base["steps"] = args.steps
    if args.smoke:
        base.update(sft_steps=2, sft_tasks=8, steps=2, groups_per_step=2, group_size=2, eval_tasks=4, sft_cache="")
    train_user = {"kind": "feedback", "max_attempts": args.attempts, "discount": args.discount}
    eval_user = {"kind": "feedback", "max_attempts": args.attempts}
    out = {"config": CONFIG.name, "steps": base["steps"], "attempts": args.attempts, "discount": args.discount,
           "eval_tasks": base["eval_tasks"], "models": {}}
    with tempfile.TemporaryDirectory(prefix="rollwise-feedback-") as tmp:
        arms = {"sft": (0, None), "plain": (base["steps"], None), "feedback": (base["steps"], train_user)}
        for name, (steps, user) in arms.items():
            options = {"user": user} if user else {}
            cfg = TrainConfig.from_dict({**base, "steps": steps, "env_options": options, "run_dir": f"{tmp}/{name}",
                                         "eval_tasks": 0 if name == "sft" else base["eval_tasks"]})
            t0 = time.perf_counter()
            rep = train(cfg)
            wall = time.perf_counter() - t0
            model = f"{tmp}/{name}/final-model"
            evals = {"first_answer": evaluate(base, model, None, Path(tmp) / f"{name}-first.jsonl"),
                     f"up_to_{args.attempts}": evaluate(base, model, eval_user, Path(tmp) / f"{name}-fb.jsonl")}
            hist = rep["steps"]
            row = {**evals, "rl_wall_s": hist[-1]["wall_s"] if hist else 0.0, "train_wall_s": wall,
                   "generated_tokens": hist[-1].get("generated_tokens", 0.0) if hist else 0.0,
                   "trained_episodes": sum(s["trained_trajectories"] for s in hist)}
            out["models"][name] = row
            print(f"{name}: first answer {evals['first_answer']['success']:.3f}, up to {args.attempts} answers "
                  f"{evals[f'up_to_{args.attempts}']['success']:.3f} (corrected "
                  f"{evals[f'up_to_{args.attempts}']['corrected']:.3f}); RL {row['rl_wall_s']:.0f} s, "
                  f"{row['generated_tokens']:.0f} tokens", flush=True)
    print(json.dumps(out, indent=1))
    write_json(args.json, out)


if __name__ == "__main__":
    main()
