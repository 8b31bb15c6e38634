"""A failed engine step fails the request that caused it, not every request in it.

A step that raises (a bug that one request's input reaches, memory running out on a large batch)
once failed every request in flight. Now `failed()` takes the step apart: requests that had
finished before the failure end as they were, the others drop the step's KV (recomputed next
time, mostly from the prefix cache) and keep their tokens. A step of one request fails that
request. A step of several makes each a suspect: suspects then step alone, one after another,
each until it samples a token; one that fails alone is the culprit and fails, the others go on
(a seeded request's tokens are the same as without the failure). Requests that were not in the
failed step wait, their KV kept, until every suspect has stepped alone.

A failure that depends on the company a request keeps (memory on a large batch) can come back
when the suspects join the batch again; each round still moves every suspect a token forward.
"""
from __future__ import annotations

from collections import deque

from rollwise.engine.scheduler import ScheduledSeq
from rollwise.engine.sequence import Sequence, Status
from rollwise.types import RequestOutput


class StepFailed(RuntimeError):
    """This request failed an engine step (alone): the request's failure, not the server's. HTTP 500
    with error type "request_failed"; a router neither retries it nor blames the replica."""


class Isolation:
    def __init__(self, engine) -> None:
        self.engine = engine
        self.suspects: deque[Sequence] = deque()
        self.batch: list[ScheduledSeq] | None = None  # the step in progress
        self.lengths: list[int] = []  # its sequences' token counts when it began

    def schedule(self) -> list[ScheduledSeq]:
        sch = self.engine.scheduler
        self.batch = None
        while self.suspects and self.suspects[0].status is Status.FINISHED:  # aborted meanwhile
            self.suspects.popleft()
        batch = sch.schedule_only(self.suspects[0]) if self.suspects else []
        if self.suspects and not batch:  # no room for it alone (cannot happen after its KV is freed)
            self.suspects.popleft()
        batch = batch or sch.schedule()
        self.batch, self.lengths = batch, [s.seq.num_tokens for s in batch]
        return batch

    def passed(self, batch: list[ScheduledSeq]) -> None:
        """The step ran: a suspect that emitted a token alone (or finished) is cleared."""
        if self.suspects and any(s.seq is self.suspects[0] and (s.seq.num_tokens > n or s.seq.status is Status.FINISHED)
                                 for s, n in zip(batch, self.lengths)):
            self.suspects.popleft()
        self.batch = None

    def failed(self) -> tuple[list[RequestOutput], list[str]]:
        """After `step()` raised: the outputs of the step's requests that finished before it failed,
        and the ids of the requests to fail (every one in flight if scheduling itself failed: its
        state cannot be trusted)."""
        eng, batch, self.batch = self.engine, self.batch, None
        eng.stats["num_failed_steps"] += 1
        if batch is None:
            return [], list(eng.seqs)
        outputs: list[RequestOutput] = []
        alive: list[Sequence] = []
        grown: dict[str, list[int]] = {}
        for s, before in zip(batch, self.lengths):
            seq = s.seq
            if eng.seqs.get(seq.request_id) is not seq:
                continue
            if seq.num_tokens > before:  # tokens emitted before the failure: kept, and drafted from
                grown[seq.request_id] = seq.token_ids[before:]
            if seq.finish_reason is not None:  # it stopped before the failure: it ends as it was
                eng._finish(seq)
                outputs.append(eng._output(seq))
            else:
                alive.append(seq)
        if eng.spec is not None and grown:
            eng.spec.cache.append_batch({r: t for r, t in grown.items() if r in eng.seqs})
        ids = {id(seq) for seq in alive}
        eng.scheduler.requeue_running(lambda seq: id(seq) in ids)
        solo = len(batch) == 1
        if solo and self.suspects and self.suspects[0] is batch[0].seq:
            self.suspects.popleft()
        if solo:
            return outputs, [seq.request_id for seq in alive]
        self.suspects.extend(alive)
        return outputs, []
