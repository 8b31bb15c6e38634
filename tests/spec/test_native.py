"""The C++ core against the Python reference: identical counts and drafts over random operations."""
from __future__ import annotations

import random

import pytest

from rollwise.spec import _C
from rollwise.spec.suffix_tree import SuffixTree


def _same_draft(py, cpp) -> None:
    tokens, parents, probs, score, match_len = cpp
    assert (py.token_ids, py.parents, py.match_len) == (tokens, parents, match_len)
    assert py.probs == probs and py.score == score  # same double arithmetic, bit for bit


@pytest.mark.parametrize("seed", range(40))
def test_random_operations_give_identical_trees_and_drafts(seed):
    rng = random.Random(seed)
    depth = rng.choice([2, 4, 8, 24])
    vocab = rng.choice([3, 6, 40])  # small vocabularies repeat a lot; 40 exercises the child hash map
    py, cpp = SuffixTree(depth), _C.SuffixTree(depth)
    live: list[int] = []
    for step in range(150):
        op = rng.random()
        if op < 0.55 or not live:
            sid = rng.randrange(8)
            if live and rng.random() < 0.3:  # a piece of a held sequence: long shared paths to split and merge
                src = py.seqs[rng.choice(live)]
                a = rng.randrange(len(src))
                toks = src[a:a + rng.randint(1, 30)]
            else:
                toks = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
            py.append(sid, toks)
            cpp.append(sid, toks)
            if sid not in live:
                live.append(sid)
        elif op < 0.7:
            sid = live.pop(rng.randrange(len(live)))
            py.remove(sid)
            cpp.remove(sid)
        else:
            ctx = [rng.randrange(vocab) for _ in range(rng.randint(0, 30))]
            args = (rng.randint(1, 16), rng.choice([0.5, 1.0, 2.0]), rng.choice([0.0, 1.0, 3.0]),
                    rng.choice([0.0, 0.1, 0.3]), rng.random() < 0.5)
            _same_draft(py.speculate(ctx, *args), cpp.speculate(ctx, *args))
        if step % 10 == 0:
            py.check_integrity()
            cpp.check_integrity()
            assert cpp.num_nodes == py.num_nodes
            assert cpp.path_counts() == py.path_counts()
    py.check_integrity()
    cpp.check_integrity()
    assert cpp.path_counts() == py.path_counts()


def test_records_hold_runs_of_positions():
    """Path compression: 1000 distinct tokens at depth 24 are 23,724 trie positions (what num_nodes
    counts, as the Python tree does) in one record per suffix."""
    t = _C.SuffixTree(24)
    t.append(0, list(range(1000)))
    assert t.num_nodes == sum(min(24, 1000 - i) for i in range(1000))
    assert t.num_records == 1000
    t.append(1, list(range(500, 520)))  # a shared stretch splits records where counts part
    t.check_integrity()
    assert t.path_counts()[tuple(range(500, 520))] == 2 and t.path_counts()[tuple(range(500, 521))] == 1
    t.remove(0)
    t.check_integrity()
    assert t.num_nodes == sum(min(24, 20 - i) for i in range(20)) and t.num_records == 20


def test_removed_sequences_let_their_tokens_go():
    """Records spell their labels out of stored sequences; a removed sequence's tokens are kept only
    while a record still spells from them, and records follow the latest sequence through them,
    so a FIFO window of cached responses holds about the window's tokens, not every response's."""
    rng = random.Random(0)
    common = [[rng.randrange(50) for _ in range(6)] for _ in range(30)]
    t, live = _C.SuffixTree(24), []
    for i in range(600):
        toks = []
        for _ in range(20):
            toks += rng.choice(common) + [rng.randrange(1000)]
        t.append(i, toks)
        live.append(i)
        if len(live) > 8:
            t.remove(live.pop(0))
    t.check_integrity()
    assert t.num_stores <= 10
    for i in live:
        t.remove(i)
    assert (t.num_stores, t.num_records, t.num_nodes) == (0, 0, 0)


def test_native_requests_draft_from_the_best_tree():
    a, b = _C.SuffixTree(8), _C.SuffixTree(8)
    a.append(0, [1, 2, 3, 4])
    b.append(0, [1, 2, 9, 9])
    reqs = _C.Requests(8)
    reqs.set(1, [a, b], [], [1, 2])
    reqs.set(2, [None, b], [(a, 5)], [1, 2])
    reqs.set(3, [b], [], [7])
    out = reqs.speculate([1, 2, 3], [4, 4, 4], 2.0, 0.0, 0.1, False)
    assert (out[0][0], out[0][5]) == ([3, 4], 0)  # equal scores: the first tree wins
    assert (out[1][0], out[1][5]) == ([9, 9], 1)
    assert (out[2][0], out[2][5]) == ([], -1)
    reqs.append([2], [[1, 2, 7]])  # request 2 feeds tree a: "1 2" now continues with 3 or 7
    assert a.path_counts()[(1, 2, 7)] == 1
    again = reqs.speculate([1], [4], 2.0, 0.0, 0.1, False)[0]
    assert (again[0], again[5]) == ([9, 9], 1)
    reqs.drop(2)
    assert len(reqs) == 2
    with pytest.raises(ValueError, match="unknown request handle"):
        reqs.speculate([2], [4], 1.0, 0.0, 0.1, False)
    with pytest.raises(ValueError):
        reqs.append([1], [])
    with pytest.raises(ValueError):
        _C.SuffixTree(0)
