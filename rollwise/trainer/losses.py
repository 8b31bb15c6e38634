"""The policy losses per token and their aggregation over a batch, read top to bottom.

`policy_loss`: "ppo", the token-level clipped policy gradient (decoupled PPO, as in AReaL), with
dual-clip (Ye et al. 2020; verl's clip_ratio_c): under a negative advantage a token's loss is at most
`dual_clip` x |A| however far its ratio went up; "gspo", GSPO's sequence-level ratio (the geometric
mean of its tokens' ratios, clipped per sequence), in its token form, so each token's gradient is the
sequence ratio times its own; "cispo", CISPO's REINFORCE with the ratio clipped and stopped (every
token keeps a gradient, the weight is capped). The three agree at ratio 1. "gpg" (GPG, Chu et al.
2025; verl's): plain REINFORCE, -A x logprob, no ratio and no clip (for on-policy batches: one epoch
and one mini-batch; its clip_frac is 0). "clip_cov" and "kl_cov"
(Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs"; verl's names): entropy falls where
a token's logprob and advantage covary most, so a few such tokens (`cov_fraction` of the
micro-batch's) are held back: Clip-Cov takes PPO's loss and stops the gradient of that many tokens
drawn at random among those whose covariance term lies in [`clip_cov_lb`, `clip_cov_ub`]; KL-Cov takes
the unclipped policy gradient and adds `kl_cov_coef` x |logprob - proximal logprob| at the tokens of
largest covariance (zero, with a zero gradient, where the ratio is 1: it acts with epochs or
mini-batches > 1, or stale samples). Each token's covariance term is (A - mean A) (logprob - mean
logprob) over the micro-batch's generated tokens. "gmpo" (GMPO, Zhao et al. 2025; verl's geo_mean): the
sequence's loss is -A x the geometric mean of its token ratios (GSPO's sequence ratio, where GRPO
takes their arithmetic mean), but each token's log-ratio is clipped before the mean, to [log(1 - clip),
log(1 + clip_high)] in the direction its advantage pushes (a clipped token carries no gradient), not
the sequence's ratio after it; the paper's range is wider, e.g. clip = clip_high = 0.4. In token form
(each token the sequence's value, its own gradient): loss_agg = "sequence" gives the paper's mean over
sequences. "sapo" (SAPO, Gao et al. 2025, "Soft Adaptive Policy Optimization"; verl's): no clip, each
token's loss -A x (4 / tau) sigmoid(tau (ratio - 1)), tau = `sapo_tau_pos` under a positive advantage,
`sapo_tau_neg` under a negative one: a soft trust region whose gradient, A x 4 s (1 - s) x ratio x the
logprob's, is PPO's at ratio 1 and falls off smoothly as the ratio moves away (faster on the negative
side, tau_neg > tau_pos), rather than stopping at the clip. Its value here is less the gate's value at
ratio 1 (2 / tau, which takes tau from the advantage's sign): the same gradients as verl's, and a loss
that is 0 on fresh samples, so linear in the advantages there, as SplitGradients needs.
`w`: the importance weights proximal / behaviour (correction.py).

`loss_agg`: "token", the mean over the batch's generated tokens; "sequence", each trajectory's mean,
then theirs; "constant", each trajectory's token sum over a fixed count, then the mean (Dr. GRPO's,
verl's seq-mean-token-sum-norm: no length normalisation, so a long wrong answer is not penalised less
per token than a short one).
"""
from __future__ import annotations

import math

import torch

POLICY_LOSSES = ("ppo", "gspo", "cispo", "clip_cov", "kl_cov", "gmpo", "gpg", "sapo")
LOSS_AGGS = ("token", "sequence", "constant")
# verl's loss_agg_mode names: seq-mean-token-sum is "constant" over 1 token (GRPOConfig sets it)
LOSS_AGG_ALIASES = {"token-mean": "token", "seq-mean-token-mean": "sequence", "seq-mean-token-sum-norm": "constant",
                    "seq-mean-token-sum": "constant"}
# the KL loss's estimator per token (Schulman's k1, k2, k3; verl's kl_loss_type, its names too), "+": the
# estimator's value with k2's gradient, the KL's gradient in expectation (a straight-through estimator)
KL_ESTIMATORS = ("k1", "k2", "k3", "abs", "k1+", "k3+", "abs+")
KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


def kl_estimate(lp: torch.Tensor, ref: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Each token's estimate of KL(policy || reference) from its logprob under each (sampled from the
    policy): k1 = lp - ref; k2 = (lp - ref)^2 / 2; k3 = e^(ref - lp) - (ref - lp) - 1, non-negative and of
    low variance (its log-ratio held to +-20 and its value to 10, as verl does); abs = |lp - ref|."""
    kind = KL_ALIASES.get(kind, kind)
    d = lp - ref
    base = kind.rstrip("+")
    if base == "k1":
        out = d
    elif base == "abs":
        out = d.abs()
    elif base == "k2":
        out = 0.5 * d.square()
    elif base == "k3":
        r = (-d).clamp(-20, 20)
        out = (torch.exp(r) - r - 1).clamp(max=10)
    else:
        check("token", 1, kl_loss_type=kind)  # (raises)
    if kind.endswith("+"):
        k2 = 0.5 * d.square()
        out = k2 - k2.detach() + out.detach()
    return out


def check(agg: str, scale_tokens: int, dual_clip: float = 0.0, epochs: int = 1, mini_batches: int = 1,
          kl_loss_type: str = "k3") -> None:
    """A ValueError naming the loss setting that is out of range."""
    if KL_ALIASES.get(kl_loss_type, kl_loss_type) not in KL_ESTIMATORS:
        raise ValueError(f"unknown kl_loss_type {kl_loss_type!r}; valid: {list(KL_ESTIMATORS) + list(KL_ALIASES)}")
    if agg not in LOSS_AGGS:
        raise ValueError(f"unknown loss_agg {agg!r}; valid: {list(LOSS_AGGS) + list(LOSS_AGG_ALIASES)}")
    if agg == "constant" and scale_tokens < 1:
        raise ValueError(f"loss_agg = 'constant' divides each trajectory's token sum by loss_scale_tokens, which "
                         f"must be >= 1, got {scale_tokens}")
    if dual_clip and dual_clip <= 1:
        raise ValueError(f"dual_clip must be > 1 (or 0: off), got {dual_clip}")
    if epochs < 1 or mini_batches < 1:
        raise ValueError(f"epochs and mini_batches must be >= 1, got {epochs}, {mini_batches}")


def token_losses(kind: str, lp: torch.Tensor, prox: torch.Tensor, A: torch.Tensor, w: torch.Tensor,
                 mask: torch.Tensor, clip_range: tuple[float, float], dual_clip: float = 0.0,
                 cov: tuple[float, float, float, float] = (2e-4, 1.0, 5.0, 1.0), generator=None,
                 sapo: tuple[float, float] = (1.0, 1.05)):
    """[B, L-1] each target's policy-gradient loss (its gradient flows through `lp`), and the ratios
    current / proximal that were clipped against. `A`: [B, 1] or [B, L-1] advantages. `cov`:
    clip_cov's and kl_cov's (cov_fraction, clip_cov_lb, clip_cov_ub, kl_cov_coef); `generator`: clip_cov's
    draw; `sapo`: SAPO's (tau_pos, tau_neg)."""
    lo, hi = clip_range
    if kind == "gpg":  # (the ratio to itself: 1, nothing clipped)
        return -A * lp * w, torch.ones_like(lp)
    if kind == "sapo":  # (the log-ratio held to +-20, as verl's: far out the gate's gradient is 0, not 0 x inf)
        tau = torch.where(A > 0, sapo[0], sapo[1])
        ratio = torch.exp((lp - prox).clamp(-20.0, 20.0))
        return -(4.0 / tau) * (torch.sigmoid(tau * (ratio - 1.0)) - 0.5) * A * w, ratio
    if kind in ("clip_cov", "kl_cov"):
        return _cov_losses(kind, lp, prox, A, w, mask, clip_range, *cov, generator=generator)
    if kind == "gspo":  # each row's sequence ratio, carried by every token with its own gradient
        seq = torch.exp(((lp - prox) * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1))
        ratio = seq.detach() * torch.exp(lp - lp.detach())
    else:
        ratio = torch.exp(lp - prox)
    if kind == "cispo":
        return -ratio.detach().clamp(lo, hi) * A * lp * w, ratio
    if kind == "gmpo":  # the geometric mean of token ratios, each first clipped (in log space) against its A's sign
        d, s = lp - prox, torch.sign(A)
        held = s * torch.minimum(s * d, s * d.clamp(math.log(lo), math.log(hi)))
        seq = torch.exp((held * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1))
        return -seq.detach() * torch.exp(held - held.detach()) * A * w, ratio
    pg = -torch.minimum(ratio * A, ratio.clamp(lo, hi) * A)
    if dual_clip and kind == "ppo":  # a negative advantage's loss at most dual_clip x |A|
        pg = torch.where(A < 0, torch.minimum(pg, -A * dual_clip), pg)
    return pg * w, ratio


def covariance(lp: torch.Tensor, A: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each generated token's (A - mean A) (logprob - mean logprob), the means over the generated
    tokens; -inf elsewhere."""
    valid = mask.bool()
    a, p = A.expand_as(lp).detach(), lp.detach()
    c = (a - a[valid].mean()) * (p - p[valid].mean())
    return c.masked_fill(~valid, float("-inf"))


def _cov_losses(kind, lp, prox, A, w, mask, clip_range, fraction, lb, ub, kl_coef, generator=None):
    ratio = torch.exp(lp - prox)
    n = int(mask.sum())
    if n == 0:
        return torch.zeros_like(lp), ratio
    c, k = covariance(lp, A, mask), max(int(fraction * n), 1)
    held = torch.zeros(lp.numel(), dtype=torch.bool)
    if kind == "clip_cov":  # PPO's loss; k tokens of covariance in [lb, ub], drawn at random, without gradient
        lo, hi = clip_range
        pg = -torch.minimum(ratio * A, ratio.clamp(lo, hi) * A)
        among = ((c >= lb) & (c <= ub)).flatten().nonzero().flatten()
        held[among[torch.randperm(len(among), generator=generator)[:k]]] = True
        return torch.where(held.view_as(lp), torch.zeros_like(pg), pg) * w, ratio
    held[c.flatten().topk(min(k, n)).indices] = True  # kl_cov: the k tokens of largest covariance
    pg = -ratio * A + kl_coef * (lp - prox).abs() * held.view_as(lp)
    return pg * w, ratio


def aggregate(pg: torch.Tensor, mask: torch.Tensor, agg: str, div: float, n: torch.Tensor | None = None,
              scale_tokens: int = 0) -> torch.Tensor:
    """The micro-batch's share of the batch loss: its token losses summed over `div` (the batch's
    generated tokens for "token", its trajectories otherwise), each row's first divided by `n` (its
    episode's generated tokens; default the row's own) or by `scale_tokens` ("constant")."""
    if agg == "token":
        return (pg * mask).sum() / div
    n = mask.sum(1) if n is None else n
    if agg == "constant":
        n = torch.full_like(n, float(scale_tokens))
    return ((pg * mask).sum(1) / n.clamp(min=1)).sum() / div


def split(items: list[tuple], k: int) -> list[list[tuple]]:
    """The step's micro-batches in up to k contiguous parts of about equal generated tokens."""
    total = sum(float(it[0].mask.sum()) for it in items)
    parts: list[list[tuple]] = [[]]
    done = 0.0
    for it in items:
        if parts[-1] and done >= total * len(parts) / k:
            parts.append([])
        parts[-1].append(it)
        done += float(it[0].mask.sum())
    return parts


def part_size(part: list[tuple], agg: str) -> float:
    """A part's divisor: its generated tokens ("token"), else its trajectories (a row counts its share
    of its episode's tokens, so an episode whose contexts lie in several parts counts once in all)."""
    if agg == "token":
        return float(sum(b.mask.sum() for b, *_ in part))
    return float(sum((b.mask.sum(1) / n.clamp(min=1)).sum() for b, _, _, _, n in part))


class SplitGradients:
    """The first pass's gradients of a loss whose advantages are whitened over a batch that is not yet
    whole (the streamed trainer's gae and REINFORCE++). At ratio 1 (the first epoch, before any update)
    every policy loss here is linear in the advantages, in value and gradient: with A' = (A - mu) / sigma,
    L(A') = (L(A) - mu L(1)) / sigma. So each micro-batch backpropagates L(A) and L(1) into two buffers
    as it arrives, and `apply` adds (g_A - mu g_1) / sigma to the parameters' gradients once the batch's
    mu and sigma are known: the whitened loss's gradients, exactly up to rounding, for a second backward
    per micro-batch and two gradient-sized buffers."""

    def __init__(self, params) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.grads: list[list[torch.Tensor | None]] = [[None] * len(self.params), [None] * len(self.params)]
        self.losses = [0.0, 0.0]

    def backward(self, loss_a: torch.Tensor, loss_1: torch.Tensor, retain_graph: bool = False) -> None:
        """Adds the gradients of L(A) and of L(1) (the loss at advantage 1 on every token) to the buffers."""
        for k, loss in enumerate((loss_a, loss_1)):
            gs = torch.autograd.grad(loss, self.params, retain_graph=retain_graph or k == 0, allow_unused=True)
            buf = self.grads[k]
            for i, g in enumerate(gs):
                if g is not None:
                    buf[i] = g if buf[i] is None else buf[i].add_(g)
            self.losses[k] += float(loss.detach())

    def apply(self, mean: float, std: float) -> float:
        """Adds the whitened loss's gradients to the parameters' `.grad`; returns its value."""
        for p, ga, g1 in zip(self.params, *self.grads):
            if ga is not None:  # (the two losses share one graph: the same parameters have gradients)
                g = ga.sub_(g1, alpha=mean).div_(std)
                p.grad = g if p.grad is None else p.grad.add_(g)
        self.grads = [[None] * len(self.params), [None] * len(self.params)]
        return (self.losses[0] - mean * self.losses[1]) / std
