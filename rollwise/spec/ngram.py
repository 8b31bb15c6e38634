"""Prompt lookup (vLLM's "ngram" speculation): draft the tokens that followed the last n-gram's earlier
occurrence in the request's own prompt and output, with no tree and no other request's text.

The rule is vLLM's: the longest n in [min_n, max_n] whose last-n-tokens suffix occurred before (a
match may overlap the suffix), its earliest occurrence, and up to k tokens after it, never past the
context's end. Kept as the baseline SuffixDecoding is measured against (`rollwise bench spec`,
benchmarks/spec_engine.py), and for users who ask vLLM for it (`speculative_config`).

Same interface as SuffixCache where the engine calls it. Each request's tokens live in a growing
int32 buffer; a lookup compares the last token against the context once (numpy), then narrows the
candidates one token further back at a time.

A draft's token probabilities (what the adaptive controller weighs against a step's cost) are
learned from the tokens the request goes on to emit, whether the draft was verified or not: each
draft is followed until its first wrong token, and the hits at each depth, per matched length, give
P(token i right | tokens before it right) (a Beta(1, 1) prior: 1/2 before any). Imports no torch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rollwise.types import Draft

SOURCES = ("ngram",)


def lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> tuple[np.ndarray, int]:
    """vLLM's prompt-lookup draft for `tokens` (the whole context, int32): (up to k tokens, the
    matched n-gram's length), or (no tokens, 0)."""
    n_tok, none = len(tokens), (tokens[:0], 0)
    if n_tok < 2 or k <= 0:
        return none
    cand = np.flatnonzero(tokens[:-1] == tokens[-1])  # end positions of earlier matches, ascending
    if not cand.size:
        return none
    n = 1  # every candidate matches the last n tokens
    while n < max_n:
        keep = cand[cand >= n]
        keep = keep[tokens[keep - n] == tokens[n_tok - 1 - n]]
        if not keep.size:
            break
        cand, n = keep, n + 1
    if n < min_n:
        return none
    start = int(cand[0]) + 1  # the earliest of the longest
    return tokens[start:start + k], n


@dataclass(slots=True)
class _Context:
    buf: np.ndarray
    size: int
    pending: list[int] | None = None  # the draft being followed against the tokens emitted
    pos: int = 0  # its tokens confirmed so far
    n: int = 0  # the n-gram length it matched

    def extend(self, toks) -> None:
        need = self.size + len(toks)
        if need > len(self.buf):
            grown = np.empty(max(need, 2 * len(self.buf)), dtype=np.int32)
            grown[:self.size] = self.buf[:self.size]
            self.buf = grown
        self.buf[self.size:need] = toks
        self.size = need


class NgramCache:
    def __init__(self, *, min_n: int = 5, max_n: int = 5, max_spec_tokens: int = 16) -> None:
        if not 1 <= min_n <= max_n or max_spec_tokens < 0:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max and num_speculative_tokens >= 0, "
                             f"got {min_n}, {max_n}, {max_spec_tokens}")
        self.min_n, self.max_n, self.max_spec_tokens = min_n, max_n, max_spec_tokens
        self.requests: dict[str, _Context] = {}
        # [matched length, depth]: drafts' tokens followed, and those right (all before them right)
        self.seen = np.zeros((max_n + 1, max(max_spec_tokens, 1)))
        self.hits = np.zeros_like(self.seen)

    def start_request(self, request_id: str, prompt_token_ids: list[int], group_id: str | None = None,
                      session: str | None = None, scope: str | None = None) -> None:
        """(group, session and scope name text this rule never drafts from)"""
        ctx = _Context(np.empty(max(64, 2 * len(prompt_token_ids)), dtype=np.int32), 0)
        ctx.extend(prompt_token_ids)
        self.requests[request_id] = ctx

    def append(self, request_id: str, token_ids: list[int]) -> None:
        self.append_batch({request_id: token_ids})

    def append_batch(self, items: dict[str, list[int]]) -> None:
        for rid, toks in items.items():
            ctx = self.requests[rid]
            if ctx.pending is not None:
                self._follow(ctx, toks)
            ctx.extend(toks)

    def _follow(self, ctx: _Context, toks: list[int]) -> None:
        """Score the followed draft against the tokens emitted; drop it at its first wrong token or end."""
        d, seen, hits = ctx.pending, self.seen[ctx.n], self.hits[ctx.n]
        for t in toks:
            seen[ctx.pos] += 1
            if t != d[ctx.pos]:
                ctx.pending = None
                return
            hits[ctx.pos] += 1
            ctx.pos += 1
            if ctx.pos == len(d):
                ctx.pending = None
                return

    def token_probs(self) -> np.ndarray:
        """[matched length, depth]: the estimated probability that a draft's tokens up to that depth are right."""
        return np.cumprod((self.hits + 1) / (self.seen + 2), axis=1)

    def stop_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def add_sequence(self, token_ids: list[int], group_id: str | None = None, scope: str | None = None) -> None:
        """Other requests' text is not this rule's to draft from: ignored."""

    def speculate(self, request_id: str, max_spec_tokens: int | None = None, tree: bool | None = None) -> Draft:
        return self.speculate_batch([request_id], max_spec_tokens)[0]

    def speculate_batch(self, request_ids: list[str], max_spec_tokens: int | list[int] | None = None,
                        tree: bool | None = None) -> list[Draft]:
        """Chains only (`tree` is taken and ignored), of at most max_spec_tokens; each token's
        probability is the learned one for its depth and matched length."""
        n = self.max_spec_tokens if max_spec_tokens is None else max_spec_tokens
        budgets = n if isinstance(n, list) else [n] * len(request_ids)
        table, out = self.token_probs(), []
        for rid, k in zip(request_ids, budgets):
            ctx = self.requests[rid]
            got, n_matched = lookup(ctx.buf[:ctx.size], self.min_n, self.max_n, self.max_spec_tokens)
            full = got.tolist()
            if full and ctx.pending is None:  # followed whether verified or not (a draft followed stays)
                ctx.pending, ctx.pos, ctx.n = full, 0, n_matched
            toks = full[:max(k, 0)]
            probs = table[n_matched, :len(toks)].tolist()
            out.append(Draft(toks, list(range(-1, len(toks) - 1)), probs, float(sum(probs)),
                             n_matched if toks else 0, "ngram" if toks else ""))
        return out

    def metrics(self) -> dict[str, float]:
        return {"spec_ngram_context_tokens": float(sum(c.size for c in self.requests.values()))}
