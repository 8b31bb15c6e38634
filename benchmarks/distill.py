"""On-policy distillation against GRPO alone, from the same student, on the demo's environment.

    python benchmarks/distill.py --teacher TEACHER_DIR [--student DIR] [--sft-steps 0] [--steps 60] [--lr 1e-3]
                                 [--run-root runs/distill] [--json PATH] [--plot PNG]

Both runs are `rollwise train examples/train-phonebook-distill.toml` (no warm start, 8 groups x 8
episodes a step, evaluation on 100 held-out tasks before and after): one with the teacher's reverse
KL as every sampled token's reward (`reference_model` = the teacher, `reward_kl_coef` 1, REINFORCE++
with no discount) beside the task's reward, one with the task's reward alone (GRPO). The student is
by default the demo's untrained model, which never solves a task, so GRPO alone has nothing to learn
from (`--sft-steps N`: both start from the same short warm start instead); the teacher is e.g.
`rollwise demo --quick`'s final model. Reported per run: its tool calls per
episode and KL to the teacher (the distillation run's own metric) by step, and the success rates.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from rollwise.omp import passive_unless_chosen
passive_unless_chosen()  # before torch loads

from rollwise.cli import demo_model  # noqa: E402
from rollwise.rl import TrainConfig, train  # noqa: E402
from common import write_json  # noqa: E402  (benchmarks/common.py)

ROOT = Path(__file__).resolve().parent.parent


def run(args, student: str, out: Path, distill: bool) -> dict:
    extra = {"reference_model": args.teacher} if distill else {"reward_kl_coef": 0.0, "advantage": "grpo"}
    warm = {"sft_steps": args.sft_steps, "sft_tasks": 8192, "sft_direct_fraction": 0.25,
            "sft_cache": str(Path(args.run_root) / "sft-cache")} if args.sft_steps else {}
    cfg = TrainConfig.from_toml(ROOT / "examples" / "train-phonebook-distill.toml", model=student, steps=args.steps,
                                lr=args.lr, run_dir=str(out), progress=False, **warm, **extra)
    if not args.summarize_only:
        train(cfg)
    return summary(out)


def summary(run_dir: Path) -> dict:
    """A finished run's tool calls per episode and KL to the teacher by step, and its success rates."""
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    metrics = json.loads((run_dir / "report" / "metrics.json").read_text())
    per_step = [{"step": s["step"], "calls_per_episode": s.get("env_num_calls", 0.0), "reward": s["reward"],
                 "reward_kl": s.get("reward_kl")} for s in steps]
    return {"steps": per_step, **{k: metrics[k] for k in ("sft_success", "sft_greedy_success", "rl_success",
                                                          "rl_greedy_success")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--teacher", required=True, help="a model on the student's vocabulary")
    ap.add_argument("--student", default=None, help="default: the demo's untrained model")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--sft-steps", type=int, default=0, help="a warm start of the student first (the same for both)")
    ap.add_argument("--run-root", default="runs/distill")
    ap.add_argument("--summarize-only", action="store_true", help="the runs under --run-root as they are")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    args = ap.parse_args()
    student = args.student or demo_model()
    res = {"student": student, "teacher": args.teacher, "steps": args.steps, "lr": args.lr, "sft_steps": args.sft_steps}
    for name, distill in (("distill", True), ("grpo", False)):
        res[name] = run(args, student, Path(args.run_root) / name, distill)
    print("| run | tool calls per episode, first / last 10 steps | KL to the teacher, first / last 10 steps "
          "| success sampled / greedy, before -> after |")
    print("| --- | --- | --- | --- |")
    for name in ("distill", "grpo"):
        r = res[name]
        first, last = r["steps"][:10], r["steps"][-10:]

        def mean(rows, k):
            vals = [x[k] for x in rows if x[k] is not None]
            return sum(vals) / len(vals) if vals else float("nan")
        print(f"| {name} | {mean(first, 'calls_per_episode'):.2f} / {mean(last, 'calls_per_episode'):.2f} "
              f"| {mean(first, 'reward_kl'):.3f} / {mean(last, 'reward_kl'):.3f} "
              f"| {r['sft_success']:.2f} / {r['sft_greedy_success']:.2f} -> {r['rl_success']:.2f} / "
              f"{r['rl_greedy_success']:.2f} |")
    write_json(args.json, res)
    if args.plot:
        plot(res, args.plot)


def plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name, style in (("distill", "-"), ("grpo", "--")):
        steps = res[name]["steps"]
        a.plot([s["step"] for s in steps], [s["calls_per_episode"] for s in steps], style, label=name)
    kl = [s for s in res["distill"]["steps"] if s["reward_kl"] is not None]
    b.plot([s["step"] for s in kl], [s["reward_kl"] for s in kl], "-", label="distill")
    a.set(xlabel="step", ylabel="tool calls per episode", title="the student's tool use")
    b.set(xlabel="step", ylabel="per-token KL to the teacher", title="on-policy distillation")
    a.legend()
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
