"""The trainable policy: the model directory loaded with transformers (made for training: autograd,
attention masks), token log-probabilities of trajectories in padded micro-batches, and its weights
under Hugging Face names for the inference replicas."""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from rollwise.types import Trajectory


@dataclass
class Batch:
    """Right-padded trajectories: position t of `targets` is predicted from input positions <= t."""
    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    targets: torch.Tensor  # [B, L-1]
    mask: torch.Tensor  # [B, L-1] float: 1 on generated tokens (the loss mask, shifted)
    behaviour_logprobs: torch.Tensor  # [B, L-1] the rollout's sampling logprobs (0 off the mask)
    shared: int = 0  # leading tokens every row has in common, none of them generated

    @staticmethod
    def of(trajs: list[Trajectory]) -> Batch:
        n = max(len(t.token_ids) for t in trajs)
        ids = torch.zeros(len(trajs), n, dtype=torch.long)
        att = torch.zeros(len(trajs), n, dtype=torch.long)
        mask = torch.zeros(len(trajs), n)
        lp = torch.zeros(len(trajs), n)
        for i, t in enumerate(trajs):
            k = len(t.token_ids)
            ids[i, :k] = torch.tensor(t.token_ids)
            att[i, :k] = 1
            mask[i, :k] = torch.tensor(t.loss_mask, dtype=torch.float)
            lp[i, :k] = torch.tensor(t.logprobs, dtype=torch.float)
        first = min((t.loss_mask.index(1) if 1 in t.loss_mask else len(t.token_ids)) for t in trajs)
        shared = first
        if len(trajs) > 1:
            same = (ids[:, :first] == ids[:1, :first]).all(0)
            shared = int(same.long().cumprod(0).sum())
        return Batch(ids, att, ids[:, 1:], mask[:, 1:], lp[:, 1:], shared)


class PolicyModel:
    def __init__(self, model_dir: str, *, seed: int = 0, threads: int | None = None) -> None:
        from transformers import AutoModelForCausalLM
        torch.manual_seed(seed)
        if threads:
            torch.set_num_threads(threads)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.config.use_cache = False
        self.model.train()
        # transformers 5.24 renamed past_key_values to cache
        self._cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"

    def logprobs(self, batch: Batch, temperature: float = 1.0, min_shared: int = 32) -> torch.Tensor:
        """[B, L-1] log p(target) under the current weights at `temperature` (as the engine samples).

        Rows that start with the same tokens (a GRPO group's prompt; every episode's system prompt
        and tool schemas) have that prefix run once and its KV shared by the batch: exact (same
        logprobs and gradients, which flow back through the shared KV), and several times cheaper
        when the prompt dominates. Logprobs of the shared part's own targets are left 0: none is a
        generated token."""
        p = batch.shared
        if p < min_shared or batch.input_ids.shape[1] - p < 1:
            logits = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
            return _gather(logits, batch.targets, temperature)
        from transformers import DynamicCache
        n = batch.input_ids.shape[0]
        cache = DynamicCache(config=self.model.config)
        pre = self.model(input_ids=batch.input_ids[:1, :p], use_cache=True, **{self._cache_kw: cache})
        cache.batch_repeat_interleave(n)
        rest = self.model(input_ids=batch.input_ids[:, p:], attention_mask=batch.attention_mask, use_cache=True,
                          **{self._cache_kw: cache}).logits  # position p.. -> targets p..
        logits = torch.cat([pre.logits[:, -1:].expand(n, 1, -1), rest[:, :-1]], dim=1)  # targets p-1..L-2
        lp = _gather(logits, batch.targets[:, p - 1:], temperature)
        return torch.cat([lp.new_zeros(n, p - 1), lp], dim=1)

    def engine_weights(self) -> dict[str, torch.Tensor]:
        """Detached copies under Hugging Face names (what `update_weights` of a replica takes)."""
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def save(self, path: str) -> None:
        self.model.save_pretrained(path, safe_serialization=True)

    def parameters(self):
        return self.model.parameters()


def _gather(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def micro_batches(trajs: list[Trajectory], max_tokens: int) -> list[list[Trajectory]]:
    """Groups of trajectories whose padded size (count x longest) stays under `max_tokens`;
    sorted by length so padding is small."""
    out: list[list[Trajectory]] = []
    cur: list[Trajectory] = []
    for t in sorted(trajs, key=lambda t: len(t.token_ids)):
        if cur and (len(cur) + 1) * len(t.token_ids) > max_tokens:
            out.append(cur)
            cur = []
        cur.append(t)
    if cur:
        out.append(cur)
    return out
