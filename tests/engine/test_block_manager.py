"""Block manager and scheduler invariants under random operation sequences."""
from __future__ import annotations

import random
import re

import pytest

from rollwise.engine.block_manager import HASH_ALGOS, BlockManager, chain_hashes, sha256_chain_hashes
from rollwise.engine.scheduler import Scheduler
from rollwise.engine.sequence import Sequence
from rollwise.types import SamplingParams


@pytest.mark.parametrize("chain", [chain_hashes, sha256_chain_hashes])
def test_chain_hashes_identify_prefixes(chain):
    a = chain(list(range(40)), 8)
    b = chain(list(range(32)) + [99] * 8, 8)
    assert len(a) == 5 and a[:4] == b[:4] and a[4] != b[4]
    assert chain([1] * 8 + [2] * 8, 8)[1] != chain([3] * 8 + [2] * 8, 8)[1]  # chained
    assert chain(list(range(8)), 8, root=1) != chain(list(range(8)), 8, root=0)
    assert chain(list(range(8)), 8, root=2**63 - 1) != chain(list(range(8)), 8, root=2**62)
    # extended a piece at a time from the last hash, as a running sequence's are
    toks = [random.Random(3).randrange(200_000) for _ in range(100)]
    pieces, start = [], 0
    for end in (16, 40, 96):
        pieces += chain(toks[start:end], 8, pieces[-1] if pieces else 0)
        start = end
    assert pieces == chain(toks, 8)


def test_sha256_hashes_are_sha256_of_the_parent_and_the_tokens():
    import hashlib
    import struct
    toks = [5, 150_000, 7, 0]
    first = int.from_bytes(hashlib.sha256(bytes(16) + struct.pack("<4q", *toks)).digest()[:16], "little")
    second = hashlib.sha256(first.to_bytes(16, "little") + struct.pack("<4q", *toks[::-1])).digest()
    assert sha256_chain_hashes(toks + toks[::-1], 4) == [first, int.from_bytes(second[:16], "little")]
    with pytest.raises(ValueError, match=re.escape(str(HASH_ALGOS))):
        BlockManager(8, 4, hash_algo="md5")
    assert BlockManager(8, 4).chain is sha256_chain_hashes
    assert BlockManager(8, 4, hash_algo="builtin").chain is chain_hashes


def test_shared_prefix_is_reused_and_lru_evicted():
    bm = BlockManager(num_blocks=4, block_size=4)
    t1: list[int] = []
    h = chain_hashes(list(range(8)), 4)
    bm.allocate(t1, 2)
    for b, hh in zip(t1, h):
        bm.register(b, hh)
    assert bm.match_prefix(h) == t1
    t2: list[int] = []
    bm.allocate(t2, 0, shared=bm.match_prefix(h))
    assert t2 == t1 and all(bm.ref_count[b] == 2 for b in t1)
    bm.free_table(t2)
    bm.free_table(t1)
    assert bm.match_prefix(h) == [t1_b for t1_b in bm.match_prefix(h)]  # still cached after free
    assert len(bm.match_prefix(h)) == 2
    t3: list[int] = []
    bm.allocate(t3, 2)  # the two never-used blocks go first
    assert len(bm.match_prefix(h)) == 2
    bm.allocate(t3, 1)  # now a cached block must be evicted: the tail of the prefix goes first
    assert len(bm.match_prefix(h)) == 1 and bm.num_evictions == 1
    bm.check_integrity([t3])


def test_evict_cached_forgets_only_unheld_blocks():
    bm = BlockManager(num_blocks=6, block_size=4)
    held, freed = [], []
    h1, h2 = chain_hashes(list(range(8)), 4), chain_hashes(list(range(100, 108)), 4)
    for table, h in ((held, h1), (freed, h2)):
        bm.allocate(table, 2)
        for b, hh in zip(table, h):
            bm.register(b, hh)
    bm.free_table(freed)
    assert len(bm.match_prefix(h2)) == 2 and bm.num_free_blocks == 4
    assert bm.evict_cached() == 2
    assert bm.match_prefix(h2) == [] and bm.match_prefix(h1) == held and bm.num_free_blocks == 4
    bm.check_integrity([held])


def test_evict_cached_by_tag_forgets_only_that_versions_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    hashes = {v: chain_hashes(list(range(10 * v, 10 * v + 8)), 4) for v in (0, 1, 2)}
    for v, h in hashes.items():
        table = []
        bm.allocate(table, 2)
        for b, hh in zip(table, h):
            bm.register(b, hh, tag=v)
        bm.free_table(table)
    assert bm.evict_cached({0, 2}) == 4 and bm.num_free_blocks == 8
    assert bm.match_prefix(hashes[0]) == bm.match_prefix(hashes[2]) == [] and len(bm.match_prefix(hashes[1])) == 2
    table = []
    bm.allocate(table, 4)  # the forgotten blocks are reused before the pool's fresh ones
    assert bm._fresh == 6 and len(bm.match_prefix(hashes[1])) == 2
    bm.check_integrity([table])


def test_can_allocate_counts_revived_blocks():
    bm = BlockManager(num_blocks=2, block_size=4)
    t: list[int] = []
    bm.allocate(t, 2)
    for b, hh in zip(t, chain_hashes(list(range(8)), 4)):
        bm.register(b, hh)
    cached = list(t)
    bm.free_table(t)
    assert bm.can_allocate(0, cached) and not bm.can_allocate(1, cached)
    with pytest.raises(RuntimeError):
        bm.allocate([], 1, cached)


@pytest.mark.parametrize("seed", range(20))
def test_random_block_ops_keep_integrity(seed):
    """allocate / share prefix / register / free / evict against a naive reference-count oracle."""
    rng = random.Random(seed)
    bs = 4
    bm = BlockManager(num_blocks=24, block_size=bs)
    live: dict[int, tuple[list[int], list[int]]] = {}  # id -> (tokens, table)
    prefixes = [[rng.randrange(5) for _ in range(bs * 4)] for _ in range(3)]
    for step in range(400):
        op = rng.random()
        if op < 0.5:
            toks = rng.choice(prefixes)[: bs * rng.randint(0, 4)] + [rng.randrange(5) for _ in range(rng.randint(1, 9))]
            hashes = chain_hashes(toks, bs)
            hits = bm.match_prefix(hashes)
            need = bm.num_blocks_for(len(toks)) - len(hits)
            if bm.can_allocate(need, hits):
                table: list[int] = []
                bm.allocate(table, need, hits)
                for k in range(len(hits), len(hashes)):
                    bm.register(table[k], hashes[k])
                live[step] = (toks, table)
        elif op < 0.9 and live:
            k = rng.choice(sorted(live))
            bm.free_table(live.pop(k)[1])
        elif live:  # grow a sequence by a block
            k = rng.choice(sorted(live))
            if bm.can_allocate(1):
                bm.allocate(live[k][1], 1)
        bm.check_integrity([t for _, t in live.values()])
        # oracle: every cached hash maps to a block whose recorded tokens form that prefix
        for toks, table in live.values():
            for i, h in enumerate(chain_hashes(toks, bs)):
                b = bm.cached.get(h)
                assert b is None or bm.block_hash[b] == h
    for _, t in live.values():
        bm.free_table(t)
    bm.check_integrity([])
    assert bm.num_free_blocks == bm.num_blocks  # nothing leaked


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("seed", range(10))
def test_random_scheduler_ops_with_preemption(seed, policy):
    """Schedule / step / finish / abort with a tiny pool so preemption happens; no leaks."""
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=10, block_size=4)
    sch = Scheduler(bm, max_num_seqs=6, max_num_batched_tokens=16, policy=policy)
    shared = [rng.randrange(50) for _ in range(8)]
    n = 0
    for step in range(300):
        if rng.random() < 0.4 and n < 60:
            prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(50) for _ in range(rng.randint(1, 10))]
            sch.add(Sequence(f"s{n}", prompt, SamplingParams(max_tokens=12), arrival=n,
                             priority=rng.randrange(3) if policy == "priority" else 0))
            n += 1
        batch = sch.schedule()
        sch.after_step(batch)
        for s in batch:
            if s.samples:
                s.seq.token_ids.append(rng.randrange(50))
                if s.seq.num_output_tokens >= 12 or rng.random() < 0.02:
                    sch.finish(s.seq)
        if rng.random() < 0.05 and sch.running:
            sch.finish(rng.choice(sch.running))  # abort a running one
        sch.check_integrity()
        assert sum(s.num_new_tokens for s in batch) <= 16
    assert sch.num_preemptions > 0  # the small pool forces preemption
    for s in list(sch.running) + list(sch.waiting):
        sch.finish(s)
    sch.check_integrity()
    assert bm.num_free_blocks == bm.num_blocks


def _seq(rid: str, n: int, priority: int, arrival: int) -> Sequence:
    first = 100 * arrival + 1  # (no prefix shared between them)
    return Sequence(rid, list(range(first, first + n)), SamplingParams(max_tokens=8), priority=priority,
                    arrival=arrival)


def _step(sch: Scheduler) -> list[str]:
    """One step: scheduled, KV recorded, a token sampled where one is; the ids scheduled."""
    batch = sch.schedule()
    sch.after_step(batch)
    for s in batch:
        if s.samples:
            s.seq.token_ids.append(7)
    return [s.seq.request_id for s in batch]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_priority_admits_lowest_first_and_preempts_the_highest_even_if_scheduled(policy):
    """vLLM's priority policy: waiting sequences by (priority, arrival), lowest first; out of KV,
    the running one with the highest (priority, arrival) is preempted, even if it was scheduled
    earlier in the step (it leaves the batch and gives its tokens back). FCFS admits in arrival
    order and preempts the last admitted."""
    sch = Scheduler(BlockManager(num_blocks=16, block_size=4), max_num_seqs=1, max_num_batched_tokens=64,
                    policy=policy)
    for rid, prio, arrival in (("a", 5, 0), ("c", 0, 2), ("b", 0, 1)):
        sch.add(_seq(rid, 4, prio if policy == "priority" else 0, arrival))
    assert _step(sch) == (["b"] if policy == "priority" else ["a"])

    sch = Scheduler(BlockManager(num_blocks=4, block_size=4), max_num_seqs=4, max_num_batched_tokens=64,
                    policy=policy)
    low, high = _seq("low", 6, 5, 0), _seq("high", 8, 0, 1)
    sch.add(low)
    assert _step(sch) == ["low"]  # low: 7 tokens, 2 blocks
    sch.add(high)
    assert _step(sch) == ["low", "high"]  # low 8 tokens (2 blocks), high 9 (2 blocks, a third wanted)
    batch = sch.schedule()  # low decodes in its blocks; high needs a block and none is free
    if policy == "priority":  # low, scheduled first, is the one preempted
        assert [s.seq.request_id for s in batch] == ["high"] and low.num_preemptions == 1 and not high.num_preemptions
        assert sum(s.num_new_tokens for s in batch) == 1 and list(sch.waiting) == [low]
    else:  # the last admitted: high itself
        assert [s.seq.request_id for s in batch] == ["low"] and high.num_preemptions == 1 and not low.num_preemptions
    sch.check_integrity()


class _OneFreeList:
    """The reuse order as one list (what BlockManager's three-part free list must reproduce): blocks
    freed with nothing cached go to the front, cached ones to the back, allocation takes the front."""

    def __init__(self, n: int) -> None:
        self.free, self.ref, self.hash = list(range(n)), [0] * n, [None] * n

    def allocate(self, table: list[int], new: int, shared: list[int]) -> None:
        for b in shared:
            if self.ref[b] == 0:
                self.free.remove(b)
            self.ref[b] += 1
            table.append(b)
        for _ in range(new):
            b = self.free.pop(0)
            self.hash[b], self.ref[b] = None, 1
            table.append(b)

    def free_table(self, table: list[int]) -> None:
        for b in reversed(table):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free.insert(0, b) if self.hash[b] is None else self.free.append(b)


@pytest.mark.parametrize("seed", range(10))
def test_blocks_are_reused_in_free_list_order(seed):
    """Which block an allocation gets decides which cached prefix is evicted: never-used blocks in id
    order after blocks freed uncached (last freed first), cached blocks least recently freed first."""
    rng = random.Random(seed)
    bs, n = 2, 16
    bm, ref = BlockManager(num_blocks=n, block_size=bs), _OneFreeList(n)
    live: list[tuple[list[int], list[int]]] = []
    prefixes = [[rng.randrange(3) for _ in range(bs * 3)] for _ in range(3)]
    for _ in range(300):
        if rng.random() < 0.55:
            toks = rng.choice(prefixes)[: bs * rng.randint(0, 3)] + [rng.randrange(3) for _ in range(rng.randint(1, 5))]
            hashes = chain_hashes(toks, bs)
            hits = bm.match_prefix(hashes)
            need = bm.num_blocks_for(len(toks)) - len(hits)
            if bm.can_allocate(need, hits):
                t, t_ref = [], []
                bm.allocate(t, need, hits)
                ref.allocate(t_ref, need, hits)
                assert t == t_ref
                for k in range(len(hits), len(hashes)):
                    if bm.block_hash[t[k]] is None and hashes[k] not in bm.cached:
                        ref.hash[t[k]] = hashes[k]
                    bm.register(t[k], hashes[k])
                live.append((t, t_ref))
        elif live:
            t, t_ref = live.pop(rng.randrange(len(live)))
            bm.free_table(t)
            ref.free_table(t_ref)
        assert bm.num_free_blocks == len(ref.free)
        bm.check_integrity([t for t, _ in live])
