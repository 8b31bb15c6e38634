"""The engine's scheduler rules, mirrored for the simulated replica (a mixin of `SimReplica`):
continuous batching of running sequences under a token budget (chunked prefill), admission in
arrival order with prefix reuse through the engine's own `BlockManager` (waiting for a prefix a
running sequence is computing), preemption of the newest sequence when blocks run out, and
block-hash registration as blocks fill. The replica owns the state (`running`, `waiting`,
`blocks`, `bs`, `stats`, the limits); this is how it moves."""
from __future__ import annotations

from rollwise.engine.block_manager import chain_hashes


class Seq:
    __slots__ = ("rid", "req", "full", "prompt_len", "out_len", "emitted", "num_tokens", "computed", "table",
                 "hashes", "registered", "cached", "future", "aborted")

    def __init__(self, rid, req, full, prompt_len, hashes, future) -> None:
        self.rid, self.req, self.full, self.prompt_len = rid, req, full, prompt_len
        self.out_len, self.emitted, self.num_tokens, self.computed = len(full) - prompt_len, 0, prompt_len, 0
        self.table: list[int] = []
        self.hashes, self.registered, self.cached = hashes, 0, -1
        self.future, self.aborted = future, False

    def decodes(self, n: int) -> bool:
        """Whether computing `n` tokens this step is a decode (one token after the prompt, sampled).
        (The step loops inline this test: they run once per sequence per step.)"""
        return n == 1 and self.computed + 1 == self.num_tokens and self.computed >= self.prompt_len


class Scheduling:
    """How sequences are batched, admitted, preempted and their blocks registered."""

    def _schedule(self) -> tuple[list[tuple[Seq, int]], bool]:
        """The engine's scheduler rules. Returns the batch and whether admission is blocked until
        something finishes (so a stretch of identical steps is exact)."""
        blocks, budget, out, preempted, i = self.blocks, self.max_num_batched_tokens, [], False, 0
        bs, running, decode_only = self.bs, self.running, True
        while i < len(running) and budget > 0:
            seq = running[i]
            c = seq.computed
            n = seq.num_tokens - c
            if n > budget:
                n = budget
            need = (c + n + bs - 1) // bs - len(seq.table)
            if need > 0:  # (most decode steps fit in the last block)
                while not blocks.can_allocate(need) and self.running[-1] is not seq:
                    self._preempt(self.running.pop())
                    preempted = True
                if not blocks.can_allocate(need):
                    self._preempt(self.running.pop(i))
                    preempted = True
                    continue
                blocks.allocate(seq.table, need)
            if decode_only and not (n == 1 and c + 1 == seq.num_tokens and c >= seq.prompt_len):
                decode_only = False
            out.append((seq, n))
            budget -= n
            i += 1
        admitted, pending, deferred = False, None, []
        while (self.waiting and budget > 0 and not preempted and not self._head_blocked
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[0]
            full = seq.num_tokens // bs
            hashes = self._hashes(seq, full)
            hits = blocks.match_prefix(hashes[:full])
            if len(hits) < full and blocks.enable_prefix_caching and self.share_computing_prefix:
                pending = self._computing() if pending is None else pending
                if hashes[len(hits)] in pending:  # a sibling computes this prefix now: reuse it next step
                    deferred.append(self.waiting.popleft())
                    continue
            if len(hits) * self.bs >= seq.num_tokens:
                hits = hits[:-1]
            cached = len(hits) * self.bs
            n = min(seq.num_tokens - cached, budget)
            need = blocks.num_blocks_for(cached + n) - len(hits)
            if not blocks.can_allocate(need, hits):
                self._head_blocked = not deferred  # (a deferred one goes first next step, with its hits)
                break
            self.waiting.popleft()
            blocks.allocate(seq.table, need, hits)
            seq.computed, seq.registered = cached, len(hits)
            if seq.cached < 0:
                seq.cached = cached
            self.stats["prefix_queries"] += seq.num_tokens
            self.stats["prefix_hits"] += cached
            self.running.append(seq)
            out.append((seq, n))
            budget -= n
            admitted = True
            if pending is not None:
                pending.update(hashes[len(hits):full])
        self.waiting.extendleft(reversed(deferred))
        return out, decode_only and not admitted and not preempted and budget > 0 and not deferred

    def _computing(self) -> set[int]:
        """Hashes of the full blocks running sequences have still to compute (the engine's rule)."""
        bs, out = self.bs, set()
        for r in self.running:
            if r.num_tokens - r.computed > 1:
                full = r.num_tokens // bs
                out.update(self._hashes(r, full)[r.computed // bs:full])
        return out

    def _stretch(self, batch) -> int:
        """Pure decode steps that can run before anything changes: up to the first finish, and no
        further than the free blocks allow (past that a preemption is due: single steps)."""
        k = min(s.out_len - s.emitted for s, _ in batch)
        free, bs = self.blocks.num_free_blocks, self.bs
        computed, held = [s.computed + bs - 1 for s, _ in batch], sum(len(s.table) for s, _ in batch)

        def need(j: int) -> int:
            return sum([(c + j) // bs for c in computed]) - held
        if need(k) <= free:
            return k
        lo, hi = 1, k  # need(lo) <= free < need(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if need(mid) <= free else (lo, mid)
        return lo

    def _hashes(self, s: Seq, num_blocks: int) -> list[int]:
        """The sequence's block hashes, at least `num_blocks` of them (its list, not a copy)."""
        if len(s.hashes) < num_blocks:
            start = len(s.hashes) * self.bs
            s.hashes.extend(chain_hashes(s.full[start:num_blocks * self.bs], self.bs, s.hashes[-1] if s.hashes else 0))
        return s.hashes

    def _register(self, s: Seq) -> None:
        full = min(s.computed // self.bs, len(s.table))
        if full > s.registered:
            hashes = self._hashes(s, full)
            for j in range(s.registered, full):
                self.blocks.register(s.table[j], hashes[j])
            s.registered = full

    def _preempt(self, s: Seq) -> None:
        self._head_blocked = False
        self.blocks.free_table(s.table)
        s.computed = s.registered = 0
        self.stats["preemptions"] += 1
        self.waiting.appendleft(s)
