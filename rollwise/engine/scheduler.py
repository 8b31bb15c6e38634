"""Continuous batching: which sequences run this step and how many tokens each. Imports no torch.

Each step has a token budget. Running sequences go first (a decode costs one token, an unfinished
prefill continues in chunks); waiting ones are admitted while budget, `max_num_seqs` and KV blocks
allow, reusing cached prefix blocks (one whose prefix a running sequence is computing waits
for it instead of computing it too). When a running sequence needs a block and none is free, the
most recently admitted sequence is preempted: its blocks are released (they stay in the prefix cache
while nothing reuses them) and it is recomputed later. Under the "priority" policy (vLLM's) waiting
sequences are admitted by (priority, arrival), lowest first, and the running sequence with the
highest is the one preempted (given back its budget if it was already scheduled this step).
While `holding` (a drain before a pause), new sequences are held back, not admitted, until `hold(False)`.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from rollwise.engine.block_manager import BlockManager
from rollwise.engine.sequence import Sequence, Status
from rollwise.types import Draft


@dataclass(slots=True, eq=False)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens of the sequence computed this step (after verification: + accepted)
    num_computed_before: int
    draft: Draft | None = None  # speculated tokens verified after the last one

    @property
    def is_decode(self) -> bool:
        return self.num_new_tokens == 1 and self.samples and self.num_computed_before >= self.seq.prompt_len

    @property
    def samples(self) -> bool:
        """Whether this step reaches the sequence's last token, so a new token is sampled."""
        return self.num_computed_before + self.num_new_tokens == self.seq.num_tokens


class Scheduler:
    share_computing_prefix = True  # False: admit a sibling beside the one computing its prefix (an A/B baseline)

    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: str = "fcfs") -> None:
        self.blocks = blocks
        self.by_priority = policy == "priority"
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.held: list[Sequence] = []  # added while holding: waiting, but not admitted until released
        self.holding = False
        self.num_preemptions = 0
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0

    def add(self, seq: Sequence) -> None:
        (self.held if self.holding else self.waiting).append(seq)

    def hold(self, on: bool) -> None:
        """Hold new sequences back (`on`), or admit those held, behind those waiting already."""
        self.holding = on
        if not on:
            self.waiting.extend(self.held)
            self.held.clear()

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        out: list[ScheduledSeq] = []
        preempted = False
        if self.by_priority and len(self.waiting) > 1:  # (nearly sorted already: a linear pass)
            self.waiting = deque(sorted(self.waiting, key=_rank))
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            need = self.blocks.num_blocks_for(seq.num_computed_tokens + n) - len(seq.block_table)
            while not self.blocks.can_allocate(need):
                victim = max(self.running, key=_rank) if self.by_priority else self.running[-1]
                if victim is seq:
                    break
                j = self.running.index(victim) if self.by_priority else len(self.running) - 1
                del self.running[j]
                if j < i:  # scheduled already this step: its tokens go back to the budget
                    i -= 1
                    k = next(k for k, s in enumerate(out) if s.seq is victim)
                    budget += out.pop(k).num_new_tokens
                self._preempt(victim)
                preempted = True
            if not self.blocks.can_allocate(need):  # it is the one to preempt (the last, or alone and too big)
                self._preempt(self.running.pop(i))
                preempted = True
                continue
            self.blocks.allocate(seq.block_table, need)
            out.append(ScheduledSeq(seq, n, seq.num_computed_tokens))
            budget -= n
            i += 1
        pending: set[int] | None = None  # blocks running sequences are still computing (built when needed)
        deferred: list[Sequence] = []
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hashes = seq.full_block_hashes(self.blocks.block_size, self.blocks.chain)
            # its prompt is computed, cached or not (prompt logprobs, or skip_reading_prefix_cache)
            fresh = seq.needs_prompt_logprobs or seq.params.skip_reading_prefix_cache
            hits = [] if fresh else self.blocks.match_prefix(hashes)
            if (len(hits) < len(hashes) and self.blocks.enable_prefix_caching and self.share_computing_prefix
                    and not fresh):
                pending = self._computing() if pending is None else pending
                if hashes[len(hits)] in pending:  # a sibling computes this prefix now: reuse it next step
                    deferred.append(self.waiting.popleft())
                    continue
            if len(hits) * self.blocks.block_size >= seq.num_tokens:
                hits = hits[:-1]  # keep at least one token to compute, for its logits
            cached = len(hits) * self.blocks.block_size
            n = min(seq.num_tokens - cached, budget)
            need = self.blocks.num_blocks_for(cached + n) - len(hits)
            if not self.blocks.can_allocate(need, hits):
                break
            self.waiting.popleft()
            self.blocks.allocate(seq.block_table, need, hits)
            seq.num_computed_tokens = cached
            seq.num_registered_blocks = len(hits)
            if seq.num_cached_tokens < 0:  # its first admission
                seq.num_cached_tokens, seq.t_scheduled = cached, time.monotonic()
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += cached
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.append(ScheduledSeq(seq, n, cached))
            budget -= n
            if pending is not None:
                pending.update(hashes[len(hits):])
        self.waiting.extendleft(reversed(deferred))
        return out

    def schedule_only(self, seq: Sequence) -> list[ScheduledSeq]:
        """A step of `seq` alone (running or waiting; isolation.py's probe of a failed step's
        requests): the others keep their KV and their places."""
        running, waiting = self.running, self.waiting
        alone = seq.status is Status.RUNNING
        self.running, self.waiting = ([seq], deque()) if alone else ([], deque([seq]))
        try:
            return self.schedule()
        finally:
            self.running = [s for s in running if s is not seq] + self.running
            self.waiting.extend(s for s in waiting if s is not seq)

    def _computing(self) -> set[int]:
        """Hashes of the full blocks that running sequences have still to compute (their prefills).
        A waiting sequence whose next uncached block is among them waits for it rather than
        computing the same prefix beside it (a prompt group's siblings arriving together)."""
        bs, out = self.blocks.block_size, set()
        for r in self.running:
            if r.num_tokens - r.num_computed_tokens > 1:  # decodes compute one token: no block to share
                out.update(r.full_block_hashes(bs, self.blocks.chain)[r.num_computed_tokens // bs:])
        return out

    def _preempt(self, seq: Sequence) -> None:
        self._requeue(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1

    def _requeue(self, seq: Sequence) -> None:
        self.blocks.free_table(seq.block_table)
        seq.num_computed_tokens = seq.num_registered_blocks = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def requeue_running(self, which) -> int:
        """Drop the KV of the running sequences `which(seq)` selects and put them back at the head
        of the queue, in order: their tokens are recomputed when next scheduled (after a weight
        update). Returns how many."""
        out = [s for s in self.running if which(s)]
        for seq in reversed(out):
            self.running.remove(seq)
            self._requeue(seq)
        return len(out)

    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Make room for the first `num_tokens` tokens' KV (draft tokens), without preempting anyone."""
        need = self.blocks.num_blocks_for(num_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if not self.blocks.can_allocate(need):
            return False
        self.blocks.allocate(seq.block_table, need)
        return True

    def release_unused(self, seq: Sequence) -> None:
        """Give back blocks reserved past the sequence's tokens (rejected drafts)."""
        self.blocks.truncate(seq.block_table, self.blocks.num_blocks_for(seq.num_tokens))

    def after_step(self, batch: list[ScheduledSeq]) -> None:
        """Record computed tokens and publish newly filled blocks to the prefix cache."""
        bs = self.blocks.block_size
        for s in batch:
            seq = s.seq
            seq.num_computed_tokens = s.num_computed_before + s.num_new_tokens
            n_full = seq.num_computed_tokens // bs
            if n_full > seq.num_registered_blocks:
                hashes = seq.full_block_hashes(bs, self.blocks.chain)
                for k in range(seq.num_registered_blocks, n_full):
                    self.blocks.register(seq.block_table[k], hashes[k], seq.weights_version)
                seq.num_registered_blocks = n_full

    def finish(self, seq: Sequence) -> None:
        """Release a finished or aborted sequence, wherever it is."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            (self.held if seq in self.held else self.waiting).remove(seq)
        self.blocks.free_table(seq.block_table)
        seq.status = Status.FINISHED

    def check_integrity(self) -> None:
        tables = [s.block_table for s in self.running] + [s.block_table for s in self.waiting]
        self.blocks.check_integrity(tables)
        for s in [*self.waiting, *self.held]:
            assert not s.block_table, f"waiting sequence {s.request_id} holds blocks"
        assert len(self.running) <= self.max_num_seqs


def _rank(seq: Sequence) -> tuple[int, int]:
    return seq.priority, seq.arrival
