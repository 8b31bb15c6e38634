"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, and sampled-token logprobs.

Sampling uses the exponential race (argmax of p / E with E ~ Exp(1)), which draws exactly from p.
A seeded request draws E from a generator keyed by (seed, output position), so its tokens do not
depend on which other requests share the batch or on preemption.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rollwise.types import SamplingParams


@dataclass(slots=True)
class SampleRow:
    params: SamplingParams
    position: int  # index of the output token being sampled
    banned: tuple[int, ...] = ()  # e.g. EOS before min_tokens
    forced: int | None = None  # trace replay: emit this token (its logprob is still the model's)


class Sampler:
    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def generator_for(self, params: SamplingParams, position: int) -> torch.Generator:
        """A seeded request's own stream for output position `position`; otherwise the engine's."""
        if params.seed is None:
            return self.generator
        return torch.Generator().manual_seed(hash((params.seed, position, 0x5EED)) & (2**63 - 1))  # ints: same in every process

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> tuple[list[int], list[float]]:
        """logits [B, V] float32 -> sampled token ids and their logprobs."""
        logits = logits.float().cpu()
        for i, r in enumerate(rows):
            if r.banned:
                logits[i, list(r.banned)] = float("-inf")
        temps = torch.tensor([r.params.temperature if r.params.temperature > 0 else 1.0 for r in rows])
        scaled = logits / temps[:, None]
        logprobs = torch.log_softmax(scaled, dim=-1)
        tokens = logprobs.argmax(dim=-1)
        rand = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if rand:
            tokens[rand] = self._sample(scaled[rand], [rows[i] for i in rand])
        for i, r in enumerate(rows):
            if r.forced is not None:
                tokens[i] = r.forced
        chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
        return tokens.tolist(), chosen.tolist()

    def _sample(self, scaled: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        scaled = top_k_top_p(scaled, [r.params.top_k for r in rows], [r.params.top_p for r in rows])
        probs = torch.softmax(scaled, dim=-1)
        noise = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(rows) if r.params.seed is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1]).exponential_(generator=self.generator)
        for i, r in enumerate(rows):
            if r.params.seed is not None:
                g = torch.Generator().manual_seed(seeded_stream(r.params.seed, r.position))
                noise[i].exponential_(generator=g)
        return (probs / noise).argmax(dim=-1)


def seeded_stream(seed: int, position: int) -> int:
    """The seed of a seeded request's sampling noise at output `position` (ints: the same in every process)."""
    return hash((seed, position)) & (2**63 - 1)


def top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    use_k = any(k > 0 for k in top_k)
    use_p = any(p < 1.0 for p in top_p)
    if not (use_k or use_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[1]
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if use_k:
        k = torch.tensor([kk if kk > 0 else vocab for kk in top_k])
        remove |= torch.arange(vocab)[None, :] >= k[:, None]
    if use_p:
        probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
        remove |= before >= torch.tensor(top_p)[:, None]
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
