"""Paged KV blocks with prefix reuse: a pool of fixed-size blocks, per-sequence block tables, and a
map from chained block hashes to the blocks holding that prefix.

A full block's hash covers its tokens and, through its parent's hash, every token before it, so equal
hashes mean equal prefixes. Blocks whose reference count drops to zero stay cached in an LRU free list
and are evicted (their hash forgotten) only when the pool needs them. Imports no torch.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

HASH_ALGOS = ("sha256", "builtin")  # vLLM's --prefix-caching-hash-algo (its default), and Python's hash()


def chain_hashes(token_ids: list[int], block_size: int, root: int = 0) -> list[int]:
    """Hashes of every full block of `token_ids`, each chained on the previous one (Python's tuple
    hash: fast, but a block can be crafted to collide with a known one; the router's index and the
    simulator use it, where a collision only misplaces a request)."""
    out, parent = [], root
    for i in range(len(token_ids) // block_size):
        parent = hash((parent, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        out.append(parent)
    return out


def sha256_chain_hashes(token_ids: list[int], block_size: int, root: int = 0) -> list[int]:
    """As chain_hashes, each hash the first 128 bits of SHA-256 over its parent's and its block's
    tokens (8 bytes each). Python's tuple hash of small ints can be inverted step by step, so a
    meet-in-the-middle search (~2^32 steps each way, an estimate) could find a block with the hash of
    any block it knows, e.g. a public system prompt's: sent first, its KV would be served to every
    request with that prompt."""
    n, width = len(token_ids) // block_size, 8 * block_size
    data, out, parent = array("q", token_ids[:n * block_size]).tobytes(), [], root
    for i in range(n):
        digest = hashlib.sha256(parent.to_bytes(16, "little") + data[i * width:(i + 1) * width]).digest()
        parent = int.from_bytes(digest[:16], "little")
        out.append(parent)
    return out


CHAINS = {"sha256": sha256_chain_hashes, "builtin": chain_hashes}


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_algo: str = "sha256") -> None:
        if hash_algo not in CHAINS:
            raise ValueError(f"hash_algo must be one of {HASH_ALGOS}, got {hash_algo!r}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.chain = CHAINS[hash_algo]  # how sequences hash their blocks (Sequence.full_block_hashes)
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks  # set once full and registered in the cache
        self.block_tag: list = [None] * num_blocks  # what a cached block was computed under (its weights version)
        # The free list, in reuse order, kept in three parts so a large pool costs nothing to create:
        # blocks freed with nothing cached (last freed first), then never-used blocks in id order, then
        # cached blocks, least recently freed first (LRU eviction).
        self._spare: list[int] = []
        self._fresh = 0  # blocks _fresh.. were never used
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._spare) + self.num_blocks - self._fresh + len(self._lru)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # prefix lookup -------------------------------------------------------------------------------
    def match_prefix(self, hashes: list[int]) -> list[int]:
        """Block ids holding the longest cached prefix with these hashes (no references taken)."""
        if not self.enable_prefix_caching:
            return []
        hit, get = [], self.cached.get
        for h in hashes:
            b = get(h)
            if b is None:
                break
            hit.append(b)
        return hit

    # allocation ----------------------------------------------------------------------------------
    def can_allocate(self, num_new_blocks: int, shared: list[int] = ()) -> bool:
        """Whether `num_new_blocks` fresh blocks can be taken after referencing `shared` cached ones."""
        free = self.num_free_blocks
        if free - len(shared) >= num_new_blocks:  # (however many of `shared` it revives)
            return True
        ref = self.ref_count
        return free - [ref[b] for b in shared].count(0) >= num_new_blocks

    def allocate(self, block_table: list[int], num_new_blocks: int, shared: list[int] = ()) -> None:
        """Append `shared` (cache hits, referenced) then `num_new_blocks` fresh blocks to a table."""
        if not self.can_allocate(num_new_blocks, shared):
            raise RuntimeError("out of KV blocks: call can_allocate first")
        ref, lru = self.ref_count, self._lru
        for b in shared:
            if ref[b]:
                ref[b] += 1
            else:
                del lru[b]
                ref[b] = 1
        block_table.extend(shared)
        for _ in range(num_new_blocks):
            if self._spare:
                b = self._spare.pop()
            elif self._fresh < self.num_blocks:
                b = self._fresh
                self._fresh += 1
            else:  # evict: the least recently freed cached prefix block is gone
                b, _ = self._lru.popitem(last=False)
                del self.cached[self.block_hash[b]]
                self.block_hash[b] = None
                self.num_evictions += 1
            ref[b] = 1
            block_table.append(b)

    def register(self, block_id: int, block_hash: int, tag=None) -> None:
        """Publish a full block's contents for reuse (`tag`: what it was computed under, for
        `evict_cached`); a duplicate of a cached prefix stays private."""
        if self.enable_prefix_caching and self.block_hash[block_id] is None and block_hash not in self.cached:
            self.block_hash[block_id] = block_hash
            self.block_tag[block_id] = tag
            self.cached[block_hash] = block_id

    def free_table(self, block_table: list[int]) -> None:
        """Drop one reference to each block; tail blocks are freed first so cached prefixes outlive
        their tails, and blocks with nothing cached are reused before any cached one."""
        ref, hashes, spare, lru = self.ref_count, self.block_hash, self._spare, self._lru
        for b in reversed(block_table):
            r = ref[b] - 1
            ref[b] = r
            if not r:
                if hashes[b] is None:
                    spare.append(b)
                else:
                    lru[b] = None
        block_table.clear()

    def evict_cached(self, tags=None) -> int:
        """Forget the cached prefix blocks no sequence holds (every one, or those registered with one
        of `tags`): they become plain free blocks, reused first. How many."""
        dead = list(self._lru) if tags is None else [b for b in self._lru if self.block_tag[b] in tags]
        for b in dead:
            del self.cached[self.block_hash[b]]
            self.block_hash[b] = None
            del self._lru[b]
            self._spare.append(b)
        return len(dead)

    def reset(self) -> None:
        """Every block fresh, nothing cached (the KV pool was given back: sleep mode). No block may be held."""
        if any(self.ref_count):
            raise RuntimeError("blocks are held: the KV pool cannot be reset under running sequences")
        self.block_hash, self.block_tag = [None] * self.num_blocks, [None] * self.num_blocks
        self._spare, self._fresh = [], 0
        self._lru.clear()
        self.cached.clear()

    def truncate(self, block_table: list[int], keep: int) -> None:
        """Release the blocks past the first `keep` (e.g. ones reserved for rejected draft tokens)."""
        if len(block_table) > keep:
            tail = block_table[keep:]
            del block_table[keep:]
            self.free_table(tail)

    # invariants ----------------------------------------------------------------------------------
    def check_integrity(self, live_tables: list[list[int]]) -> None:
        refs = [0] * self.num_blocks
        for table in live_tables:
            for b in table:
                refs[b] += 1
        free = [*self._spare, *range(self._fresh, self.num_blocks), *self._lru]
        assert len(free) == len(set(free)), "a block is on the free list twice"
        free_set = set(free)
        for b in range(self.num_blocks):
            assert self.ref_count[b] == refs[b], f"block {b}: ref {self.ref_count[b]} != {refs[b]}"
            assert (refs[b] == 0) == (b in free_set), f"block {b} free-list mismatch"
            if self.block_hash[b] is not None:
                assert self.cached.get(self.block_hash[b]) == b, f"block {b} hash not mapped"
        assert all(self.block_hash[b] is None for b in self._spare), "a cached block among the spare ones"
        assert all(self.block_hash[b] is not None for b in self._lru), "an uncached block in the LRU part"
        assert all(self.block_hash[b] is None for b in range(self._fresh, self.num_blocks)), "a used block as fresh"
        assert len(self.cached) == sum(h is not None for h in self.block_hash), "stale hash entries"
        for h, b in self.cached.items():
            assert self.block_hash[b] == h, f"hash map points at block {b} with another hash"
