"""The trainer of a training run (rl.py): the policy as the run loads it, and the trainer on it, in
this process or in a data-parallel group of `trainer_processes` (rollwise/trainer/data_parallel.py)."""
from __future__ import annotations

from rollwise.rl_config import TrainConfig
from rollwise.rollout.fleet import threads


def make_policy(cfg: TrainConfig):
    """The policy as the run loads it, before its warm start."""
    from rollwise.trainer.policy import PolicyModel
    policy = PolicyModel(cfg.model, seed=cfg.seed)
    policy.routing = cfg.routing_replay
    policy.head_chunk = cfg.logit_chunk_tokens
    if cfg.gradient_checkpointing:
        policy.enable_checkpointing()
    if cfg.true_on_policy:
        policy.enable_exact(adapter=cfg.lora_sync == "adapter")
    return policy


def make_trainer(cfg: TrainConfig, policy):
    """The run's trainer on the warm-started `policy`: with trainer_processes > 1, rank 0 of a
    data-parallel group whose other ranks start here (rollwise/trainer/data_parallel.py), each on
    its share of the trainer's threads, and take these weights."""
    from rollwise.trainer.grpo import GRPOTrainer
    if cfg.trainer_apart:  # every rank a process of its own; rank 0 trains these weights in place
        from rollwise.trainer.data_parallel import share_weights, start_apart
        shared = share_weights(policy.model)
        policy.exact = None  # (its values are the trainer's to compute)
        return start_apart(cfg.trainer_processes, trainer_rank, (cfg,), rank_threads(cfg), shared)
    if cfg.trainer_processes == 1:
        return GRPOTrainer(policy, cfg.trainer_config())
    from rollwise.trainer.data_parallel import DataParallelTrainer, start
    comm, workers = start(cfg.trainer_processes, trainer_rank, (cfg,), rank_threads(cfg))
    comm.broadcast_params(policy.model)
    return DataParallelTrainer(GRPOTrainer(policy, cfg.trainer_config(), comm), comm, workers)


def trainer_rank(comm, cfg: TrainConfig, shared: tuple | None = None):
    """A worker rank's trainer: the policy loaded as rank 0's was, then rank 0's weights (`shared`:
    this is rank 0 of a trainer apart, and they are the run's, in shared memory)."""
    from rollwise.trainer.data_parallel import adopt_weights
    from rollwise.trainer.grpo import GRPOTrainer
    policy = make_policy(cfg)
    add_lora(cfg, policy)
    if shared is not None:
        adopt_weights(policy.model, shared)
    comm.broadcast_params(policy.model)
    return GRPOTrainer(policy, cfg.trainer_config(), comm)


def rank_threads(cfg: TrainConfig) -> int:
    """Each trainer process's torch threads: the trainer's, split between its processes."""
    return max(1, threads(cfg)[1] // cfg.trainer_processes)


def add_lora(cfg: TrainConfig, policy) -> None:
    if cfg.lora_rank:
        policy.add_lora(cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets)
