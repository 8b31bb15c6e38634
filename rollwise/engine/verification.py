"""Verification of drafted tokens: which to accept, and the token that follows them.

Given the target model's logits at the last token (row 0) and at every draft token (row i + 1), walk
the draft tree from the root. Greedy: accept the child equal to the target's argmax. Sampling
(temperature > 0): at each node try its children in draft order, accepting child x with probability
p'(x), where p' is the target distribution with the already rejected siblings removed and
renormalised; if none is accepted, sample from p'. This is exact rejection sampling for
deterministic (multi-)drafts: every emitted token has the target distribution, so speculation is
lossless. A seeded request instead draws each position's token exactly as the plain sampler would
(the same (seed, position) uniform, inverse CDF) and accepts the child that matches it: also
exact for deterministic drafts, and the tokens no longer depend on what was drafted, so a seeded
request gives the same output with speculation as without, whatever else is in the batch.
Teacher forcing (trace replay) accepts the child equal to the recorded token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rollwise.engine.sampler import (argmax, asked_logprobs, inverse_cdf, processed, sampling_probs, seeded_uniform,
                                     shown_logprobs)
from rollwise.types import Draft, SamplingParams


@dataclass(slots=True)
class Verdict:
    accepted: list[int]  # indices of accepted draft tokens, root to leaf
    tokens: list[int]  # emitted tokens: the accepted draft tokens, then one more
    logprobs: list[float]
    top: list[dict[int, float] | None]  # each emitted token's top logprobs (SamplingParams.logprobs), with its rank


def _verdict(accepted: list[int], tokens: list[int], lps: list[float], logprobs: torch.Tensor,
             params: SamplingParams) -> Verdict:
    """The emitted tokens come from rows 0 (the last token) and 1 + each accepted draft index."""
    rows = [0] + [i + 1 for i in accepted][:len(tokens) - 1]
    asked = params.logprobs or params.logprob_token_ids
    top = asked_logprobs(logprobs[rows], [params] * len(rows), torch.tensor(lps)) if asked else [None] * len(tokens)
    return Verdict(accepted, tokens, lps, top)


def draft_paths(draft: Draft) -> list[list[int]]:
    """Each draft token's path from the root: the tokens it is verified after, itself included."""
    paths: list[list[int]] = []
    for t, p in zip(draft.token_ids, draft.parents):
        paths.append((paths[p] if p >= 0 else []) + [t])
    return paths


def children_of(parents: list[int]) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        kids.setdefault(p, []).append(i)
    return kids


@torch.inference_mode()
def verify(logits: torch.Tensor, draft: Draft, params: SamplingParams, position: int,
           forced: list[int] | None, generator: torch.Generator, tokens: list[int] | None = None,
           logprobs_mode: str | None = None) -> Verdict:
    """logits [1 + len(draft), V] (float32, CPU); position: output index of the first new token;
    tokens: the prompt and output so far (needed only for penalties); logprobs_mode: what the verdict's
    logprobs are (sampler.shown_logprobs), as the sampler's."""
    raw = logits
    if params.has_logit_rules or params.has_penalties:
        logits = processed(logits, params, tokens, position, [[]] + draft_paths(draft))
    temp = params.temperature if params.temperature > 0 else 1.0
    scaled = logits if temp == 1.0 else logits / temp  # (x / 1.0 is x: no pass over [1 + k, V] for it)
    logprobs = torch.log_softmax(scaled, dim=-1)
    shown = shown_logprobs(logprobs_mode, raw, scaled, logprobs, [params] * len(scaled))
    kids = children_of(draft.parents)
    accepted, tokens, lps = [], [], []
    node = -1  # the sequence's last token
    if forced is not None or params.is_greedy:
        targets = argmax(logprobs).tolist() if forced is None else None
        while True:
            row = node + 1
            want = targets[row] if forced is None else forced[position + len(tokens)]
            tokens.append(want)
            lps.append(float(shown[row, want]))
            nxt = next((i for i in kids.get(node, ()) if draft.token_ids[i] == want), None)
            if nxt is None or (forced is not None and position + len(tokens) >= len(forced)):
                return _verdict(accepted, tokens, lps, shown, params)
            accepted.append(nxt)
            node = nxt
    probs = sampling_probs(scaled, [params.top_k] * len(scaled), [params.top_p] * len(scaled),
                           [params.min_p] * len(scaled))  # (unnormalized rows)
    if params.seed is not None:
        while True:
            row = node + 1
            u = torch.tensor([seeded_uniform(params.seed, position + len(tokens))], dtype=torch.float64)
            tok = int(inverse_cdf(probs[row:row + 1], u)[0])
            tokens.append(tok)
            lps.append(float(shown[row, tok]))
            nxt = next((i for i in kids.get(node, ()) if draft.token_ids[i] == tok), None)
            if nxt is None:
                return _verdict(accepted, tokens, lps, shown, params)
            accepted.append(nxt)
            node = nxt
    while True:
        row = node + 1
        p = probs[row].clone()
        nxt = None
        for i in kids.get(node, ()):
            x = draft.token_ids[i]
            mass = float(p.sum())
            if mass > 0 and float(torch.rand((), generator=generator)) * mass < float(p[x]):
                nxt = i
                break
            p[x] = 0.0  # rejected: sample among the rest
        if nxt is None:
            tok = int(torch.multinomial(p / p.sum(), 1, generator=generator))
            tokens.append(tok)
            lps.append(float(shown[row, tok]))
            return _verdict(accepted, tokens, lps, shown, params)
        accepted.append(nxt)
        tokens.append(draft.token_ids[nxt])
        lps.append(float(shown[row, draft.token_ids[nxt]]))
        node = nxt
