"""Prompt lookup ("ngram" speculation): vLLM's rule, checked against a brute-force reading of it."""
from __future__ import annotations

import random

import numpy as np
import pytest

from rollwise.spec.ngram import NgramCache, lookup


def brute(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Every earlier end position's match length with the context's suffix (capped at max_n); the
    longest, at its earliest position; then up to k tokens after it, inside the context."""
    n_tok, best, at = len(tokens), 0, -1
    for e in range(n_tok - 1):
        m = 0
        while m < max_n and e - m >= 0 and tokens[e - m] == tokens[n_tok - 1 - m]:
            m += 1
        if m > best:
            best, at = m, e
    if best < max(min_n, 1) or k <= 0:
        return []
    return tokens[at + 1:at + 1 + k]


@pytest.mark.parametrize("vocab", [2, 3, 5, 50])
def test_lookup_equals_the_brute_force_rule(vocab):
    rng = random.Random(vocab)
    for _ in range(400):
        toks = [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
        lo = rng.randint(1, 4)
        hi, k = rng.randint(lo, 6), rng.randint(0, 8)
        got, n = lookup(np.asarray(toks, dtype=np.int32), lo, hi, k)
        assert got.tolist() == brute(toks, lo, hi, k), (toks, lo, hi, k)
        assert (n >= lo) == bool(len(got)) or k == 0


def test_the_longest_match_wins_over_an_earlier_shorter_one_and_ties_go_to_the_earliest():
    #        0  1  2  3  4  5  6  7  8  9 10 11 12 13
    toks = [7, 2, 3, 9, 1, 2, 3, 8, 5, 2, 3, 4, 1, 2, 3]
    got, n = lookup(np.asarray(toks, dtype=np.int32), 1, 4, 3)
    assert (got.tolist(), n) == ([8, 5, 2], 3)  # "1 2 3" at 4..6 beats "2 3" at 1..2
    got, n = lookup(np.asarray(toks, dtype=np.int32), 1, 2, 3)
    assert (got.tolist(), n) == ([9, 1, 2], 2)  # capped at 2: every "2 3" ties, the earliest wins
    assert lookup(np.asarray(toks, dtype=np.int32), 4, 5, 3)[0].tolist() == []  # no 4-gram recurs


def test_a_match_may_overlap_the_suffix_and_the_draft_stops_at_the_context_end():
    toks = np.asarray([4, 4, 4, 4], dtype=np.int32)
    got, n = lookup(toks, 1, 3, 10)
    assert (got.tolist(), n) == ([4], 3)  # "4 4 4" ends at 2: one token follows it


def test_cache_drafts_from_the_growing_context_as_the_rule_does_over_all_of_it():
    rng = random.Random(3)
    cache = NgramCache(min_n=2, max_n=4, max_spec_tokens=5)
    seqs = {}
    for r in range(4):
        seqs[f"r{r}"] = [rng.randrange(4) for _ in range(rng.randint(1, 10))]
        cache.start_request(f"r{r}", seqs[f"r{r}"], group_id="g")
    for _ in range(150):  # (the buffers grow past their first size)
        batch = {r: [rng.randrange(4) for _ in range(rng.randint(1, 3))] for r in seqs}
        cache.append_batch(batch)
        for r, toks in batch.items():
            seqs[r] += toks
        drafts = cache.speculate_batch(list(seqs), [5, 0, 2, 5])
        for d, (r, toks), k in zip(drafts, seqs.items(), [5, 0, 2, 5]):
            assert d.token_ids == brute(toks, 2, 4, k)
            assert d.parents == list(range(-1, len(d) - 1)) and d.score == pytest.approx(sum(d.probs))
            assert all(1 > a >= b > 0 for a, b in zip(d.probs, d.probs[1:] + [1e-12]))  # falling along the chain
            assert d.source == ("ngram" if len(d) else "")
    cache.add_sequence([1, 2, 3, 1, 2], "g")  # another request's text: never drafted from
    cache.stop_request("r0")
    assert "r0" not in cache.requests and set(cache.requests) == {"r1", "r2", "r3"}


def test_token_probabilities_are_learned_from_what_the_request_goes_on_to_emit():
    """Each draft is followed against the tokens emitted after it (verified or not): a text that
    repeats itself raises its drafts' probabilities toward 1, one that never does what was drafted
    lowers the first token's toward 0; depths and matched lengths keep their own counts."""
    cache, other = NgramCache(min_n=1, max_n=2, max_spec_tokens=4), NgramCache(min_n=1, max_n=2, max_spec_tokens=4)
    cache.start_request("loop", [1, 2, 3, 4] * 2)  # goes on 1 2 3 4 1 2 ...: every draft right
    other.start_request("off", [5, 6, 7, 5, 6])  # drafts 7 5 6 ..., then always emits 9 instead
    first = cache.speculate("loop")
    assert first.token_ids == [1, 2, 3, 4] and first.probs == pytest.approx([1 / 2, 1 / 4, 1 / 8, 1 / 16])
    for i in range(40):
        cache.append("loop", [[1, 2, 3, 4][i % 4]])  # one token a step, as when nothing was verified
        cache.speculate("loop")
    loop = cache.speculate("loop")
    assert loop.match_len == 2 and loop.probs[3] > 0.6  # 4-token drafts, each followed to its end
    assert cache.seen[2, 0] == cache.hits[2, 0] > 5
    for _ in range(30):
        d = other.speculate("off")
        assert d.token_ids[0] != 9
        other.append("off", [9, 5, 6])  # wrong at the first token: depth 0's count only
    assert other.speculate("off").probs[0] < 0.1
    assert other.seen[:, 1:].sum() == 0 and other.seen[2, 0] == 30 and other.hits.sum() == 0


def test_bad_lengths_are_refused():
    with pytest.raises(ValueError, match="prompt_lookup_min <= prompt_lookup_max"):
        NgramCache(min_n=4, max_n=2)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramCache(min_n=0, max_n=2)
