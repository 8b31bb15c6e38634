"""Paged KV blocks with prefix reuse: a pool of fixed-size blocks, per-sequence block tables, and a
map from chained block hashes to the blocks holding that prefix.

A full block's hash covers its tokens and, through its parent's hash, every token before it, so equal
hashes mean equal prefixes. Blocks whose reference count drops to zero stay cached in an LRU free list
and are evicted (their hash forgotten) only when the pool needs them. Imports no torch.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set once the block is full and registered in the cache


def chain_hashes(token_ids: list[int], block_size: int, root: int = 0) -> list[int]:
    """Hashes of every full block of `token_ids`, each chained on the previous one."""
    out, parent = [], root
    for i in range(len(token_ids) // block_size):
        parent = hash((parent, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        out.append(parent)
    return out


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # LRU first
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.num_evictions = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / len(self.blocks)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # prefix lookup -------------------------------------------------------------------------------
    def match_prefix(self, hashes: list[int]) -> list[int]:
        """Block ids holding the longest cached prefix with these hashes (no references taken)."""
        if not self.enable_prefix_caching:
            return []
        hit = []
        for h in hashes:
            b = self.cached.get(h)
            if b is None:
                break
            hit.append(b)
        return hit

    # allocation ----------------------------------------------------------------------------------
    def can_allocate(self, num_new_blocks: int, shared: list[int] = ()) -> bool:
        """Whether `num_new_blocks` fresh blocks can be taken after referencing `shared` cached ones."""
        if not shared:
            return len(self.free) >= num_new_blocks
        revived = sum(1 for b in shared if self.blocks[b].ref_count == 0)
        return len(self.free) - revived >= num_new_blocks

    def allocate(self, block_table: list[int], num_new_blocks: int, shared: list[int] = ()) -> None:
        """Append `shared` (cache hits, referenced) then `num_new_blocks` fresh blocks to a table."""
        if not self.can_allocate(num_new_blocks, shared):
            raise RuntimeError("out of KV blocks: call can_allocate first")
        for b in shared:
            blk = self.blocks[b]
            if blk.ref_count == 0:
                del self.free[b]
            blk.ref_count += 1
            block_table.append(b)
        for _ in range(num_new_blocks):
            b, _ = self.free.popitem(last=False)
            blk = self.blocks[b]
            if blk.block_hash is not None:  # evict: its cached prefix is gone
                del self.cached[blk.block_hash]
                blk.block_hash = None
                self.num_evictions += 1
            blk.ref_count = 1
            block_table.append(b)

    def register(self, block_id: int, block_hash: int) -> None:
        """Publish a full block's contents for reuse; a duplicate of a cached prefix stays private."""
        if not self.enable_prefix_caching:
            return
        blk = self.blocks[block_id]
        if blk.block_hash is None and block_hash not in self.cached:
            blk.block_hash = block_hash
            self.cached[block_hash] = block_id

    def free_table(self, block_table: list[int]) -> None:
        """Drop one reference to each block; tail blocks go to the LRU end first so prefixes outlive them."""
        for b in reversed(block_table):
            blk = self.blocks[b]
            blk.ref_count -= 1
            if blk.ref_count == 0:
                self.free[b] = None
                if blk.block_hash is None:
                    self.free.move_to_end(b, last=False)  # nothing cached there: reuse it first
        block_table.clear()

    def truncate(self, block_table: list[int], keep: int) -> None:
        """Release the blocks past the first `keep` (e.g. ones reserved for rejected draft tokens)."""
        if len(block_table) > keep:
            tail = block_table[keep:]
            del block_table[keep:]
            self.free_table(tail)

    # invariants ----------------------------------------------------------------------------------
    def check_integrity(self, live_tables: list[list[int]]) -> None:
        refs = [0] * len(self.blocks)
        for table in live_tables:
            for b in table:
                refs[b] += 1
        for blk in self.blocks:
            assert blk.ref_count == refs[blk.block_id], f"block {blk.block_id}: ref {blk.ref_count} != {refs[blk.block_id]}"
            assert (blk.ref_count == 0) == (blk.block_id in self.free), f"block {blk.block_id} free-list mismatch"
            if blk.block_hash is not None:
                assert self.cached.get(blk.block_hash) == blk.block_id, f"block {blk.block_id} hash not mapped"
        assert len(self.cached) == sum(b.block_hash is not None for b in self.blocks), "stale hash entries"
        for h, b in self.cached.items():
            assert self.blocks[b].block_hash == h, f"hash map points at block {b} with another hash"
