"""The task sets a training run draws: training, SFT and held-out evaluation tasks."""
from __future__ import annotations

import json

from rollwise.agent.envs import load_tasks
from rollwise.rl_config import TrainConfig, env_factory


def n_train_tasks(cfg: TrainConfig) -> int:
    """Training tasks a run draws from the env (twice what its steps take, at least 64)."""
    return max(cfg.steps * cfg.groups_per_step * 2, 64)


def task_sets(cfg: TrainConfig, n_train: int) -> tuple[list[dict], list[dict], list[dict]]:
    """Training, SFT and held-out evaluation tasks: from the task files where given, else drawn by the
    env's `sample_tasks` (different seeds; any question also in the training or SFT set is dropped
    from evaluation). SFT transcripts are the expert's on the env's own tasks, or on the training
    file's when the env draws none."""
    env = env_factory(cfg)()
    sample = getattr(env, "sample_tasks", None)
    if cfg.train_tasks_file:
        train = load_tasks(cfg.train_tasks_file)
    else:
        train = sample(n_train, seed=cfg.seed) if sample else []  # (none: `train` asks for a file)
    sft = sample(cfg.sft_tasks, seed=cfg.seed + 1) if sample and cfg.sft_steps > 0 else train[: cfg.sft_tasks]
    if cfg.eval_tasks_file:
        return train, sft, load_tasks(cfg.eval_tasks_file)[: cfg.eval_tasks]
    if sample is None:
        return train, sft, []
    seen = {json.dumps({k: v for k, v in t.items() if k != "id"}, sort_keys=True) for t in train + sft}
    held = [t for t in sample(cfg.eval_tasks * 2, seed=cfg.seed + 2)
            if json.dumps({k: v for k, v in t.items() if k != "id"}, sort_keys=True) not in seen]
    return train, sft, held[: cfg.eval_tasks]
