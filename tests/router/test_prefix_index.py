import random

from rollwise.engine.block_manager import chain_hashes
from rollwise.router.prefix_index import HashMemo, PrefixIndex


def _naive_match(held: set, hashes: list[int], bs: int) -> int:
    n = 0
    for h in hashes:
        if h not in held:
            break
        n += bs
    return n


def test_match_equals_a_linear_scan_after_random_inserts_evictions_and_reconciles():
    rng = random.Random(0)
    idx = PrefixIndex(block_size=4, capacity_blocks=60)
    roots = [[rng.randrange(50) for _ in range(12)] for _ in range(5)]
    for _ in range(400):
        toks = rng.choice(roots) + [rng.randrange(50) for _ in range(rng.randrange(0, 40))]
        hs = idx.hashes(toks)
        r = f"r{rng.randrange(3)}"
        op = rng.random()
        if op < 0.6:
            idx.insert(r, hs)
        elif op < 0.8:
            idx.reconcile(r, hs, rng.randrange(0, len(toks) + 1))
        elif op < 0.82:
            idx.remove_replica(r)
        got = idx.match(hs, ["r0", "r1", "r2"])
        for name in ("r0", "r1", "r2"):
            assert got[name] == _naive_match(set(idx.held.get(name, {})), hs, 4)
        assert all(idx.num_blocks(n) <= 66 for n in ("r0", "r1", "r2"))
        firsts = {idx.hashes(root[:4])[0] for root in roots}  # the index of who holds each prompt's first block
        assert {f: set(reps) for f, reps in idx.holders.items()} == {
            f: {n for n, held in idx.held.items() if f in held} for f in firsts if any(f in h for h in idx.held.values())}


def test_a_prefix_outlives_its_extensions_under_eviction():
    idx = PrefixIndex(block_size=2, capacity_blocks=10)
    base = [1, 2, 3, 4]
    idx.insert("a", idx.hashes(base + [9, 9, 9, 9, 9, 9]))
    for i in range(10):  # newer extensions of the same prefix push the old one out
        idx.insert("a", idx.hashes(base + [i + 10] * 6))
    assert idx.match(idx.hashes(base), ["a"])["a"] == 4
    assert idx.match(idx.hashes(base + [9] * 6), ["a"])["a"] == 4  # the old extension is gone, its prefix is not


def test_hash_memo_extends_and_detects_a_different_prompt():
    memo = HashMemo(4)
    a = list(range(10))
    assert memo.hashes(a, "t") == chain_hashes(a, 4)
    b = a + [7, 7, 7, 7, 7, 7, 7]
    assert memo.hashes(b, "t") == chain_hashes(b, 4)
    c = [0] + b[1:]  # same length class, different content: recomputed, not reused
    assert memo.hashes(c, "t") == chain_hashes(c, 4)
    assert memo.hashes(c[:5], "t") == chain_hashes(c[:5], 4)  # shorter than the previous one


def test_a_cache_salt_changes_every_hash_and_the_memo_keeps_salts_apart():
    memo, toks = HashMemo(4), list(range(20))
    salted = memo.hashes(toks, None, "a")
    assert len(salted) == 5 and not set(salted) & set(chain_hashes(toks, 4))
    assert memo.hashes(toks, None, "a") == salted != memo.hashes(toks, None, "b")
    longer = toks + [1, 2, 3, 4]
    memo.hashes(toks, "t", "a")  # a trajectory's next prompt under another salt is hashed from its root
    assert memo.hashes(longer, "t") == chain_hashes(longer, 4)
    assert memo.hashes(longer, "t", "a") == memo.hashes(longer, None, "a")
