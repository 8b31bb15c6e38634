"""The Python suffix tree against brute-force substring counts; drafting rules."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from rollwise.spec.suffix_tree import SuffixTree


def brute_counts(seqs: dict[int, list[int]], depth: int) -> Counter:
    c: Counter = Counter()
    for s in seqs.values():
        for i in range(len(s)):
            for j in range(i + 1, min(i + depth, len(s)) + 1):
                c[tuple(s[i:j])] += 1
    return c


@pytest.mark.parametrize("seed", range(15))
def test_random_appends_and_removes_match_brute_force(seed):
    rng = random.Random(seed)
    depth = rng.choice([1, 3, 6])
    tree, seqs = SuffixTree(depth), {}
    for _ in range(60):
        op = rng.random()
        if op < 0.7:
            sid = rng.randrange(6)
            toks = [rng.randrange(4) for _ in range(rng.randint(1, 8))]
            tree.append(sid, toks)
            seqs.setdefault(sid, []).extend(toks)
        elif seqs:
            sid = rng.choice(sorted(seqs))
            tree.remove(sid)
            del seqs[sid]
        tree.check_integrity()
        assert tree.path_counts() == dict(brute_counts(seqs, depth))
    for sid in list(seqs):
        tree.remove(sid)
    tree.check_integrity()
    assert tree.num_nodes == 0


def test_chain_draft_follows_most_frequent_continuation():
    t = SuffixTree(8)
    t.append(0, [1, 2, 3, 4, 5])
    t.append(1, [1, 2, 3, 4, 5])
    t.append(2, [9, 2, 3, 7])
    d = t.speculate([8, 2, 3], max_spec_tokens=5, min_token_prob=0.0)
    # "2 3" continues with 4 twice and 7 once: 4 first, then 5 with certainty
    assert d.token_ids == [4, 5] and d.match_len == 2
    assert d.probs == pytest.approx([2 / 3, 2 / 3]) and d.score == pytest.approx(4 / 3)
    assert d.parents == [-1, 0]
    longer = t.speculate([1, 2, 3], max_spec_tokens=5)
    assert longer.token_ids == [4, 5] and longer.match_len == 3 and longer.score == pytest.approx(2.0)


def test_budget_grows_with_match_length_and_min_prob_cuts():
    t = SuffixTree(16)
    t.append(0, list(range(10)))
    assert t.speculate([0], max_spec_tokens=8, alpha=1.0, offset=0.0).token_ids == [1]  # budget = 1 * 1
    assert t.speculate([0, 1, 2], max_spec_tokens=8, alpha=1.0).token_ids == [3, 4, 5]
    assert t.speculate([0, 1, 2], max_spec_tokens=2, alpha=4.0).token_ids == [3, 4]
    assert t.speculate([0], max_spec_tokens=8, alpha=0.0, offset=2.0).token_ids == [1, 2]
    t.append(1, [0, 1, 50])
    t.append(2, [0, 1, 60])
    d = t.speculate([0, 1], max_spec_tokens=8, min_token_prob=0.4)
    assert d.token_ids == []  # 2, 50 and 60 each follow "0 1" with probability 1/3
    assert t.speculate([42], max_spec_tokens=8).token_ids == []


def test_tree_draft_is_best_first():
    t = SuffixTree(8)
    for sid, cont in enumerate([[5, 6], [5, 6], [5, 7], [8, 9]]):
        t.append(sid, [1, 2] + cont)
    d = t.speculate([1, 2], max_spec_tokens=4, alpha=2.0, tree=True, min_token_prob=0.2)
    # 5 (3/4), then 6 (1/2), then 8 (1/4), then 7 (1/4) and 9 (1/4): token 8 (pushed first) wins the tie
    assert d.token_ids == [5, 6, 8, 7] and d.parents == [-1, 0, -1, 0]
    assert d.probs == pytest.approx([0.75, 0.5, 0.25, 0.25])
    chain = t.speculate([1, 2], max_spec_tokens=4, alpha=2.0, min_token_prob=0.2)
    assert chain.token_ids == [5, 6] and d.score > chain.score
