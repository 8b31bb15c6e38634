"""The weights a step values tokens under besides the current ones, read top to bottom.

The KL reference (`kl_coef`, `reward_kl_coef`): the policy's weights when the trainer was made (a copy),
or with LoRA the policy with its adapters off (its frozen weights: no copy), or `reference_model`, a
model of its own (a teacher, any size, on the policy's vocabulary: with `reward_kl_coef`, each generated
token's reward less beta x (log pi(token) - log pi_teacher(token)) is on-policy distillation, the
teacher's reverse KL as a dense reward, Agarwal et al. 2024 and Thinking Machines' 2025 recipe). `behaviour = "recompute"`:
the weights of the last `keep_versions` versions, under which stale tokens' behaviour logprobs are
recomputed. Both run by the policy's own path with their weights swapped in for the call (the output
head at the generated positions only, the same rounding: a policy still at the reference has KL 0).

A step's reference logprobs are kept per token sequence until the step ends. The reward's KL
(kl_reward.py) and the loss's (`kl_coef`) both need them, on micro-batches cut differently, and the
loss again at every epoch: the reference runs once per sequence a step. A micro-batch whose sequences
were all valued already is assembled from their rows (the reward's batch rounded them: equal to its
own forward up to the last bits).
"""
from __future__ import annotations

import copy
from contextlib import contextmanager

import torch

from rollwise.trainer.policy import Batch, PolicyModel
from rollwise.types import Trajectory


class Snapshots:
    def __init__(self, policy: PolicyModel, temperature: float, reference: bool, reference_model: str | None = None
                 ) -> None:
        self.policy, self.temperature = policy, temperature
        self.teacher = None  # reference_model's own PolicyModel
        if reference_model is not None:
            if not reference:
                raise ValueError("reference_model is the KL reference: set reward_kl_coef (on-policy distillation) "
                                 "or kl_coef")
            self.teacher = teacher(reference_model, policy)
        self.ref = copy.deepcopy(policy.model).eval() if reference and policy.lora is None and not self.teacher else None
        self.kept: dict[int, dict[str, torch.Tensor]] = {}  # version -> its weights ("recompute")
        self._rows: dict[int, tuple[Trajectory, torch.Tensor]] = {}  # id -> (sequence, its reference row)

    def keep(self, version: int) -> None:
        """The trainable weights as they are now, as `version`'s (with LoRA, the adapters: the rest is frozen)."""
        self.kept[version] = {n: p.detach().clone() for n, p in self.policy.model.named_parameters()
                              if p.requires_grad}

    def end_step(self, version: int, keep_versions: int) -> None:
        """Drop the step's reference rows and the versions older than `keep_versions` before `version`."""
        self.kept = {v: w for v, w in self.kept.items() if v >= version - keep_versions}
        self._rows = {}

    @torch.no_grad()
    def reference(self, mb: list[Trajectory], b: Batch) -> torch.Tensor:
        """[B, L-1] each target's logprob under the reference (0 off the generated positions); its rows
        kept for the rest of the step, and on the batch, so further epochs over it run nothing."""
        if b.ref_logprobs is not None:
            return b.ref_logprobs
        if all(self._rows.get(id(s), (None,))[0] is s for s in mb):  # valued in another micro-batch
            out = torch.zeros(b.targets.shape)
            for r, s in enumerate(mb):
                row = self._rows[id(s)][1]
                out[r, :len(row)] = row
        else:
            out = self._forward(b)
            for r, s in enumerate(mb):
                self._rows[id(s)] = (s, out[r, :len(s.token_ids) - 1].clone())
        b.ref_logprobs = out
        return out

    def _forward(self, b: Batch) -> torch.Tensor:
        if self.teacher is not None:
            return self.teacher.logprobs(b, self.temperature)
        if self.ref is None:
            with self.policy.adapters_off():
                return self.policy.logprobs(b, self.temperature)
        with self.swap({n: p.data for n, p in self.ref.named_parameters()}):
            return self.policy.logprobs(b, self.temperature)

    @torch.no_grad()
    def stale(self, mb: list[Trajectory], b: Batch, version: int,
              keep_versions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each target's policy version, and the logprobs of the tokens of versions before `version` under
        the weights of their version (0 at `version`'s tokens: those are the proximal ones)."""
        ver = torch.full(b.mask.shape, version, dtype=torch.long)
        for i, t in enumerate(mb):
            for tr in t.turns:  # targets are shifted by one: token j is target j - 1
                ver[i, tr.start - 1: tr.start - 1 + tr.num_generated] = torch.tensor(tr.token_versions())
        out = torch.zeros(b.mask.shape)
        for u in sorted(set(ver[b.mask > 0].tolist()) - {version}):
            if u not in self.kept:
                raise ValueError(f"behaviour='recompute' needs the weights of version {u}; kept: {sorted(self.kept)} "
                                 f"(keep_versions={keep_versions} must cover the staleness bound)")
            with self.swap(self.kept[u]):
                lp = self.policy.logprobs(b, self.temperature)
            out = torch.where(ver == u, lp, out)
        return ver, out

    @contextmanager
    def swap(self, snapshot: dict[str, torch.Tensor]):
        """The policy with `snapshot`'s tensors in place of its own while inside."""
        params = dict(self.policy.model.named_parameters())
        saved = {n: params[n].data for n in snapshot}
        try:
            for n, w in snapshot.items():
                params[n].data = w
            yield
        finally:
            for n, w in saved.items():
                params[n].data = w


def teacher(model_dir: str, policy: PolicyModel) -> PolicyModel:
    """A reference model of its own (frozen): ValueError unless it reads the policy's vocabulary."""
    from pathlib import Path
    if not (Path(model_dir) / "config.json").is_file():
        raise ValueError(f"reference_model {model_dir!r} is not a model directory (no config.json)")
    with torch.random.fork_rng():  # (PolicyModel seeds torch: the trainer's own random state stays as it was)
        got = PolicyModel(model_dir)
    mine, its = policy.model.config.vocab_size, got.model.config.vocab_size
    if mine != its:
        raise ValueError(f"reference_model {model_dir!r} has a vocabulary of {its} tokens, the policy {mine}: a "
                         "teacher must read the policy's tokens")
    got.model.eval().requires_grad_(False)
    return got

