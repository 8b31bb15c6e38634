"""GRPO, read top to bottom.

advantages (`advantage`, advantages.py): "grpo", "dr_grpo" and "rloo", one per episode, the same
for every generated token of a trajectory; "gigpo", GiGPO's: the episode's plus a step advantage per
turn, from the turns of the group that started from the same state; "gae", PPO's: per token, from a
learned critic (critic.py); "reinforce_plus_plus" (per token, the discounted return to go) and
"reinforce_plus_plus_baseline" (the episode's reward less its group's mean). These three are
whitened over the batch, so a streamed step's policy forward and backward wait for its last group
(the critic's values of each group are computed as it arrives).

loss (`policy_loss`): "ppo", token-level clipped policy gradient (decoupled PPO, as in AReaL);
"gspo", GSPO's sequence-level ratio (the geometric mean of its tokens' ratios, clipped per sequence:
use a tight range, e.g. clip = 3e-4, clip_high = 4e-4, and loss_agg = "sequence"), in its token
form, so each token's gradient is the sequence ratio times its own; "cispo", CISPO's REINFORCE with
the ratio clipped and stopped (every token keeps a gradient, the weight is capped: clip_high large,
e.g. 5). The three agree at ratio 1 (a first epoch on fresh samples). The proximal policy is the
trainer's weights at the start of the step; the rollout logprobs are the behaviour policy. The
importance weight proximal/behaviour, truncated at `tis_cap`, corrects for stale samples (generated
by older weights, or partly under newer ones) and the replicas' numerics (per token by default; per
sequence, or masked instead of truncated: correction.py); ratio current/proximal is clipped to [1 - `clip`, 1 +
`clip_high`] (`clip_high` defaults to `clip`; DAPO's clip-higher raises it). Episodes whose status
is in `exclude_statuses` (cut off by a limit) carry no loss. With `behaviour="recompute"` the
trainer computes the behaviour logprobs itself, under the weights of the version that generated each
turn (it keeps the last `keep_versions` versions' weights): fresh tokens get weight exactly 1 and
stale ones a weight that does not depend on the replicas' numerics (batch shapes, speculation), so a
run is reproducible bit for bit. It needs every turn to have run under one version (the lockstep
pipeline). Optional KL to a reference model (k3 estimator). Token losses are averaged over all
generated tokens of the batch; AdamW, gradient clipping, micro-batches under a token budget. The
proximal logprobs are those of the first epoch's training forward (no update has happened yet), so a
step runs no separate forward for them.

streamed steps: `begin`, then `add` each group as it completes (its forward and backward run while
the rest of the batch is still generating), then `finish` (the optimizer step). The gradients are
sums until `finish` divides them by the batch's generated tokens; `step(groups)` is the same on a
batch known in advance.

check: for samples whose every turn ran on the trainer's current version, the recomputed proximal
logprobs must match the rollout logprobs; a mismatch means a replica is not serving the weights it
claims (a failed or skipped weight sync) and raises `LogprobMismatch` naming the replicas. With true
on-policy logprobs (`PolicyModel.enable_exact`, exact.py) the tolerance is 0: they must be equal.
"""
from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from rollwise.trainer.advantages import (ADVANTAGES, WHITENED, advantages, check_gigpo, token_advantages,
                                         turn_advantages)
from rollwise.trainer.critic import Critic, check as check_critic, estimate, whiten
from rollwise.trainer.correction import check as check_correction, is_weights
from rollwise.trainer.policy import Batch, PolicyModel, micro_batches
from rollwise.types import Trajectory, check_cut_off


class LogprobMismatch(RuntimeError):
    pass


@dataclass
class GRPOConfig:
    lr: float = 1e-4
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
    entropy_coef: float = 0.0  # the loss less this times each token's entropy (verl's entropy_coeff)
    advantage: str = "grpo"  # or "dr_grpo", "rloo", "gigpo", "gae", "reinforce_plus_plus[_baseline]" (`ADVANTAGES`)
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
    max_grad_norm: float = 1.0
    temperature: float = 1.0  # the rollouts' sampling temperature
    micro_batch_tokens: int = 8192
    epochs: int = 1  # optimizer steps over each batch (PPO epochs)
    logprob_tolerance: float = 0.02  # mean |trainer - rollout| logprob allowed on fresh samples
    # "token": mean over all generated tokens; "sequence": per trajectory, then mean; "constant": each
    # trajectory's token sum over loss_scale_tokens, then mean (Dr. GRPO's, verl's seq-mean-token-sum-norm:
    # no length normalisation, so a long wrong answer is not penalised less per token than a short one)
    loss_agg: str = "token"
    loss_scale_tokens: int = 0  # "constant": the divisor (e.g. the most tokens an episode may generate)
    policy_loss: str = "ppo"  # or "gspo", "cispo" (`POLICY_LOSSES`)
    behaviour: str = "rollout"  # behaviour logprobs: "rollout" (the replicas') or "recompute" (the trainer's)
    keep_versions: int = 0  # "recompute": past versions' weights kept (the staleness bound)
    # episodes with these statuses (cut off by a limit, not ended by the policy) carry no loss, as in
    # DAPO's overlong filtering; they still count in their group's advantage baseline
    exclude_statuses: tuple[str, ...] = ()

    @property
    def clip_range(self) -> tuple[float, float]:
        return 1 - self.clip, 1 + (self.clip if self.clip_high is None else self.clip_high)


POLICY_LOSSES = ("ppo", "gspo", "cispo")
LOSS_AGGS = ("token", "sequence", "constant")


def check_loss_agg(agg: str, scale_tokens: int) -> None:
    if agg not in LOSS_AGGS:
        raise ValueError(f"unknown loss_agg {agg!r}; valid: {list(LOSS_AGGS)}")
    if agg == "constant" and scale_tokens < 1:
        raise ValueError(f"loss_agg = 'constant' divides each trajectory's token sum by loss_scale_tokens, which "
                         f"must be >= 1, got {scale_tokens}")


def oldest_version(t: Trajectory) -> int:
    return min(t.policy_versions) if t.turns else 0


class GRPOTrainer:
    def __init__(self, policy: PolicyModel, config: GRPOConfig | None = None) -> None:
        self.policy, self.cfg = policy, config or GRPOConfig()
        check_loss_agg(self.cfg.loss_agg, self.cfg.loss_scale_tokens)
        if self.cfg.dual_clip and self.cfg.dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1 (or 0: off), got {self.cfg.dual_clip}")
        if self.cfg.policy_loss not in POLICY_LOSSES:
            raise ValueError(f"unknown policy_loss {self.cfg.policy_loss!r}; valid: {list(POLICY_LOSSES)}")
        if self.cfg.advantage not in ADVANTAGES:
            raise ValueError(f"unknown advantage {self.cfg.advantage!r}; valid: {list(ADVANTAGES)}")
        check_gigpo(self.cfg.gigpo_mode, self.cfg.gigpo_similarity)
        check_critic(self.cfg.gae_gamma, self.cfg.gae_lambda, self.cfg.critic_lr, self.cfg.value_clip,
                     self.cfg.critic_warmup)
        check_correction(self.cfg.is_level, self.cfg.is_mode, self.cfg.tis_cap, self.cfg.is_low, self.cfg.is_veto)
        if self.cfg.behaviour not in ("rollout", "recompute"):
            raise ValueError(f"behaviour must be 'rollout' or 'recompute', got {self.cfg.behaviour!r}")
        check_cut_off("exclude_statuses", self.cfg.exclude_statuses)
        self.kept: dict[int, dict[str, torch.Tensor]] = {}  # version -> its weights ("recompute")
        self.opt = torch.optim.AdamW(policy.parameters(), lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        # the KL reference: the weights as they are now; with LoRA, the policy with its adapters off
        # (its frozen weights are the reference: no copy)
        self.ref = copy.deepcopy(policy.model).eval() if self.cfg.kl_coef > 0 and policy.lora is None else None
        self.critic = None  # gae: PPO's value model
        if self.cfg.advantage == "gae":
            self.critic = Critic(policy, self.cfg.critic_lr or 10 * self.cfg.lr, self.cfg.value_clip,
                                 self.cfg.max_grad_norm, model_dir=self.cfg.critic_model)
        self.version = 0  # optimizer steps taken = the policy version the replicas should serve
        self._acc: dict | None = None  # the step begun and not finished (`begin`, `add`, `finish`)

    def step(self, groups: list[list[Trajectory]]) -> dict[str, float]:
        """One optimizer step (per epoch) on complete groups; returns metrics."""
        useful = self._useful(groups)[0]
        # the batch's totals are known: each micro-batch's loss is normalized as it goes
        self.begin(n_tokens=sum(t.num_generated for t in useful), n_trajectories=len(useful))
        self.add(groups)
        return self.finish()

    def begin(self, n_tokens: int | None = None, n_trajectories: int | None = None) -> None:
        """Start a step whose groups arrive one by one (`add` as each completes, then `finish`): the
        first epoch's forward and backward of each group run while the rest of the batch is still
        generating. Gradients are summed unnormalized and divided by the batch's generated tokens
        (or trajectories, for `loss_agg="sequence"`) at `finish`, unless the totals are given here."""
        cfg = self.cfg
        if cfg.behaviour == "recompute" and cfg.keep_versions > 0:  # this version's weights, for later steps
            self.kept[self.version] = {n: p.detach().clone() for n, p in self.policy.model.named_parameters()
                                       if p.requires_grad}  # (with LoRA, the adapters: the rest is frozen)
        self.opt.zero_grad(set_to_none=True)
        self.policy.routing_stats.zero_()
        self.policy.expert_load.clear()
        self._acc = {"trajs": [], "items": [], "diffs": ([], {}), "stats": torch.zeros(6), "n_tokens": 0, "n_useful": 0,
                     "entropy": [], "anchors": {}, "whiten": [],
                     "given": n_tokens if cfg.loss_agg == "token" else n_trajectories}

    def add(self, groups: list[list[Trajectory]]) -> None:
        """Complete groups of the current step: advantages, then forward and backward (first epoch)."""
        cfg, acc = self.cfg, self._begun()
        useful, adv = self._useful(groups, acc["anchors"])
        acc["trajs"] += [t for g in groups for t in g]
        acc["n_useful"] += len(useful)
        acc["n_tokens"] += sum(t.num_generated for t in useful)
        if cfg.advantage in WHITENED:  # per token now (a critic's values); the policy's pass once they whiten
            if self.critic is not None:
                items = self.critic.estimate(useful, cfg.gae_gamma, cfg.gae_lambda, cfg.micro_batch_tokens)
            elif cfg.advantage == "reinforce_plus_plus":  # the discounted returns to go
                items = estimate(useful, cfg.gae_gamma, 1.0, cfg.micro_batch_tokens)
            else:  # each episode's reward less its group's mean
                trajs = [t for g in groups for t in g]
                episode = dict(zip(map(id, trajs), advantages(groups, "dr_grpo")))
                items = estimate(useful, 1.0, 1.0, cfg.micro_batch_tokens, episode=episode)
            acc["whiten"] += items
            return
        # a row per token sequence: an episode of several contexts gives several, with its advantage per
        # turn and (for loss_agg="sequence") its generated tokens, over which its rows are averaged
        row = {}
        for t in useful:
            per, k = adv[id(t)], 0
            for s in t.sequences():
                row[id(s)] = (per[k:k + len(s.turns)], t.num_generated)
                k += len(s.turns)
        for mb in micro_batches([s for t in useful for s in t.sequences()], cfg.micro_batch_tokens):
            b = Batch.of(mb)
            if cfg.advantage == "gigpo":  # per turn: [B, L - 1]
                a = token_advantages(mb, [row[id(s)][0] for s in mb], b.targets.shape[1])
            else:  # the episode's, every turn alike: [B]
                a = torch.tensor([row[id(s)][0][0] if s.turns else 0.0 for s in mb], dtype=torch.float32)
            self._first_pass(mb, b, a, torch.tensor([row[id(s)][1] for s in mb], dtype=torch.float32))

    def _first_pass(self, mb: list[Trajectory], b: Batch, a: torch.Tensor, n: torch.Tensor) -> None:
        """A micro-batch's first-epoch forward and backward, the check's logprobs, and the item kept for
        later epochs. `a`: [B] or [B, L-1] advantages; `n`: each row's episode's generated tokens."""
        cfg, acc = self.cfg, self._acc
        with torch.no_grad():  # behaviour logprobs of stale tokens under the weights that generated them
            st = self._stale(mb, b) if cfg.behaviour == "recompute" else None
        ent: list = []
        lp = self.policy.logprobs(b, cfg.temperature, entropy=ent)
        acc["entropy"].append(float(ent[0].detach().sum()))
        # the proximal policy: the weights before this step (no update yet: no separate forward)
        prox = lp.detach()
        self._backward(lp, b, a, st, prox, acc["given"] or 1.0, acc["stats"], n, ent[0])
        self._compare(mb, b, prox, acc["diffs"])
        acc["items"].append((b, a, st, prox, n))

    def finish(self) -> dict[str, float]:
        """Check the fresh samples' logprobs, then the optimizer step (and any further epochs)."""
        cfg, acc = self.cfg, self._begun()
        trajs, n_tokens = acc["trajs"], acc["n_tokens"]
        staleness = [self.version - oldest_version(t) for t in trajs]
        m = {"reward": sum(t.reward for t in trajs) / max(len(trajs), 1), "trajectories": len(trajs),
             "trained_trajectories": acc["n_useful"], "trained_tokens": n_tokens,
             "contexts": sum(len(t.sequences()) for t in trajs) / max(len(trajs), 1),  # token sequences per episode
             "retried": sum(len(t.retried) for t in trajs),  # attempts dropped and run again (an env that raised)
             "max_staleness": max(staleness, default=0), "stale_trajectories": sum(s > 0 for s in staleness),
             "loss": 0.0, "grad_norm": 0.0, "kl": 0.0, "is_weight_mean": 1.0, "clip_frac": 0.0,
             "is_dropped": 0.0, "behaviour_kl": 0.0, "logprob_diff": float("nan"),
             "entropy": sum(acc["entropy"]) / n_tokens if n_tokens else float("nan")}  # per trained token
        div = n_tokens if cfg.loss_agg == "token" else acc["n_useful"]
        if acc["whiten"]:  # the batch's per-token advantages whitened, then the policy's first pass
            acc["given"] = div
            mean, std = whiten(acc["whiten"])
            generated = {id(s): t.num_generated for t in trajs for s in t.sequences()}  # each row's episode's
            for mb, b, adv, _, _ in acc["whiten"]:
                n = torch.tensor([generated[id(s)] for s in mb], dtype=torch.float32)
                self._first_pass(mb, b, (adv - mean) / std * b.mask, n)
        try:
            self._check(acc["diffs"], m)  # before any update: a replica on other weights stops the step here
        except LogprobMismatch:
            self.opt.zero_grad(set_to_none=True)
            raise
        for epoch in range(cfg.epochs):
            if not acc["items"]:
                break
            stats = acc["stats"]
            if epoch > 0:
                stats = torch.zeros(6)
                for b, a, st, prox, n in acc["items"]:
                    ent = [] if cfg.entropy_coef else None
                    lp = self.policy.logprobs(b, cfg.temperature, entropy=ent)
                    self._backward(lp, b, a, st, prox, div, stats, n, ent[0] if ent else None)
            elif not acc["given"]:  # streamed: the sums' gradients, normalized now that the batch is known
                for p in self.policy.parameters():
                    if p.grad is not None:
                        p.grad.div_(div)
                stats[0] /= div
            gn = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), cfg.max_grad_norm)
            if self.version >= cfg.critic_warmup or self.critic is None:
                self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            m.update(loss=float(stats[0]), grad_norm=float(gn), clip_frac=float(stats[1]) / n_tokens,
                     kl=float(stats[2]) / n_tokens, is_weight_mean=float(stats[3]) / n_tokens,
                     is_dropped=float(stats[4]) / n_tokens, behaviour_kl=float(stats[5]) / n_tokens)
        if self.critic is not None:
            m.update(self.critic.update(acc["whiten"], cfg.epochs),
                     critic_warmup=float(self.version < cfg.critic_warmup))
        if cfg.advantage == "gigpo" and acc["anchors"].get("turns"):  # turns in a step group of 2 or more
            m["anchored_turns"] = acc["anchors"].get("anchored", 0) / acc["anchors"]["turns"]
        moved, seen = self.policy.routing_stats.tolist()
        if seen:  # MoE rollouts that returned their routing: token-layers the trainer routes otherwise
            m["routing_mismatch"] = moved / seen
            # the busiest expert's share against an even one (1: balanced; E / k: every token on the same k)
            m["expert_load_max"] = max(float(c.max() / c.float().mean()) for c in self.policy.expert_load.values())
        self.version += 1
        self.kept = {v: w for v, w in self.kept.items() if v >= self.version - cfg.keep_versions}
        self._acc = None
        return m

    def _useful(self, groups: list[list[Trajectory]], stats: dict | None = None) -> tuple[list[Trajectory], dict]:
        """The trajectories that carry loss (generated tokens, a kept status and, for the episode
        estimators, a turn with a non-zero advantage), and their advantages per turn by id (those)."""
        cfg, trajs = self.cfg, [t for g in groups for t in g]
        kept = [t for t in trajs if t.num_generated > 0 and t.status not in cfg.exclude_statuses]
        if cfg.advantage in WHITENED:  # per token, whitened over the batch: every kept trajectory trains
            return kept, {}
        adv = dict(zip(map(id, trajs), turn_advantages(groups, cfg.advantage, cfg.step_advantage_weight, cfg.gamma,
                                                       stats, cfg.gigpo_mode, cfg.gigpo_similarity)))
        return [t for t in kept if any(abs(a) > 1e-9 for a in adv[id(t)])], adv

    def _begun(self) -> dict:
        if self._acc is None:
            raise RuntimeError("no step begun: call begin() before add() and finish()")
        return self._acc

    def _backward(self, lp, b: Batch, a, st, prox, div: float, stats: torch.Tensor, n=None, ent=None) -> None:
        """The clipped, importance-weighted policy-gradient loss of one micro-batch (plus KL, less the
        entropy bonus), divided by `div`, backpropagated; adds loss, clipped tokens, KL and IS weight
        sums to `stats`. `a`: each row's advantage; `n`: its episode's generated tokens (default: the
        row's own); `ent`: each target's entropy (with its gradient)."""
        cfg = self.cfg
        lp_behav = b.behaviour_logprobs if st is None else torch.where(st[0] == self.version, prox, st[1])
        # importance weights proximal / behaviour: truncated (TIS) or masked (MIS), per token or sequence
        w, dropped = is_weights(prox - lp_behav, b.mask, cfg.is_level, cfg.is_mode, cfg.tis_cap, cfg.is_low,
                                cfg.is_veto)
        A = a[:, None] if a.dim() == 1 else a  # each row's, or each target's (gigpo)
        lo, hi = cfg.clip_range
        if cfg.policy_loss == "gspo":  # each row's sequence ratio, carried by every token with its own gradient
            seq = torch.exp(((lp - prox) * b.mask).sum(1, keepdim=True) / b.mask.sum(1, keepdim=True).clamp(min=1))
            ratio = seq.detach() * torch.exp(lp - lp.detach())
        else:
            ratio = torch.exp(lp - prox)
        if cfg.policy_loss == "cispo":
            pg = -ratio.detach().clamp(lo, hi) * A * lp * w
        else:
            pg = -torch.minimum(ratio * A, ratio.clamp(lo, hi) * A)
            if cfg.dual_clip and cfg.policy_loss == "ppo":  # a negative advantage's loss at most dual_clip x |A|
                pg = torch.where(A < 0, torch.minimum(pg, -A * cfg.dual_clip), pg)
            pg = pg * w
        if cfg.kl_coef > 0:
            with torch.no_grad(), self.policy.adapters_off():
                ref = self.ref if self.ref is not None else self.policy.model
                lp_ref = torch.log_softmax(ref(input_ids=b.input_ids, attention_mask=b.attention_mask)
                                           .logits[:, :-1] / cfg.temperature, -1).gather(
                    -1, b.targets.unsqueeze(-1)).squeeze(-1)
            d = lp_ref - lp
            kl = torch.exp(d) - d - 1
            pg = pg + cfg.kl_coef * kl
            stats[2] += float((kl.detach() * b.mask).sum())
        if cfg.entropy_coef and ent is not None:
            pg = pg - cfg.entropy_coef * ent
        if cfg.loss_agg != "token":
            n = b.mask.sum(1) if n is None else n
            if cfg.loss_agg == "constant":
                n = torch.full_like(n, float(cfg.loss_scale_tokens))
            loss = ((pg * b.mask).sum(1) / n.clamp(min=1)).sum() / div  # each episode's mean (or sum / constant)
        else:
            loss = (pg * b.mask).sum() / div
        loss.backward()
        stats[0] += float(loss.detach())
        r = ratio.detach()
        stats[1] += float(((r < lo) | (r > hi)).float().mul(b.mask).sum())
        stats[3] += float((w.detach() * b.mask).sum())
        stats[4] += float(dropped.sum())
        d = (lp_behav - prox) * b.mask  # k3 estimate of KL(behaviour || proximal) on the sampled tokens
        stats[5] += float(((torch.exp(-d) - 1 + d) * b.mask).sum())

    def _stale(self, mb: list[Trajectory], b: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Each target's policy version, and the logprobs of the tokens of older versions under the
        weights of their version (0 at the current version's tokens: those are the proximal ones)."""
        ver = torch.full(b.mask.shape, self.version, dtype=torch.long)
        for i, t in enumerate(mb):
            for tr in t.turns:  # targets are shifted by one: token j is target j - 1
                ver[i, tr.start - 1: tr.start - 1 + tr.num_generated] = torch.tensor(tr.token_versions(), dtype=torch.long)
        out = torch.zeros(b.mask.shape)
        for u in sorted(set(ver[b.mask > 0].tolist()) - {self.version}):
            if u not in self.kept:
                raise ValueError(f"behaviour='recompute' needs the weights of version {u}; kept: {sorted(self.kept)} "
                                 f"(keep_versions={self.cfg.keep_versions} must cover the staleness bound)")
            with self._weights(self.kept[u]):
                lp = self.policy.logprobs(b, self.cfg.temperature)
            out = torch.where(ver == u, lp, out)
        return ver, out

    @contextmanager
    def _weights(self, snapshot: dict[str, torch.Tensor]):
        params = dict(self.policy.model.named_parameters())
        saved = {n: params[n].data for n in snapshot}
        try:
            for n, w in snapshot.items():
                params[n].data = w
            yield
        finally:
            for n, w in saved.items():
                params[n].data = w

    def _compare(self, mb: list[Trajectory], b: Batch, prox: torch.Tensor, diffs: tuple[list, dict]) -> None:
        """Mean |trainer - rollout| logprob of each sample fully generated by the weights the trainer
        holds now: into diffs (all samples, by replica)."""
        for i, t in enumerate(mb):
            if not t.turns or min(t.policy_versions) != self.version:
                continue
            sel = b.mask[i] > 0
            d = float((prox[i][sel] - b.behaviour_logprobs[i][sel]).abs().mean())
            diffs[0].append(d)
            for r in {tr.replica for tr in t.turns}:
                diffs[1].setdefault(r, []).append(d)

    def _check(self, diffs: tuple[list, dict], m: dict) -> None:
        every, by_replica = diffs
        if every:
            m["logprob_diff"] = sum(every) / len(every)
            bad = {r: sum(v) / len(v) for r, v in by_replica.items() if sum(v) / len(v) > self.cfg.logprob_tolerance}
            if bad:
                why = ("a replica is not batch-invariant (rollwise serve --batch-invariant) or serves other weights"
                       if self.cfg.logprob_tolerance == 0 else "a replica is serving other weights than it reports")
                raise LogprobMismatch("rollout logprobs do not match the trainer's weights (version "
                                      f"{self.version}): mean |diff| by replica {bad}; {why}")

    # checkpoints ---------------------------------------------------------------------------------
    def state(self) -> dict:
        return {"model": self.policy.model.state_dict(), "optimizer": self.opt.state_dict(), "version": self.version,
                "ref": self.ref.state_dict() if self.ref is not None else None, "kept": self.kept,
                "critic": self.critic.state() if self.critic is not None else None}

    def load_state(self, state: dict) -> None:
        self.policy.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        self.kept = state.get("kept") or {}
        if self.ref is not None and state.get("ref") is not None:
            self.ref.load_state_dict(state["ref"])
        if self.critic is not None:
            if state.get("critic") is None:
                raise ValueError("advantage = 'gae' needs the critic's state: this checkpoint has none")
            self.critic.load_state(state["critic"])

