"""The trainer's settings (`GRPOTrainer`, grpo.py; each documented there and in the modules it names:
advantages.py, critic.py, losses.py, correction.py, schedule.py)."""
from __future__ import annotations

from dataclasses import dataclass

from rollwise.trainer.advantages import ADVANTAGES, check_gigpo
from rollwise.trainer.correction import check as check_correction
from rollwise.trainer.critic import check as check_critic
from rollwise.trainer.kl_reward import check as check_reward_kl
from rollwise.trainer.losses import LOSS_AGG_ALIASES, POLICY_LOSSES, check as check_loss
from rollwise.trainer.schedule import check as check_schedule
from rollwise.trainer.shaping import check as check_overlong
from rollwise.types import check_cut_off


@dataclass
class GRPOConfig:
    lr: float = 1e-4
    lr_warmup_steps: int = 0  # the learning rate by step (schedule.py): linear warm-up, then
    lr_schedule: str = "constant"  # "constant" or "cosine" (down to min_lr_ratio x lr at total_steps)
    min_lr_ratio: float = 0.0
    total_steps: int = 0
    weight_decay: float = 0.0
    clip: float = 0.2
    clip_high: float | None = None  # the upper clip, 1 + clip_high (DAPO's clip-higher); None: `clip`
    # dual-clip PPO (Ye et al. 2020; verl's clip_ratio_c, default 3): with a negative advantage, a token's
    # loss is at most dual_clip x |A| however far its ratio went up (a stale sample); 0: off
    dual_clip: float = 3.0
    tis_cap: float = 2.0
    # rollout correction (correction.py): "token" / "sequence" / "geometric" ratios, "truncate" / "mask"
    is_level: str = "token"
    is_mode: str = "truncate"
    is_low: float = 0.0  # "mask": the lower bound of the kept ratios
    is_veto: float = 0.0  # > 0: a sequence with a token ratio under it carries no loss
    kl_coef: float = 0.0
    kl_loss_type: str = "k3"  # the KL loss's estimator (losses.py KL_ESTIMATORS; verl's kl_loss_type)
    # KL in the reward (kl_reward.py; verl's use_kl_in_reward): each generated token's reward less beta x its
    # k1 KL to the reference; beta starts at reward_kl_coef (0: off), adapted toward a per-token KL of
    # reward_kl_target when > 0 (horizon reward_kl_horizon episodes), else fixed
    reward_kl_coef: float = 0.0
    reward_kl_target: float = 0.0
    reward_kl_horizon: int = 10000
    # the KL reference: a model directory (a teacher of any size on the same vocabulary) in place of the
    # policy as it starts; with reward_kl_coef it is on-policy distillation (snapshots.py)
    reference_model: str | None = None
    # DAPO's overlong punishment (shaping.py; verl's overlong_buffer): a turn longer than overlong_max_tokens -
    # overlong_buffer tokens loses up to overlong_penalty of the reward, linearly; 0: off
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    overlong_max_tokens: int = 0  # the most tokens a turn may generate (the run's max_tokens)
    entropy_coef: float = 0.0  # the loss less this times each token's entropy (verl's entropy_coeff)
    # or "dr_grpo", "rloo", "gigpo", "opo", "grpo_passk", "remax", "gae", "reinforce_plus_plus[_baseline]"
    advantage: str = "grpo"
    step_advantage_weight: float = 1.0  # gigpo: the step advantage's weight beside the episode's
    gamma: float = 0.95  # gigpo: the discount of the turn returns its step groups compare
    gigpo_mode: str = "mean_std_norm"  # gigpo: or "mean_norm" (advantages not divided by their group's std)
    gigpo_similarity: float = 1.0  # gigpo: < 1: states whose tokens are that similar share a step group
    gae_gamma: float = 1.0  # gae, reinforce_plus_plus: the discount per generated token
    gae_lambda: float = 1.0  # gae: lambda (1: the returns less the values; 0: one-step TD errors)
    critic_lr: float | None = None  # gae: the critic's AdamW learning rate (None: 10 x lr, as verl's defaults)
    value_clip: float = 0.5  # gae: how far a step may move a value from the one the advantages used
    critic_warmup: int = 0  # gae: the first steps train the critic alone (the policy keeps its weights)
    critic_model: str = ""  # gae: the critic's model directory ("": the policy's weights as they are at the start)
    critic_lora: bool = False  # gae: LoRA adapters on the policy's frozen base, shared (a LoRA policy's)
    # whitened estimators, streamed: each group's first pass as it arrives, its gradients whitened at the end
    # (two more gradient-sized buffers and a second backward per micro-batch); False: the pass waits for the batch
    stream_whitened: bool = False
    max_grad_norm: float = 1.0
    temperature: float = 1.0  # the rollouts' sampling temperature
    micro_batch_tokens: int = 8192
    epochs: int = 1  # passes over each batch (PPO epochs)
    # optimizer steps per epoch, each on a part of the batch's micro-batches (verl's ppo_mini_batch_size as
    # a count); > 1: the first pass only computes the proximal logprobs, every update runs in `finish`
    mini_batches: int = 1
    logprob_tolerance: float = 0.02  # mean |trainer - rollout| logprob allowed on fresh samples
    # "token": mean over all generated tokens; "sequence": per trajectory, then mean; "constant": each
    # trajectory's token sum over loss_scale_tokens, then mean (Dr. GRPO's, verl's seq-mean-token-sum-norm:
    # no length normalisation, so a long wrong answer is not penalised less per token than a short one);
    # verl's names too: token-mean, seq-mean-token-mean, seq-mean-token-sum-norm, seq-mean-token-sum (over 1)
    loss_agg: str = "token"
    loss_scale_tokens: int = 0  # "constant": the divisor (e.g. the most tokens an episode may generate)
    policy_loss: str = "ppo"  # or "gspo", "cispo", "clip_cov", "kl_cov", "gmpo", "gpg", "sapo" (`POLICY_LOSSES`)
    sapo_tau_pos: float = 1.0  # sapo: its gate's temperature under a positive advantage, and a negative one
    sapo_tau_neg: float = 1.05  # (verl's tau_pos, tau_neg)
    # clip_cov / kl_cov: the share of a micro-batch's tokens held back, Clip-Cov's covariance bounds, KL-Cov's
    # coefficient (verl's clip_cov_ratio, clip_cov_lb, clip_cov_ub; kl_cov_ratio, ppo_kl_coef)
    cov_fraction: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_coef: float = 1.0
    behaviour: str = "rollout"  # behaviour logprobs: "rollout" (the replicas') or "recompute" (the trainer's)
    keep_versions: int = 0  # "recompute": past versions' weights kept (the staleness bound)
    # episodes with these statuses (cut off by a limit, not ended by the policy) carry no loss, as in
    # DAPO's overlong filtering; they still count in their group's advantage baseline
    exclude_statuses: tuple[str, ...] = ()

    def __post_init__(self) -> None:  # verl's loss_agg_mode names (losses.py)
        if self.loss_agg == "seq-mean-token-sum":
            self.loss_scale_tokens = 1
        self.loss_agg = LOSS_AGG_ALIASES.get(self.loss_agg, self.loss_agg)

    @property
    def clip_range(self) -> tuple[float, float]:
        return 1 - self.clip, 1 + (self.clip if self.clip_high is None else self.clip_high)

    def check(self) -> None:
        """A ValueError naming the first setting out of range (and the valid ones, where they are a list)."""
        check_loss(self.loss_agg, self.loss_scale_tokens, self.dual_clip, self.epochs, self.mini_batches,
                   self.kl_loss_type)
        check_schedule(self.lr_schedule, self.lr_warmup_steps, self.min_lr_ratio)
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(f"unknown policy_loss {self.policy_loss!r}; valid: {list(POLICY_LOSSES)}")
        if not 0 < self.cov_fraction < 1 or self.clip_cov_lb > self.clip_cov_ub or self.kl_cov_coef < 0:
            raise ValueError(f"need 0 < cov_fraction < 1, clip_cov_lb <= clip_cov_ub and kl_cov_coef >= 0, got "
                             f"{self.cov_fraction}, {self.clip_cov_lb}, {self.clip_cov_ub} and {self.kl_cov_coef}")
        if self.sapo_tau_pos <= 0 or self.sapo_tau_neg <= 0:
            raise ValueError(f"sapo_tau_pos and sapo_tau_neg must be > 0, got {self.sapo_tau_pos}, {self.sapo_tau_neg}")
        if self.policy_loss in ("clip_cov", "kl_cov") and self.stream_whitened:
            raise ValueError(f"policy_loss {self.policy_loss!r} picks its tokens by the advantages, which "
                             "stream_whitened does not have yet: set stream_whitened = false")
        if self.advantage not in ADVANTAGES:
            raise ValueError(f"unknown advantage {self.advantage!r}; valid: {list(ADVANTAGES)}")
        check_gigpo(self.gigpo_mode, self.gigpo_similarity)
        check_critic(self.gae_gamma, self.gae_lambda, self.critic_lr, self.value_clip, self.critic_warmup)
        check_correction(self.is_level, self.is_mode, self.tis_cap, self.is_low, self.is_veto)
        if self.micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens must be >= 1, got {self.micro_batch_tokens}")
        if self.behaviour not in ("rollout", "recompute"):
            raise ValueError(f"behaviour must be 'rollout' or 'recompute', got {self.behaviour!r}")
        check_cut_off("exclude_statuses", self.exclude_statuses)
        check_reward_kl(self.reward_kl_coef, self.reward_kl_target, self.reward_kl_horizon)
        check_overlong(self.overlong_buffer, self.overlong_penalty, self.overlong_max_tokens)
