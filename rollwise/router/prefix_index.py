"""Approximate view of which replica holds which prefix: chained hashes of token blocks (the
engine's own block hashing), the replicas that recently computed each block, LRU-bounded per
replica, and reconciled with the cached-token counts replicas report."""
from __future__ import annotations

import time
from collections import OrderedDict

from rollwise.engine.block_manager import chain_hashes


class PrefixIndex:
    def __init__(self, block_size: int = 16, capacity_blocks: int = 100_000) -> None:
        self.block_size, self.capacity = block_size, capacity_blocks
        self.owners: dict[int, dict[str, float]] = {}  # block hash -> replica -> last time seen
        self.lru: dict[str, OrderedDict[int, None]] = {}

    def hashes(self, token_ids: list[int]) -> list[int]:
        return chain_hashes(token_ids, self.block_size)

    def match(self, hashes: list[int], replicas: list[str]) -> dict[str, int]:
        """Matched prefix length in tokens, per replica."""
        out = dict.fromkeys(replicas, 0)
        live, depth = set(replicas), 0
        for h in hashes:
            owners = self.owners.get(h)
            nxt = live & owners.keys() if owners else set()
            for r in live - nxt:
                out[r] = depth
            live, depth = nxt, depth + self.block_size
            if not live:
                return out
        for r in live:
            out[r] = depth
        return out

    def insert(self, replica: str, hashes: list[int]) -> None:
        now = time.monotonic()
        lru = self.lru.setdefault(replica, OrderedDict())
        for h in hashes:
            self.owners.setdefault(h, {})[replica] = now
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.capacity:
            old, _ = lru.popitem(last=False)
            self._drop(old, replica)

    def reconcile(self, replica: str, hashes: list[int], cached_tokens: int) -> None:
        """The replica reported `cached_tokens` of this prompt cached: blocks past that are not
        there (evicted), so forget them for this replica."""
        keep = cached_tokens // self.block_size
        lru = self.lru.get(replica)
        for h in hashes[keep + 1:]:  # the engine recomputes the block it stops at; be lenient by one
            if self.owners.get(h, {}).pop(replica, None) is not None and lru is not None:
                lru.pop(h, None)

    def remove_replica(self, replica: str) -> None:
        for h in self.lru.pop(replica, {}):
            self._drop(h, replica)

    def _drop(self, h: int, replica: str) -> None:
        owners = self.owners.get(h)
        if owners is not None:
            owners.pop(replica, None)
            if not owners:
                del self.owners[h]
