"""Prompt lookup (vLLM's "ngram" speculation): draft the tokens that followed the last n-gram's earlier
occurrence in the request's own prompt and output, with no tree and no other request's text.

The rule is vLLM's: the longest n in [min_n, max_n] whose last-n-tokens suffix occurred before (a
match may overlap the suffix), its earliest occurrence, and up to k tokens after it, never past the
context's end. Kept as the baseline SuffixDecoding is measured against (`rollwise bench spec`,
benchmarks/spec_engine.py), and for users who ask vLLM for it (`speculative_config`).

Same interface as SuffixCache where the engine calls it. Each request's tokens live in a growing
int32 buffer; a lookup compares the last token against the context once (numpy), then narrows the
candidates one token further back at a time. Imports no torch.
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

    def start_request(self, request_id: str, prompt_token_ids: list[int], group_id: str | None = None,
                      session: str | None = None, scope: str | None = None) -> None:
        """(group, session and scope name text this rule never drafts from)"""
        ctx = _Context(np.empty(max(64, 2 * len(prompt_token_ids)), dtype=np.int32), 0)
        ctx.extend(prompt_token_ids)
        self.requests[request_id] = ctx

    def append(self, request_id: str, token_ids: list[int]) -> None:
        self.requests[request_id].extend(token_ids)

    def append_batch(self, items: dict[str, list[int]]) -> None:
        for rid, toks in items.items():
            self.requests[rid].extend(toks)

    def stop_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def add_sequence(self, token_ids: list[int], group_id: str | None = None, scope: str | None = None) -> None:
        """Other requests' text is not this rule's to draft from: ignored."""

    def speculate(self, request_id: str, max_spec_tokens: int | None = None, tree: bool | None = None) -> Draft:
        return self.speculate_batch([request_id], max_spec_tokens)[0]

    def speculate_batch(self, request_ids: list[str], max_spec_tokens: int | list[int] | None = None,
                        tree: bool | None = None) -> list[Draft]:
        """Chains only (`tree` is taken and ignored). A draft's tokens count as certain (probability 1):
        the adaptive controller learns this source's real acceptance from verification."""
        n = self.max_spec_tokens if max_spec_tokens is None else max_spec_tokens
        budgets = n if isinstance(n, list) else [n] * len(request_ids)
        out = []
        for rid, k in zip(request_ids, budgets):
            ctx = self.requests[rid]
            got, n_matched = lookup(ctx.buf[:ctx.size], self.min_n, self.max_n, k)
            toks = got.tolist()
            out.append(Draft(toks, list(range(-1, len(toks) - 1)), [1.0] * len(toks), float(len(toks)),
                             n_matched if toks else 0, "ngram" if toks else ""))
        return out

    def metrics(self) -> dict[str, float]:
        return {"spec_ngram_context_tokens": float(sum(c.size for c in self.requests.values()))}
