"""What a training run is: its config (`TrainConfig`, the keys of `rollwise train`'s TOML, checked
when read), the environment it makes and what identifies its logged groups (the task sets it draws:
rollwise/rollout/task_sets.py)."""
from __future__ import annotations

import hashlib
import json
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

from rollwise.agent.envs import make_env, resolve_env, taken_options
from rollwise.agent.tools import Latency
from rollwise.config import check_field_types, read_toml
from rollwise.router.policies import POLICIES
from rollwise.rollout.trackers import check_trackers
from rollwise.rollout.producer import turn_params
from rollwise.router.replica import FLEET_WEIGHTS_VIA
from rollwise.trainer.advantages import NO_GROUP
from rollwise.trainer.config import GRPOConfig
from rollwise.trainer.policy import ROUTING_MODES
from rollwise.types import check_cut_off


@dataclass
class TrainConfig:
    model: str  # model directory (Hugging Face format)
    run_dir: str = "runs/rollwise"
    # a built-in environment, or a user's: "package.module:Name" / "path/to/file.py:Name" (an Env class
    # or a function returning one), made with max_turns and tool_latency where it takes them, plus env_options
    env: str = "calculator"
    env_options: dict = field(default_factory=dict)
    # tasks from files (JSON lines, JSON list, Parquet) instead of the env's sample_tasks: the training
    # tasks, cycled in order, and the held-out ones (the first eval_tasks of them)
    train_tasks_file: str | None = None
    eval_tasks_file: str | None = None
    seed: int = 0
    # supervised warm start on the environment's expert transcripts (0 steps: none), or on a file's
    # conversations (`sft_file`: chat messages, or prompt + response; rollwise/trainer/sft_data.py)
    sft_file: str | None = None
    sft_steps: int = 300
    sft_tasks: int = 512
    sft_lr: float = 3e-3
    sft_batch: int = 16
    # share of SFT transcripts in which the demonstrator states the (right) answer at once, without the
    # tools, as a stronger teacher does (a small model imitating that can only guess)
    sft_direct_fraction: float = 0.0
    sft_cache: str | None = None  # directory keeping warm-started weights, keyed by the SFT settings
    # GRPO
    steps: int = 20
    groups_per_step: int = 8
    group_size: int = 8
    lr: float = 1e-4
    # the RL learning rate by step: linear warm-up over lr_warmup_steps, then "constant" or "cosine" (down
    # to min_lr_ratio x lr at the last step); verl's lr_warmup_steps, warmup_style, min_lr_ratio
    lr_warmup_steps: int = 0
    lr_schedule: str = "constant"
    min_lr_ratio: float = 0.0
    clip: float = 0.2
    clip_high: float | None = None  # upper clip 1 + clip_high (DAPO's clip-higher, e.g. 0.28); None: clip
    tis_cap: float = 2.0  # the importance weights' cap (proximal / behaviour: staleness, replica numerics)
    # rollout correction: ratios per "token", "sequence" (their product) or "geometric" (its per-token
    # mean); "truncate" at tis_cap (TIS) or "mask" (MIS: weight 0 outside [is_low, tis_cap]); is_veto > 0
    # drops a sequence with a token ratio under it (rollwise/trainer/correction.py)
    is_level: str = "token"
    is_mode: str = "truncate"
    is_low: float = 0.0
    is_veto: float = 0.0
    kl_coef: float = 0.0
    kl_loss_type: str = "k3"  # k1, k2, k3, abs, or k1+ / k3+ / abs+: that value, k2's gradient (verl's names too)
    # KL in the reward (verl's use_kl_in_reward): each generated token's reward less beta x its KL (k1) to
    # the reference, the warm-started policy or reference_model (a teacher: on-policy distillation); beta
    # starts at reward_kl_coef (0: off), adapts toward reward_kl_target > 0 over reward_kl_horizon episodes
    reward_kl_coef: float = 0.0
    reward_kl_target: float = 0.0
    reward_kl_horizon: int = 10000
    reference_model: str | None = None
    # DAPO's overlong punishment (rollwise/trainer/shaping.py; verl's overlong_buffer): a turn that generates
    # more than max_tokens - overlong_buffer tokens loses up to overlong_penalty of its episode's reward,
    # linearly (all of it at max_tokens); 0: off
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    dual_clip: float = 3.0  # "ppo": a negative advantage's token loss at most this x |A| (clip_ratio_c); 0: off
    entropy_coef: float = 0.0  # an entropy bonus: the loss less this times each token's entropy
    # LoRA (peft's layers): 0 trains every weight; r > 0 freezes them after the warm start and trains
    # rank-r adapters on `lora_targets` ("all-linear": every linear but the output head, or a list of
    # module names such as ["q_proj", "v_proj"]), scaled by lora_alpha / r. The replicas get the merged
    # linears alone (or the adapter: lora_sync); the run saves the merged model and the adapter (peft's format). Needs a higher lr
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: str | list[str] = "all-linear"
    # what the replicas get each step with LoRA: "merged" (the adapted linears with their adapters merged
    # in) or "adapter" (the adapter alone, served on the warm-start weights they hold: vLLM's way for
    # LoRA RL; `rollwise serve` replicas need --enable-lora and a --max-lora-rank of at least lora_rank)
    lora_sync: str = "merged"
    loss_agg: str = "token"  # or "sequence", "constant" (rollwise/trainer/losses.py)
    loss_scale_tokens: int = 0  # "constant": each trajectory's token sum over it (0: max_tokens x max_turns)
    # MoE models (qwen3_moe): "replay" takes each token through the experts the rollout routed it to
    # (Rollout Routing Replay: replicas return every token's experts, the trainer's routers use them,
    # weighted by their own probabilities); "record" only reports how often the trainer's routers choose
    # otherwise (step metric routing_mismatch); "off". HTTP replicas need --enable-return-routed-experts
    routing_replay: str = "off"
    # "grpo" (group mean and std), "dr_grpo" (group mean only), "rloo" (the mean of the group's others),
    # "opo" (the mean weighted by generated tokens), "grpo_passk" (the best episode alone, over the second),
    # "remax" (the reward of one more episode per group, run greedily and not trained on; group_size may be 1),
    # "gigpo" (grpo's plus, per turn, step_advantage_weight x its gamma-discounted return against those of
    # the group's turns from the same state: what the model read before them; rollwise/trainer/advantages.py)
    # "gae" (PPO's: a critic, the policy's decoder and a value head, and GAE per generated token with
    # gae_gamma and gae_lambda, whitened over the batch; group_size may be 1; rollwise/trainer/critic.py),
    # "reinforce_plus_plus" (per token, the gae_gamma-discounted return to go, whitened over the batch; no
    # critic; group_size may be 1) or "reinforce_plus_plus_baseline" (the reward less the group's mean,
    # whitened over the batch)
    advantage: str = "grpo"
    step_advantage_weight: float = 1.0
    gamma: float = 0.95
    gigpo_mode: str = "mean_std_norm"  # or "mean_norm" (verl-agent's modes: divided by the group's std or not)
    gigpo_similarity: float = 1.0  # < 1: turns from states whose tokens are that similar share a step group
    gae_gamma: float = 1.0
    gae_lambda: float = 1.0
    critic_lr: float | None = None  # None: 10 x lr (verl's defaults: 1e-6 and 1e-5)
    value_clip: float = 0.5  # the most a step moves a value from the one its advantages used
    critic_warmup: int = 0  # the first steps train the critic alone
    critic_model: str = ""  # the critic's model directory (another size, same tokenizer); "": the warm start
    # the critic trains LoRA adapters (lora_rank, lora_alpha, lora_targets) and its head on the policy's frozen
    # base weights, shared: no second copy of the model (needs lora_rank > 0; verl's critic lora_rank)
    critic_lora: bool = False
    # the trainer's and the SFT's micro-batches: padded tokens (rows x the longest) per forward and backward
    # (verl's ppo_max_token_len_per_gpu); gradient_checkpointing recomputes each decoder layer in the backward
    # (verl's enable_gradient_checkpointing): its inputs alone kept, for a third more compute (SFT, policy, critic)
    micro_batch_tokens: int = 8192
    gradient_checkpointing: bool = False
    # the output head over the vocabulary at most this many generated positions at a time, each chunk's logits
    # recomputed in the backward (0: all at once): a real vocabulary's logits are the largest tensors (policy.py)
    logit_chunk_tokens: int = 4096
    # "ppo" (token ratios, clipped), "gspo" (sequence ratios: set clip = 3e-4, clip_high = 4e-4,
    # loss_agg = "sequence"), "cispo" (clipped, stopped ratios as weights: clip_high large), "clip_cov" or
    # "kl_cov" (PPO, or the unclipped gradient, holding back the tokens whose logprob and advantage covary
    # most: entropy kept up), "gmpo" (the geometric mean of token ratios clipped each), "gpg" (-A x logprob, no
    # ratio: on-policy batches), "sapo" (a sigmoid gate of each ratio for the clip; rollwise.trainer.losses)
    policy_loss: str = "ppo"
    sapo_tau_pos: float = 1.0  # sapo: the gate's temperature under a positive advantage, and a negative one
    sapo_tau_neg: float = 1.05
    cov_fraction: float = 2e-4  # clip_cov / kl_cov: the share of a micro-batch's tokens held back
    clip_cov_lb: float = 1.0  # clip_cov: the covariance range its tokens are drawn from
    clip_cov_ub: float = 5.0
    kl_cov_coef: float = 1.0  # kl_cov: the |logprob - proximal| penalty's coefficient
    epochs: int = 1  # optimizer steps over each batch (PPO epochs; from the second, ratios move off 1)
    mini_batches: int = 1  # optimizer steps per epoch, each on a part of the batch (verl's ppo_mini_batch_size)
    # episodes cut off by a limit carry no loss (DAPO's overlong filtering): any of "max_turns",
    # "max_context", "timeout", "error"
    exclude_statuses: list[str] = field(default_factory=list)
    # an episode that ends with one of these statuses (default: an environment or agent that raised), or whose
    # turn no replica could serve, runs again from the start (a fresh env, another seed), at most episode_retries
    # times; the last attempt stands (an error says nothing about the policy: reward 0 would teach the others)
    episode_retries: int = 2
    retry_statuses: list[str] = field(default_factory=lambda: ["error"])
    temperature: float = 1.0
    max_tokens: int = 64  # per turn
    # vLLM's repetition_detection for every turn ({"max_pattern_size", "min_pattern_size", "min_count"}):
    # a reply caught in a loop ends there (finish_reason "repetition"), not at max_tokens
    repetition_detection: dict | None = None
    # vLLM's thinking_token_budget for every turn: a think block this long is closed (the engine's
    # reasoning_end_str forced), so a thinking model answers within max_tokens
    thinking_token_budget: int | None = None
    max_turns: int = 4
    max_staleness: int = 1  # 0: synchronous (on-policy); k: rollouts up to k versions ahead
    # DAPO's dynamic sampling: a group whose episodes all got the same reward has zero advantage and teaches
    # nothing (gigpo: unless a turn's step advantage is not 0); skip it (logged, not trained on) and take another
    # in its place, at most max_skipped_groups per step (0: 4 x groups_per_step), then train on what comes
    dynamic_sampling: bool = False
    max_skipped_groups: int = 0
    # GRESO's pre-rollout filter: a task whose last z groups in a row taught nothing (every episode the same
    # reward) is skipped before its next group runs, with probability 1 - pre_rollout_explore^z (at most 0.95), so no
    # rollouts are spent on tasks the policy always or never solves, yet each is tried now and then
    # (1: off; e.g. 0.5; rollwise/rollout/producer.py)
    pre_rollout_explore: float = 1.0
    # GRESO's adaptive explore: the share of a step's groups that may teach nothing (e.g. 0.25; 0: explore fixed);
    # tasks last solved by every episode and by none each get a probability, from pre_rollout_explore, moved
    # 0.01 a step toward a third of that share for the first and two thirds for the second
    pre_rollout_target: float = 0.0
    # turns in flight at a weight update: finish under the old weights (False; replicas hold both
    # versions meanwhile) or are interrupted and continue under the new ones (True: recomputed,
    # tokens and logprobs kept, each token labelled with its version)
    partial_rollout: bool = False
    # reproducible run: each batch generated under one version, its groups pinned to it (lockstep
    # pipeline; `rollwise serve` replicas then need --keep-weight-versions max_staleness + 1), and
    # behaviour logprobs recomputed by the trainer (its step is slower)
    deterministic: bool = False
    # the trainer takes groups as they complete and runs their forward and backward while the rest of
    # the batch is generating (the optimizer step still waits for the whole batch); False: the whole
    # batch at once when it is complete. Deterministic runs train whole batches (streamed micro-batches
    # would depend on arrival timing).
    stream_trainer: bool = True
    # the whitened advantages (gae, reinforce_plus_plus[_baseline]) are known only with the batch's last
    # group, so their policy pass waits for it (False), or (True) each group's runs as it arrives, the loss
    # at its advantages and at 1 backpropagated apart and combined at the end (exact: the first pass is
    # linear in them), for a second backward per micro-batch and two gradient-sized buffers. Worth it when
    # the trainer's work is shorter than the batch's rollouts: REINFORCE++-baseline 1.10-1.16x per step
    # here; gae, whose critic already fills that time, 0.91-1.01x (README, Results)
    stream_whitened: bool = False
    max_concurrent_groups: int = 16
    episode_deadline_s: float = 60.0
    tool_latency: tuple[float, float] = (0.0, 0.0)  # seconds per tool call (simulated APIs): lo, hi
    tool_latency_kind: str = "uniform"  # or "lognormal" (median (lo+hi)/2 above lo, heavy tail to 4*hi)
    # rollout fleet
    replicas: int = 2  # in-process engines (ignored when replica_urls is set)
    # torch threads of each in-process replica and of the trainer; 0: the machine's cores split between
    # them (replicas and trainer run at once: more threads than cores slows both)
    replica_threads: int = 0
    trainer_threads: int = 0
    # data-parallel training (verl's data-parallel ranks; rollwise/trainer/data_parallel.py): the trainer on
    # this many processes, each with the whole model, training its share of every step's groups, gradients
    # summed over them before each update (gloo on 127.0.0.1); trainer_threads are split between them
    trainer_processes: int = 1
    # the trainer in processes of its own, rank 0 too (AReaL's split): this process keeps the rollouts,
    # agents and in-process replicas, and reads the weights rank 0 trains from shared memory, so its
    # Python (and GIL) no longer shares a step with the trainer's
    trainer_apart: bool = False
    replica_dtype: str = "float32"  # in-process replicas' weights: "bfloat16" as most RL rollouts run
    # in-process replicas batch-invariant (EngineConfig.batch_invariant): a turn's tokens and logprobs
    # do not depend on what it was batched with, so a deterministic run repeats bit for bit however
    # it is timed, with any number of replicas (fp32 replicas only)
    replica_batch_invariant: bool = False
    # sleep mode while the trainer trains (verl's colocated hybrid engine): 1, the replicas give back their KV
    # pools; 2, their weights too (each update then sends every weight). Synchronous, unstreamed runs only
    replica_sleep: int = 0
    # true on-policy: the trainer values every logprob with the engine's batch-invariant kernels, so
    # its logprobs of fresh samples are the rollout's bit for bit (an on-policy ratio is exactly 1;
    # the gradients are transformers'), and the check of fresh samples asks for equality. Needs
    # replica_batch_invariant (or replica_urls of servers started with --batch-invariant)
    true_on_policy: bool = False
    # mean |trainer - rollout| logprob allowed on fresh samples (a replica on other weights stops the
    # step); bf16 replicas against the fp32 trainer need more
    logprob_tolerance: float = 0.02
    replica_urls: list[str] = field(default_factory=list)  # `rollwise serve` replicas instead
    # their bearer key (servers off loopback take weight updates only with one); default: $ROLLWISE_API_KEY
    replica_api_key: str | None = None
    # "stream" (in the request), "file" (shared file system), "auto" (file on loopback), "broadcast" (broadcast.py)
    replica_weights_via: str = "auto"
    routing_policy: str = "rollwise"
    speculative: str | None = "suffix"
    spec_controller: str = "adaptive"
    max_num_seqs: int = 128
    replica_kv_cache_gb: float = 1.0  # each in-process replica's KV pool (its memory is taken as blocks are first used)
    # evaluation on held-out tasks, before and after RL (sampled at `temperature`, and greedy)
    eval_tasks: int = 200
    # and every eval_every steps during it (sampled; metric eval_success, drawn on the curves). 0: not
    eval_every: int = 0
    # the model in Hugging Face format (LoRA merged) every save_every steps, as RUN_DIR/models/step-N (a
    # model directory for `rollwise eval --set model=...` or serving); the last keep_saved of them (0: all)
    save_every: int = 0
    keep_saved: int = 0
    progress: bool = True
    # experiment trackers for the step metrics, beside steps.jsonl: "tensorboard" (RUN_DIR/tensorboard)
    # and / or "wandb", each its own package (pip install tensorboard / wandb)
    loggers: list[str] = field(default_factory=list)
    tracker_project: str = "rollwise"  # the W&B project; the run is named after run_dir

    def trainer_config(self) -> GRPOConfig:
        """The trainer's settings for this run."""
        # a deterministic run recomputes behaviour logprobs so the replicas' rounding never reaches the loss;
        # true on-policy replicas' logprobs are already the trainer's, bit for bit, under every version
        behaviour = "recompute" if self.deterministic and not self.true_on_policy else "rollout"
        own = dict(total_steps=self.steps, behaviour=behaviour, keep_versions=self.max_staleness,
                   loss_scale_tokens=self.loss_scale_tokens or self.max_tokens * self.max_turns,
                   exclude_statuses=tuple(self.exclude_statuses), overlong_max_tokens=self.max_tokens,
                   logprob_tolerance=0.0 if self.true_on_policy else self.logprob_tolerance)
        same = {f.name for f in fields(GRPOConfig)} & {f.name for f in fields(TrainConfig)} - set(own)
        return GRPOConfig(**{k: getattr(self, k) for k in same}, **own)

    @property
    def streamed(self) -> bool:
        """Whether the trainer takes groups as they complete (see `stream_trainer`)."""
        return self.stream_trainer and not self.deterministic

    @property
    def weight_versions(self) -> int:
        """Weight versions a replica must hold at once: a lockstep run pins groups to versions up to
        `max_staleness` old; otherwise turns in flight at an update finish under the old weights."""
        return self.max_staleness + 1 if self.deterministic else 1

    @staticmethod
    def from_toml(path: str | Path, **overrides) -> TrainConfig:
        return TrainConfig.from_dict({**read_toml(path), **overrides})

    @staticmethod
    def from_dict(d: dict) -> TrainConfig:
        names = {f.name for f in fields(TrainConfig)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown config keys {unknown}; valid: {sorted(names)}")
        missing = [f.name for f in fields(TrainConfig) if f.name not in d
                   and f.default is MISSING and f.default_factory is MISSING]
        if missing:
            raise ValueError(f"the config needs {missing} (e.g. --set model=DIR: a model directory)")
        check_field_types(TrainConfig, d)
        if "tool_latency" in d:
            d = {**d, "tool_latency": tuple(d["tool_latency"])}
        cfg = TrainConfig(**d)
        resolve_env(cfg.env)  # a ValueError naming the built-ins, or why a user's env does not load
        cfg.trainer_config().check()  # the trainer's settings (policy loss, advantage, correction, critic ...)
        turn_params(cfg, 1.0, None)  # (repetition_detection and thinking_token_budget: a ValueError naming them)
        if not 0.0 <= cfg.gamma <= 1.0 or cfg.step_advantage_weight < 0:
            raise ValueError(f"need 0 <= gamma <= 1 and step_advantage_weight >= 0, got {cfg.gamma}, "
                             f"{cfg.step_advantage_weight}")
        if cfg.routing_policy not in POLICIES:
            raise ValueError(f"unknown routing_policy {cfg.routing_policy!r}; available: {sorted(POLICIES)}")
        if cfg.deterministic and cfg.dynamic_sampling:
            raise ValueError("dynamic_sampling cannot be deterministic: a lockstep batch is a fixed set of groups")
        if cfg.deterministic and cfg.partial_rollout:
            raise ValueError("partial_rollout does nothing in a deterministic run (every turn is pinned to its "
                             "group's version); set one of them")
        if cfg.replica_weights_via not in FLEET_WEIGHTS_VIA:
            raise ValueError(f"replica_weights_via must be one of {FLEET_WEIGHTS_VIA}, got {cfg.replica_weights_via!r}")
        if cfg.tool_latency_kind not in ("uniform", "lognormal"):
            raise ValueError(f"tool_latency_kind must be 'uniform' or 'lognormal', got {cfg.tool_latency_kind!r}")
        if cfg.advantage in NO_GROUP and cfg.dynamic_sampling:
            raise ValueError(f"dynamic_sampling skips groups whose rewards are all equal, but {cfg.advantage} "
                             "trains them too (its advantages do not cancel in a group): set one of them")
        if cfg.advantage in NO_GROUP and (cfg.pre_rollout_explore < 1 or cfg.pre_rollout_target > 0):
            raise ValueError(f"pre_rollout_explore skips tasks whose groups' rewards were all equal, but "
                             f"{cfg.advantage} trains such groups too: leave it at 1 (and pre_rollout_target at 0)")
        smallest = 1 if cfg.advantage in NO_GROUP + ("remax",) else 2  # a group-relative advantage needs two
        if cfg.max_staleness < 0 or cfg.steps < 0 or cfg.groups_per_step < 1 or cfg.group_size < smallest:
            raise ValueError(f"need max_staleness >= 0, steps >= 0, groups_per_step >= 1, group_size >= {smallest} "
                             f"(advantage {cfg.advantage!r})")
        check_cut_off("retry_statuses", cfg.retry_statuses)
        if cfg.episode_retries < 0:
            raise ValueError(f"episode_retries must be >= 0, got {cfg.episode_retries}")
        if not 0 < cfg.pre_rollout_explore <= 1:
            raise ValueError(f"pre_rollout_explore must be in (0, 1] (1: never skip), got {cfg.pre_rollout_explore}")
        if not 0 <= cfg.pre_rollout_target < 1:
            raise ValueError(f"pre_rollout_target must be in [0, 1) (0: a fixed explore), got {cfg.pre_rollout_target}")
        if cfg.max_skipped_groups < 0:
            raise ValueError(f"max_skipped_groups must be >= 0 (0: 4 x groups_per_step), got {cfg.max_skipped_groups}")
        if cfg.save_every < 0 or cfg.keep_saved < 0:
            raise ValueError(f"save_every and keep_saved must be >= 0 (0: never, all), got {cfg.save_every}, "
                             f"{cfg.keep_saved}")
        if cfg.eval_every < 0:
            raise ValueError(f"eval_every must be >= 0 (0: evaluate before and after RL only), got {cfg.eval_every}")
        if cfg.critic_lora and (not cfg.lora_rank or cfg.critic_model):
            raise ValueError("critic_lora trains adapters on the policy's frozen base weights, shared: it needs "
                             "lora_rank > 0 and no critic_model")
        if cfg.lora_rank < 0 or cfg.lora_alpha <= 0:
            raise ValueError(f"need lora_rank >= 0 (0: no LoRA) and lora_alpha > 0, got {cfg.lora_rank}, {cfg.lora_alpha}")
        check_trackers(cfg.loggers)
        if cfg.lora_sync not in ("merged", "adapter"):
            raise ValueError(f"lora_sync must be 'merged' or 'adapter', got {cfg.lora_sync!r}")
        if cfg.lora_sync == "adapter" and not cfg.lora_rank:
            raise ValueError("lora_sync = 'adapter' needs LoRA: set lora_rank")
        if cfg.routing_replay not in ROUTING_MODES:
            raise ValueError(f"unknown routing_replay {cfg.routing_replay!r}; valid: {list(ROUTING_MODES)}")
        if cfg.routing_replay == "replay" and cfg.gradient_checkpointing:
            raise ValueError("routing_replay = 'replay' does not work with gradient_checkpointing: the layers "
                             "replayed in the backward would route by the trainer's own router (use 'record')")
        if cfg.replica_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"replica_dtype must be 'float32' or 'bfloat16', got {cfg.replica_dtype!r}")
        if cfg.replica_batch_invariant and cfg.replica_dtype != "float32":
            raise ValueError("replica_batch_invariant needs replica_dtype = 'float32'")
        if cfg.true_on_policy and not (cfg.replica_batch_invariant or cfg.replica_urls):
            raise ValueError("true_on_policy needs replica_batch_invariant = true (or replica_urls of servers "
                             "started with --batch-invariant)")
        if cfg.replica_kv_cache_gb <= 0:
            raise ValueError(f"replica_kv_cache_gb must be > 0, got {cfg.replica_kv_cache_gb}")
        if cfg.replica_threads < 0 or cfg.trainer_threads < 0:
            raise ValueError("replica_threads and trainer_threads must be >= 0 (0: split the cores)")
        if cfg.logit_chunk_tokens < 0:
            raise ValueError(f"logit_chunk_tokens must be >= 0 (0: no chunks), got {cfg.logit_chunk_tokens}")
        if cfg.replica_sleep not in (0, 1, 2) or cfg.replica_sleep and (cfg.max_staleness or cfg.streamed):
            raise ValueError(f"replica_sleep is 0, 1 (KV pools) or 2 (and weights), and replicas sleep while no "
                             f"rollout runs: max_staleness = 0 and stream_trainer = false; got {cfg.replica_sleep}, "
                             f"{cfg.max_staleness}, {cfg.stream_trainer}")
        if cfg.replica_sleep == 2 and cfg.lora_sync == "adapter":
            raise ValueError("replica_sleep = 2 gives the weights back; lora_sync = 'adapter' sends the adapter alone")
        if cfg.trainer_processes < 1:
            raise ValueError(f"trainer_processes must be >= 1, got {cfg.trainer_processes}")
        return cfg


def env_options(cfg: TrainConfig, user: bool = True) -> dict:
    """The run's env options; without its `user` for `user = False` (the expert's transcripts for
    the warm start, and their cache's key: the expert solves the task, with no one to talk to)."""
    return {k: v for k, v in cfg.env_options.items() if user or k != "user"}


def env_factory(cfg: TrainConfig, user: bool = True):
    """What makes the run's env (`env_options(cfg, user)`)."""
    lo, hi = cfg.tool_latency
    lat = Latency(lo, hi, kind=cfg.tool_latency_kind, cap=4 * hi) if hi > 0 else None
    standard = taken_options(resolve_env(cfg.env), {"max_turns": cfg.max_turns, "tool_latency": lat})
    options = {**standard, **env_options(cfg, user)}
    return lambda: make_env(cfg.env, **options)


def run_identity(cfg: TrainConfig) -> dict:
    """What a run's logged groups and data cursor are of: a resumed run must match it (steps, lr and
    the like may change on resume; the tasks and the environment may not; the weights are the checkpoint's)."""
    tasks = cfg.train_tasks_file and hashlib.sha256(Path(cfg.train_tasks_file).read_bytes()).hexdigest()[:16]
    return {"env": cfg.env, "env_options": json.dumps(
        cfg.env_options, sort_keys=True, default=str), "train_tasks_file": tasks, "seed": cfg.seed,
        "group_size": cfg.group_size}
