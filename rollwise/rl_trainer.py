"""The trainer of a training run (rl.py): the policy as the run loads it, and the trainer on it, in
this process or in a data-parallel group of `trainer_processes` (rollwise/trainer/data_parallel.py)."""
from __future__ import annotations

from rollwise.rl_config import TrainConfig
from rollwise.rollout.fleet import cores, threads


def make_policy(cfg: TrainConfig, trains: bool = True, load: bool = True):
    """The policy as the run loads it, before its warm start. `trains` False: the run's process of a
    trainer apart, which reads the weights and computes no logprobs (no engine model for exact ones).
    `load` False: without its weights, which a worker rank takes from rank 0."""
    from rollwise.trainer.policy import PolicyModel
    policy = PolicyModel(cfg.model, seed=cfg.seed, load=load)
    policy.routing = cfg.routing_replay
    policy.head_chunk = cfg.logit_chunk_tokens
    if cfg.gradient_checkpointing:
        policy.enable_checkpointing()
    if cfg.true_on_policy and trains:
        policy.enable_exact(adapter=cfg.lora_sync == "adapter")
    return policy


def make_trainer(cfg: TrainConfig, policy):
    """The run's trainer on the warm-started `policy` (LoRA added here, as `cfg` says): with
    trainer_processes > 1, rank 0 of a data-parallel group whose other ranks start here
    (rollwise/trainer/data_parallel.py), each on its share of the trainer's threads, and take these
    weights; with trainer_apart, every rank in a process of its own."""
    return TrainerRanks(cfg, policy).trainer()


class TrainerRanks:
    """The run's trainer ranks, started before the warm start so that it runs on them too: `sft`
    warm-starts `policy` (data-parallel over the ranks, apart or here), then `trainer()` builds the
    trainer on every rank (the KL reference, if any, is the warm-started model). `close()` if the
    warm start fails."""

    def __init__(self, cfg: TrainConfig, policy) -> None:
        from rollwise.trainer.data_parallel import Comm, DataParallelTrainer, share_weights, start, start_apart
        self.cfg, self.policy, self.apart = cfg, policy, cfg.trainer_apart
        if cfg.trainer_apart:  # every rank a process of its own; rank 0 trains these weights in place
            shared = share_weights(policy.model)
            policy.exact = None  # (its values are the trainer's to compute: `make_policy(cfg, trains=False)`)
            self.ranks = start_apart(cfg.trainer_processes, trainer_rank, (cfg,), rank_threads(cfg), shared)
        elif cfg.trainer_processes > 1:
            comm, workers = start(cfg.trainer_processes, trainer_rank, (cfg,), rank_threads(cfg))
            self.ranks = DataParallelTrainer(Rank(comm, cfg, policy), comm, workers)
        else:
            self.ranks = Rank(Comm(), cfg, policy)

    def sft(self, demos: list, progress=None) -> list[float]:
        """The SFT warm start (`cfg.sft_*`) on every rank; the loss per step."""
        cfg = self.cfg
        self.ranks.sft_begin(demos, dict(steps=cfg.sft_steps, lr=cfg.sft_lr, batch_size=cfg.sft_batch, seed=cfg.seed,
                                         micro_batch_tokens=cfg.micro_batch_tokens))
        losses = []
        for s in range(cfg.sft_steps):
            losses.append(self.ranks.sft_step())
            if progress is not None:
                progress(s, losses[-1])
        return losses

    def trainer(self):
        """Every rank's trainer on its (warm-started) policy, with LoRA added as `cfg` says."""
        from rollwise.trainer.data_parallel import share_weights
        add_lora(self.cfg, self.policy)
        # apart with LoRA: the adapters join the weights rank 0 trains in shared memory
        shared = share_weights(self.policy.model) if self.apart and self.cfg.lora_rank else None
        return self.ranks.become(shared)

    def close(self) -> None:
        if not isinstance(self.ranks, Rank):
            self.ranks.close()


class Rank:
    """A trainer rank before its trainer: its policy, warm-started (`sft_begin`, `sft_step`), then
    `become()` its trainer. A worker's own policy starts as rank 0's weights."""
    version, critic = 0, None  # (as a trainer's, for the worker's replies and fingerprints)

    def __init__(self, comm, cfg: TrainConfig, policy) -> None:
        self.comm, self.cfg, self.policy = comm, cfg, policy
        self.warm, self.threads = None, None  # (the SFT's, and the torch threads to go back to after it)
        comm.broadcast_params(policy.model)

    def sft_begin(self, demos: list, options: dict) -> None:
        """Nothing else runs meanwhile: the cores split between the ranks, set explicitly on every rank
        (MKL rounds otherwise after an explicit count than by default, so the warm start is the same
        bits in the run's process and apart, whatever the process set before)."""
        import torch

        from rollwise.trainer.sft import SFT
        self.threads = torch.get_num_threads()
        torch.set_num_threads(max(1, cores() // self.comm.world))
        self.warm = SFT(self.policy, demos, comm=self.comm, **options)

    def sft_step(self) -> float:
        return self.warm.step()

    def become(self, shared: tuple | None = None):
        """This rank's trainer (`shared`: the run's weights with their adapters, for rank 0 apart)."""
        import torch

        from rollwise.trainer.data_parallel import adopt_weights
        from rollwise.trainer.grpo import GRPOTrainer
        self.warm = None
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        if self.policy.lora is None:
            add_lora(self.cfg, self.policy)
        if shared is not None and self.comm.rank == 0:
            adopt_weights(self.policy.model, shared)
        self.comm.broadcast_params(self.policy.model)  # (a warm start the run loaded from its cache)
        return GRPOTrainer(self.policy, self.cfg.trainer_config(), self.comm)


def trainer_rank(comm, cfg: TrainConfig, shared: tuple | None = None) -> Rank:
    """A worker rank: the policy built as rank 0's was, then rank 0's weights (`shared`: this is rank
    0 of a trainer apart, and they are the run's, in shared memory; else broadcast by rank 0)."""
    from rollwise.trainer.data_parallel import adopt_weights
    policy = make_policy(cfg, load=False)  # (not read from disk again: rank 0's weights come next)
    if shared is not None:
        adopt_weights(policy.model, shared)
    return Rank(comm, cfg, policy)


def rank_threads(cfg: TrainConfig) -> int:
    """Each trainer process's torch threads: the trainer's, split between its processes."""
    return max(1, threads(cfg)[1] // cfg.trainer_processes)


def add_lora(cfg: TrainConfig, policy) -> None:
    if cfg.lora_rank:
        policy.add_lora(cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets)
