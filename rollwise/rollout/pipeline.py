"""Producer/consumer hand-off between rollouts and the trainer, with a bound on staleness.

Producers run GRPO groups (one task, `group_size` episodes through the router); a complete group
goes to the `GroupQueue` and is appended to the run's `groups.jsonl` at once, so a crashed trainer
resumes without regenerating it. The trainer takes `groups_per_step` groups per step, one at a
time as they complete (`next_group`): a streamed step computes each group's gradients while the
rest of its batch is still generating, and only its last group and the optimizer step remain once
the batch is complete.

Staleness (AReaL's rule, checked per token): the trainer at version T may only use tokens generated
by versions >= T - k. Admission paces producers: the i-th group (0-based) may start only when the
policy version v satisfies i < (v + k + 1) * B. Batch T takes the oldest unconsumed groups that a
later batch could not absorb within the bound (it waits for them: at most B), and fills the rest
with whichever groups complete first (taken as they complete, while the batch still has room for
every group the bound requires), so stragglers do not stall training until the bound requires
them. With k = 0 every step waits for exactly the groups admitted under its own weights:
synchronous, on-policy RL. A group's version is the oldest version of any of its turns. A group
the trainer takes and skips (`skip`: DAPO's dynamic sampling drops groups whose rewards are all
equal) does not count towards its batch and admits one more group in its place.

Lockstep (`lockstep=True`, for reproducible runs): batch T is exactly groups T*B .. (T+1)*B - 1, and
each group is pinned to version T - k (or the version the run started at, if newer; `admit` returns
it): every turn asks the replicas for those weights, which they keep (`keep_weight_versions` =
k + 1). So each batch runs entirely under one version and no turn's version depends on timing,
while weights change as soon as the trainer has them and batches of different versions run at once
(a step lasts about (rollout + training) / 2 at k = 1, as under the free-running rule). A run
resumed after a crash goes on with the oldest groups left (those lost in flight are not
regenerated under their old numbers), so it is not bit-identical to an uninterrupted one.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from rollwise.types import Trajectory


@dataclass
class Group:
    seq: int  # admission order
    task_index: int  # in the run's task stream (the data cursor)
    task: dict
    admitted_version: int
    trajectories: list[Trajectory] = field(default_factory=list)

    @property
    def version(self) -> int:
        """The oldest policy version of any generated token (the turns record their admission version)."""
        return min([self.admitted_version] + [v for t in self.trajectories for v in t.policy_versions])

    def to_json(self) -> str:
        return json.dumps({"seq": self.seq, "task_index": self.task_index, "task": self.task,
                           "admitted_version": self.admitted_version,
                           "trajectories": [dataclasses.asdict(t) for t in self.trajectories]})

    @staticmethod
    def from_json(line: str) -> Group:
        d = json.loads(line)
        trajs = [Trajectory.from_dict(t) for t in d["trajectories"]]
        return Group(d["seq"], d["task_index"], d["task"], d["admitted_version"], trajs)


class GroupQueue:
    def __init__(self, groups_per_step: int, max_staleness: int, *, version: int = 0, admitted: int | None = None,
                 log_path: str | Path | None = None, lockstep: bool = False, skipped: int = 0) -> None:
        if groups_per_step < 1 or max_staleness < 0:
            raise ValueError("groups_per_step must be >= 1 and max_staleness >= 0")
        self.B, self.k, self.version, self.lockstep = groups_per_step, max_staleness, version, lockstep
        self.skipped = skipped  # groups the trainer took and did not train on: each admits one more
        self.start = version  # the run's (or resumed run's) first version: the oldest weights it has
        self.admitted = version * groups_per_step if admitted is None else admitted  # next admission index
        self.ready: dict[int, Group] = {}  # complete, not consumed: seq -> group
        self.pending: dict[int, int] = {}  # admitted, not complete: seq -> admitted version
        self.error: BaseException | None = None
        self.log_path = Path(log_path) if log_path else None
        self._cond = asyncio.Condition()
        self.stats = {"stale_groups": 0, "stale_trajectories": 0, "max_staleness_seen": 0, "admission_wait_s": 0.0,
                      "rollout_idle_s": 0.0}  # time with no group in flight (the fleet has nothing to do)
        self._idle_since: float | None = None

    def restore(self, groups: list[Group]) -> None:
        """Complete groups from a previous run of this job that no committed step consumed."""
        for g in groups:
            self.ready[g.seq] = g

    # producers -----------------------------------------------------------------------------------
    def may_admit(self) -> bool:
        return self.admitted < (self.version + self.k + 1) * self.B + self.skipped

    async def admit(self) -> tuple[int, int]:
        """Wait for room under the staleness bound; returns (seq, its version): the version it is
        admitted at, or in lockstep the one it is pinned to, seq // B - k (never newer than the
        current one, nor older than the current one - k, nor the version this run started at)."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        async with self._cond:
            await self._cond.wait_for(lambda: self.may_admit() or self.error is not None)
            self._raise()
            seq = self.admitted
            self.admitted += 1
            self.pending[seq] = max(self.start, seq // self.B - self.k) if self.lockstep else self.version
            if self._idle_since is not None:
                self.stats["rollout_idle_s"] += loop.time() - self._idle_since
                self._idle_since = None
        self.stats["admission_wait_s"] += loop.time() - t0
        return seq, self.pending[seq]

    async def put(self, group: Group) -> None:
        if self.log_path is not None:  # durable before it counts as complete
            with open(self.log_path, "a") as f:
                f.write(group.to_json() + "\n")
        async with self._cond:
            self.pending.pop(group.seq, None)
            self.ready[group.seq] = group
            if not self.pending:
                self._idle_since = asyncio.get_running_loop().time()
            self._cond.notify_all()

    async def fail(self, error: BaseException) -> None:
        """A producer (or the trainer) failed: every waiter gets the error instead of hanging."""
        async with self._cond:
            self.error = self.error or error
            self._cond.notify_all()

    # the trainer ---------------------------------------------------------------------------------
    def _must(self) -> list[int]:
        """The oldest groups the current batch still has to take so that no later batch can be forced
        over the bound: for each coming step t = T..T+k, the groups admitted at versions <= t - k that
        batches T+1..t cannot all absorb (B each) must go now, oldest first."""
        T, B = self.version, self.B
        left = sorted([(s, g.admitted_version) for s, g in self.ready.items()] + list(self.pending.items()))
        need = 0
        for t in range(T, T + self.k + 1):
            need = max(need, sum(v <= t - self.k for _, v in left) - B * (t - T))
        return [s for s, _ in left[:need]]

    def _pick(self, taken: int) -> int | None:
        """The group to hand the trainer next (its batch has `taken` already), or None to wait.
        Lockstep: the oldest unconsumed group (batch T is T*B .. (T+1)*B - 1, unless a crash lost
        some in flight), in order. Otherwise: a group the bound requires, oldest first, else (while
        the batch has room for every group it requires) any complete group, oldest admission first."""
        if self.lockstep:
            s = min([*self.ready, *self.pending], default=None)
            return s if s in self.ready else None
        must = self._must()  # never more than B - taken (the admission rule), so there is always room
        ready = [s for s in must if s in self.ready]
        if ready:
            return ready[0]
        return min(self.ready, default=None) if len(must) < self.B - taken else None

    async def next_group(self, taken: int = 0) -> Group:
        """The next group of the current step's batch (the step has `taken` of its B groups), as
        soon as one may join it: a trainer that consumes groups as they complete (a streamed step)
        calls this B times; `get_batch` is the same B calls. Groups stay in the queue's log until
        `commit`."""
        if not 0 <= taken < self.B:
            raise ValueError(f"taken must be in [0, {self.B}), got {taken}")
        async with self._cond:
            await self._cond.wait_for(lambda: self._pick(taken) is not None or self.error is not None)
            self._raise()
            g = self.ready.pop(self._pick(taken))
        stale = self.version - g.version
        if stale > self.k:  # cannot happen under the admission rule; checked, not assumed
            raise RuntimeError(f"group {g.seq} is {stale} versions stale (bound {self.k})")
        self.stats["max_staleness_seen"] = max(self.stats["max_staleness_seen"], stale)
        if stale > 0:
            self.stats["stale_groups"] += 1
            self.stats["stale_trajectories"] += len(g.trajectories)
        return g

    async def skip(self, group: Group) -> None:
        """The trainer took `group` (from `next_group`) and will not train on it (dynamic sampling: its
        episodes all got the same reward): another group is admitted in its place. The bound still
        holds: each batch absorbs its B groups plus those it skips, so a group admitted at version v
        is taken by batch v + k at the latest, as without skips."""
        if self.lockstep:
            raise ValueError("a lockstep queue's batches are fixed groups: none can be skipped")
        async with self._cond:
            self.skipped += 1
            self._cond.notify_all()

    def has_next(self, taken: int) -> bool:
        """Whether `next_group(taken)` would return at once."""
        return taken < self.B and self.error is None and self._pick(taken) is not None

    async def get_batch(self) -> list[Group]:
        """The next step's B groups (they stay owned by the queue's log until `commit`)."""
        return [await self.next_group(i) for i in range(self.B)]

    async def commit(self, version: int) -> None:
        """The step that used the last batch is done: the policy is now `version`; admit more."""
        async with self._cond:
            self.version = version
            self._cond.notify_all()

    def _raise(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"rollout pipeline failed: {self.error!r}") from self.error

    @property
    def in_flight(self) -> int:
        return len(self.pending)


def read_log(path: str | Path, repair: bool = False) -> list[Group]:
    """The complete groups in a log. A crash mid-write leaves a torn last line: it is dropped (that
    group was not complete), and with `repair` the file is rewritten without it so that appends
    after a resume stay readable."""
    p = Path(path)
    if not p.exists():
        return []
    out, good = [], []
    text = p.read_text()
    for line in text.splitlines():
        if line.strip():
            try:
                out.append(Group.from_json(line))
                good.append(line)
            except (json.JSONDecodeError, TypeError, KeyError):
                break
    clean = "".join(x + "\n" for x in good)
    if repair and clean != text:
        tmp = p.with_suffix(".tmp")
        tmp.write_text(clean)
        os.replace(tmp, p)
    return out
