"""Data-parallel training (`trainer_processes`): the same GRPO steps on one trainer process and on N,
the machine's cores split between the processes (rollwise/trainer/data_parallel.py); with `--sft`,
the SFT warm start's steps instead (`TrainerRanks.sft`: each rank its share of every batch).

    python benchmarks/train_dp.py [--smoke] [--sft] [--processes 1,2] [--steps 3] [--json PATH]

Each configuration trains the same groups (agent-like rows: a prompt shared by a group, then each
row's own generated tokens) from the same weights, through `make_trainer` as `rollwise train` builds
it. Reported: the median seconds of a step after a warm-up step, the trained tokens per second, the
ratio against one process, and how far the weights end from the one-process run's (the order of the
gradient sums differs; every rank's weights are checked to be the same bits).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import tempfile
import time

from rollwise.omp import passive_unless_chosen
passive_unless_chosen()  # before torch loads

import torch  # noqa: E402

from common import engine_model, write_json  # noqa: E402  (benchmarks/common.py)
from rollwise.rl_config import TrainConfig  # noqa: E402
from rollwise.rl_trainer import TrainerRanks, make_policy, make_trainer  # noqa: E402
from rollwise.trainer.policy import Batch  # noqa: E402
from rollwise.types import Trajectory, TurnRecord  # noqa: E402


def make_groups(model: str, n_groups: int, size: int, prompt: int, gen: int, vocab: int, seed: int) -> list:
    """Rows of random tokens, each a prompt shared by its group, then `gen` +- 50% generated tokens,
    rewards mixed, behaviour logprobs the model's own (importance ratios of 1, as fresh samples)."""
    rng = random.Random(seed)
    groups = []
    for g in range(n_groups):
        p = [rng.randrange(4, vocab) for _ in range(prompt)]
        group = []
        for i in range(size):
            n = rng.randint(gen // 2, gen * 3 // 2)
            turn = TurnRecord(start=prompt, num_generated=n, num_observation=0, finish_reason="length",
                              policy_version=0, num_cached_tokens=0, generation_s=0.0, tool_s=0.0, replica="r0")
            group.append(Trajectory(trajectory_id=f"t{g}.{i}", group_id=f"g{g}", task={},
                                    token_ids=p + [rng.randrange(4, vocab) for _ in range(n)],
                                    loss_mask=[0] * prompt + [1] * n, logprobs=[0.0] * (prompt + n), turns=[turn],
                                    reward=float(rng.random() < 0.5)))
        groups.append(group)
    policy = make_policy(TrainConfig.from_dict({"model": model}))
    with torch.no_grad():
        for group in groups:
            b = Batch.of(group)
            lp = policy.logprobs(b)
            for j, t in enumerate(group):
                t.logprobs = [0.0] * prompt + lp[j, prompt - 1:prompt - 1 + t.num_generated].tolist()
    return groups


def run(cfg: TrainConfig, groups: list, steps: int) -> dict:
    trainer = make_trainer(cfg, make_policy(cfg))
    try:
        times, metrics = [], []
        for s in range(steps + 1):
            t0 = time.perf_counter()
            metrics.append(trainer.step(groups))
            if s:  # (the first: warm-up)
                times.append(time.perf_counter() - t0)
        same = len(set(trainer.fingerprints())) == 1 if cfg.trainer_processes > 1 else True
        weights = torch.cat([p.detach().reshape(-1) for p in trainer.policy.parameters()])
    finally:
        if cfg.trainer_processes > 1:
            trainer.close()
    tokens = metrics[-1]["trained_tokens"]
    return {"processes": cfg.trainer_processes, "threads_each": max(1, cfg.trainer_threads // cfg.trainer_processes),
            "step_s": statistics.median(times), "runs_step_s": times, "trained_tokens_per_step": tokens,
            "tokens_per_s": tokens / statistics.median(times), "loss": [m["loss"] for m in metrics],
            "ranks_same_bits": same, "weights": weights}


def run_sft(cfg: TrainConfig, groups: list, steps: int) -> dict:
    """`steps` + 1 SFT steps, each on every row of `groups` (the first: warm-up)."""
    rows = [t for g in groups for t in g]
    cfg = dataclasses.replace(cfg, sft_steps=steps + 1, sft_batch=len(rows), sft_lr=1e-4)
    policy = make_policy(cfg)
    ranks = TrainerRanks(cfg, policy)
    try:
        marks = [time.perf_counter()]
        losses = ranks.sft(rows, lambda s, loss: marks.append(time.perf_counter()))
        trainer = ranks.trainer()
        same = len(set(trainer.fingerprints())) == 1 if cfg.trainer_processes > 1 else True
    finally:
        ranks.close()
    times = [b - a for a, b in zip(marks[1:], marks[2:])]
    tokens = sum(t.num_generated for t in rows)  # (a batch draws rows with replacement: about this many)
    return {"processes": cfg.trainer_processes, "threads_each": max(1, cfg.trainer_threads // cfg.trainer_processes),
            "step_s": statistics.median(times), "runs_step_s": times, "trained_tokens_per_step": tokens,
            "tokens_per_s": tokens / statistics.median(times), "loss": losses, "ranks_same_bits": same,
            "weights": torch.cat([p.detach().reshape(-1) for p in policy.model.parameters()])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--processes", default="1,2")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--sft", action="store_true", help="the SFT warm start's steps instead of GRPO's")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=384)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--model", help="a model directory (default: the engine benchmarks' 8-layer model)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.groups, args.group_size, args.prompt, args.gen = 1, 4, 2, 16, 8
    model = engine_model("smoke" if args.smoke else "bench", args.model)
    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    cores = len(os.sched_getaffinity(0))
    groups = make_groups(model, args.groups, args.group_size, args.prompt, args.gen, vocab, seed=0)
    print(f"{args.steps} {'SFT' if args.sft else 'GRPO'} steps of {args.groups} groups x {args.group_size} rows (prompt {args.prompt}, about "
          f"{args.gen} generated tokens each), {cores} cores split between the trainer processes")
    out: dict = {"model": model, "cores": cores, "phase": "sft" if args.sft else "grpo", "configs": {}}
    base = None
    print(f"{'processes':>9}{'threads':>8}{'s/step':>9}{'tokens/s':>10}{'vs 1':>7}{'max |w - w1|':>14}"
          f"{'same bits':>10}")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainConfig.from_dict({"model": model, "run_dir": tmp, "lr": 1e-4, "trainer_threads": cores,
                                     "micro_batch_tokens": 4096})
        for n in [int(x) for x in args.processes.split(",")]:
            r = (run_sft if args.sft else run)(dataclasses.replace(cfg, trainer_processes=n), groups, args.steps)
            w = r.pop("weights")
            base = base or (r, w)
            r["speedup"] = base[0]["step_s"] / r["step_s"]
            r["max_weight_diff"] = float((w - base[1]).abs().max())
            out["configs"][str(n)] = r
            print(f"{n:>9}{r['threads_each']:>8}{r['step_s']:>9.2f}{r['tokens_per_s']:>10.0f}{r['speedup']:>7.2f}"
                  f"{r['max_weight_diff']:>14.2e}{str(r['ranks_same_bits']):>10}", flush=True)
    write_json(args.json, out)


if __name__ == "__main__":
    main()
