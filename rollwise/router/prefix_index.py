"""Approximate view of which replica holds which prefix: chained hashes of token blocks (the
engine's own block hashing), the replicas that recently computed each block, LRU-bounded per
replica, and reconciled with the cached-token counts replicas report."""
from __future__ import annotations

from collections import OrderedDict

from rollwise.engine.block_manager import chain_hashes


class HashMemo:
    """Block hashes of a prompt that extends the previous prompt under the same key (a trajectory's
    turn k+1 is turn k plus response and observation): only the new blocks are hashed. Prompts are
    never rewritten in place (token-in-token-out), so the previous one is kept by reference and
    compared, not copied."""

    def __init__(self, block_size: int, max_keys: int = 100_000) -> None:
        self.block_size, self.max_keys = block_size, max_keys
        self.memo: OrderedDict[str, tuple[list[int], int, list[int], int]] = OrderedDict()

    def hashes(self, token_ids: list[int], key: str | None = None, cache_salt: str | None = None) -> list[int]:
        """`cache_salt`: the request's (vLLM's), which salts its chain as the engine salts its KV."""
        bs = self.block_size
        root = 0 if cache_salt is None else hash(("cache_salt", cache_salt)) & (2**63 - 1)
        if key is None:
            return chain_hashes(token_ids, bs, root)
        prev = self.memo.pop(key, None)
        if prev is not None and prev[3] == root and prev[1] <= len(token_ids) and token_ids[:prev[1]] == (
                prev[0] if len(prev[0]) == prev[1] else prev[0][:prev[1]]):  # (one copy fewer, most turns)
            out = prev[2][:min(len(prev[2]), prev[1] // bs)]
            start = len(out) * bs
            out.extend(chain_hashes(token_ids[start:len(token_ids) // bs * bs], bs, out[-1] if out else root))
        else:
            out = chain_hashes(token_ids, bs, root)
        self.memo[key] = (token_ids, len(token_ids), out, root)
        if len(self.memo) > self.max_keys:
            self.memo.popitem(last=False)
        return list(out)


class PrefixIndex:
    """Per replica, the block hashes it recently computed with a recency tick. Prompts are inserted
    whole and trimmed from the end (reconcile) or by recency (a prefix is touched whenever an
    extension of it is), so what a replica holds is prefix-closed and its match length is found by
    binary search: O(replicas x log blocks) per decision, whatever the prompt length."""

    def __init__(self, block_size: int = 16, capacity_blocks: int = 100_000) -> None:
        self.block_size, self.capacity = block_size, capacity_blocks
        self.held: dict[str, dict[int, int]] = {}  # replica -> block hash -> recency tick
        # first block hash -> the replicas holding it (a prompt's match is 0 everywhere else)
        self.holders: dict[int, dict[str, None]] = {}
        self.tick = 0
        self._memo = HashMemo(block_size)

    def hashes(self, token_ids: list[int], key: str | None = None, cache_salt: str | None = None) -> list[int]:
        """key: the trajectory, whose previous prompt this one extends (then only new blocks are hashed)."""
        return self._memo.hashes(token_ids, key, cache_salt)

    def match(self, hashes: list[int], replicas: list[str]) -> dict[str, int]:
        """Matched prefix length in tokens, per replica."""
        out = dict.fromkeys(replicas, 0)
        if not hashes:
            return out
        for r in self.holders.get(hashes[0], ()):  # (most replicas hold none of a prompt)
            if r in out:
                held, lo, hi = self.held[r], 1, len(hashes)  # hashes[:lo] held, hashes[hi:] not
                while lo < hi:
                    mid = (lo + hi) // 2
                    if hashes[mid] in held:
                        lo = mid + 1
                    else:
                        hi = mid
                out[r] = lo * self.block_size
        return out

    def insert(self, replica: str, hashes: list[int]) -> None:
        self.tick += 1
        if not hashes:
            return
        held = self.held.setdefault(replica, {})
        held.update(dict.fromkeys(hashes, self.tick))
        self.holders.setdefault(hashes[0], {})[replica] = None
        if len(held) > self.capacity * 1.1:  # drop whole ticks, least recent first, down to capacity
            cut = sorted(held.values())[len(held) - self.capacity]  # (so a prefix never goes before its extensions)
            self.held[replica] = held = {h: t for h, t in held.items() if t > cut}
            self._forget(replica, keep=held)

    def reconcile(self, replica: str, hashes: list[int], cached_tokens: int) -> None:
        """The replica reported `cached_tokens` of this prompt cached: blocks past that are not
        there (evicted), so forget them for this replica."""
        held = self.held.get(replica)
        if held:
            for h in hashes[cached_tokens // self.block_size + 1:]:  # lenient by one: the engine recomputes the block it stops at
                held.pop(h, None)

    def remove_replica(self, replica: str) -> None:
        self.held.pop(replica, None)
        self._forget(replica, keep={})

    def _forget(self, replica: str, keep: dict[int, int]) -> None:
        """Take `replica` off the holders of every first block it no longer holds (not in `keep`)."""
        for first in [f for f, reps in self.holders.items() if replica in reps and f not in keep]:
            reps = self.holders[first]
            del reps[replica]
            if not reps:
                del self.holders[first]

    def num_blocks(self, replica: str) -> int:
        return len(self.held.get(replica, ()))
