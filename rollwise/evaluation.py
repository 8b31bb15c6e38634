"""`rollwise eval CONFIG.toml`: a model (the config's `model`, e.g. a run's `final-model`) on the held-out
tasks `rollwise train` evaluates with the same config (`eval_tasks_file`, or the env's own draw),
`samples` episodes per task on the config's fleet. Reports success (reward 1) per episode, which is
pass@1, and pass@samples (a task counts if any of its samples succeeds), pass@k for each power of
two k below it (Chen et al. 2021's unbiased estimator from the n samples), tau-bench's pass^k (all of
k samples succeed, its unbiased estimator C(c, k) / C(n, k)) for the same k, mean reward, episode
statuses and the work done (and success per env when tasks name theirs: a mix, and per kind when
they name a `kind`: the airline env's); writes every transcript as JSON lines when asked."""
from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter
from pathlib import Path

from rollwise.rl import eval_episodes
from rollwise.rl_config import TrainConfig, env_factory
from rollwise.rollout.task_sets import n_train_tasks, task_sets
from rollwise.rollout.fleet import make_router, shutdown
from rollwise.rollout.report import Status


def evaluate_model(cfg: TrainConfig, samples: int = 1, temperature: float | None = None,
                   out: str | Path | None = None) -> dict:
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    tasks = task_sets(cfg, n_train_tasks(cfg))[2]
    if not tasks:
        raise ValueError(f"no evaluation tasks: env {cfg.env!r} draws none; set eval_tasks_file (and eval_tasks > 0)")
    return asyncio.run(_evaluate(cfg, tasks, samples, cfg.temperature if temperature is None else temperature, out))


async def _evaluate(cfg: TrainConfig, tasks: list[dict], samples: int, temperature: float, out) -> dict:
    from rollwise.engine.tokenizer import Tokenizer
    router = make_router(cfg, Tokenizer(cfg.model))
    status = Status(cfg.progress)
    rows, right = [], []  # every episode; right episodes per task
    t0 = time.perf_counter()
    try:
        async for group in eval_episodes(router, env_factory(cfg), tasks, cfg, temperature, samples):
            right.append(sum(t.reward >= 1.0 for t in group))
            rows += [{"task_id": t.task.get("id"), "env": t.task.get("env"), "kind": t.task.get("kind"),
                      "sample": k, "reward": t.reward,
                      "status": t.status,
                      "error": t.error, "turns": t.num_turns, "generated_tokens": t.num_generated,
                      "env_stats": t.env_stats, "messages": t.messages} for k, t in enumerate(group)]
            status.line(f"eval: {len(right)}/{len(tasks)} tasks, success {sum(right) / len(rows):.3f}")
    finally:
        await router.close()
        shutdown(router)
    seconds = time.perf_counter() - t0
    n, turns, tokens = len(rows), sum(r["turns"] for r in rows), sum(r["generated_tokens"] for r in rows)
    report = {"model": cfg.model, "env": cfg.env, "tasks": len(tasks), "samples": samples, "temperature": temperature,
              "success": sum(right) / n, f"pass@{samples}": sum(c > 0 for c in right) / len(right),
              "mean_reward": sum(r["reward"] for r in rows) / n,
              "statuses": dict(Counter(r["status"] for r in rows)), "turns": turns,
              "generated_tokens": tokens, "seconds": seconds,
              # the env's counts per episode (tool calls, errors, searches), as the training steps report them
              "env_stats": {k: sum(r["env_stats"].get(k, 0.0) for r in rows) / n
                            for k in sorted({k for r in rows for k in r["env_stats"]})}}
    for k in (2 ** i for i in range(1, samples.bit_length())):  # the rest: unbiased from the n samples
        if k < samples:
            report[f"pass@{k}"] = sum(pass_at(samples, c, k) for c in right) / len(right)
    for k in sorted({2 ** i for i in range(1, samples.bit_length())} | ({samples} if samples > 1 else set())):
        report[f"pass^{k}"] = sum(pass_all(samples, c, k) for c in right) / len(right)
    for key in ("env", "kind"):  # tasks of several envs (a mix), or of several kinds: success per each
        names = sorted({r[key] for r in rows if r[key] is not None})
        if names:
            report[f"success_by_{key}"] = {e: sum(r["reward"] >= 1.0 for r in rows if r[key] == e) /
                                           sum(r[key] == e for r in rows) for e in names}
    status.done(f"eval: success {report['success']:.3f}, pass@{samples} {report[f'pass@{samples}']:.3f} on "
                f"{len(tasks)} tasks x {samples} ({turns} turns, {tokens} tokens generated, {seconds:.0f}s)")
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        with open(out, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return report


def pass_all(n: int, c: int, k: int) -> float:
    """The chance that k of a task's n samples, c of them right, drawn without replacement, are all
    right: C(c, k) / C(n, k) (tau-bench's pass^k, how reliably a task is solved)."""
    return math.comb(c, k) / math.comb(n, k)


def pass_at(n: int, c: int, k: int) -> float:
    """The chance that k of a task's n samples, c of them right, drawn without replacement, hold a
    right one: 1 - C(n - c, k) / C(n, k) (Chen et al. 2021, the unbiased pass@k estimator)."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)
