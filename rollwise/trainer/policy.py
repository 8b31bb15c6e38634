"""The trainable policy: the model directory loaded with transformers (made for training: autograd,
attention masks), token log-probabilities of trajectories in padded micro-batches, and its weights
under Hugging Face names for the inference replicas."""
from __future__ import annotations

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
        return Batch(ids, att, ids[:, 1:], mask[:, 1:], lp[:, 1:])


class PolicyModel:
    def __init__(self, model_dir: str, *, seed: int = 0, threads: int | None = None) -> None:
        from transformers import AutoModelForCausalLM
        torch.manual_seed(seed)
        if threads:
            torch.set_num_threads(threads)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.config.use_cache = False
        self.model.train()

    def logprobs(self, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
        """[B, L-1] log p(target) under the current weights at `temperature` (as the engine samples)."""
        logits = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
        if temperature != 1.0:
            logits = logits / temperature
        return torch.log_softmax(logits.float(), dim=-1).gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)

    def engine_weights(self) -> dict[str, torch.Tensor]:
        """Detached copies under Hugging Face names (what `update_weights` of a replica takes)."""
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def save(self, path: str) -> None:
        self.model.save_pretrained(path, safe_serialization=True)

    def parameters(self):
        return self.model.parameters()


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
