"""The global scheduler: one queue for every trajectory's turns, a placement policy, failover and
elastic membership. A `Router` is itself a `Generator`, so episodes run through it unchanged.

Each replica takes at most `max_inflight_per_replica` requests from this router; beyond that,
requests wait in one global queue ordered by the policy's priority. Every placement is recorded in
the prefix index at once (so siblings routed together see each other's prompt as cached) and
reconciled with the cached-token count the replica reports. A replica that fails is marked
unhealthy, its requests are retried elsewhere, and it rejoins when its /health answers again.
For policies with a `kv_budget`, KV residency (`residency.py`) holds the turns of trajectories whose
contexts would not stay in a replica's KV pool; a held turn still counts toward `queue_timeout_s`.
Membership, failover, weight updates and the health and load loops are in `upkeep.py`.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from rollwise.router.cost_model import CostModel
from rollwise.router.homes import Homes
from rollwise.router.policies import Candidate, Policy, RouteInfo, make_policy
from rollwise.router.prefix_index import PrefixIndex
from rollwise.router.replica import LoadSnapshot, ReplicaError
from rollwise.router.residency import Residency
from rollwise.router.upkeep import Upkeep
from rollwise.types import GenerateOutput, GenerateRequest, WeightsNotHeld


@dataclass(slots=True)
class _Waiter:
    info: RouteInfo
    hashes: list[int]
    work: int
    future: asyncio.Future
    tried: set[str] = field(default_factory=set)
    weights: int = 0  # its replica's weight-update count when placed there


class Router(Upkeep):
    def __init__(self, replicas: list, policy: str | Policy = "rollwise", *, tokenizer=None,
                 max_inflight_per_replica: int = 64, block_size: int = 16, max_retries: int = 3,
                 health_interval_s: float = 1.0, load_interval_s: float = 0.5, queue_timeout_s: float = 600.0,
                 share_drafts: bool = True, record_placements: bool = False) -> None:
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.policy.attach(max_inflight_per_replica)
        self.tokenizer = tokenizer
        self.capacity, self.max_retries = max_inflight_per_replica, max_retries
        self.health_interval_s, self.load_interval_s = health_interval_s, load_interval_s
        self.queue_timeout_s, self.share_drafts = queue_timeout_s, share_drafts
        self.index = PrefixIndex(block_size)
        self.cost_model = CostModel()
        self._cands: dict[str, Candidate] = {}  # one per replica, kept current
        self.policy_version = 0  # of the weights every healthy replica serves
        self.stale: set[str] = set()  # replicas that missed a weight update (kept out of routing)
        self.asleep: set[str] = set()  # replicas whose memory is given back (sleep mode; out of routing)
        self.broadcast = None  # a FleetBroadcast: weight updates to HTTP replicas in one group (broadcast.py)
        self.weight_updates: dict[str, int] = {}  # replica -> updates it took (what it cached before: never matched)
        self._latest: tuple | None = None  # (weights, version) of the last update
        self._latest_adapter: tuple | None = None  # (adapter, version) sent on those weights since, if any
        self._sharing: set[asyncio.Future] = set()
        self._drafters: list | None = None  # members that draft from shared tokens (found again on membership changes)
        self._parked: dict[str, deque[_Waiter]] = {}  # replica -> requests waiting for a slot there
        self.replicas: dict[str, object] = {}
        self.healthy: set[str] = set()
        self.inflight: dict[str, int] = {}
        self.inflight_tokens: dict[str, int] = {}
        self.assigned: dict[str, int] = {}
        self.loads: dict[str, LoadSnapshot | None] = {}
        self.sticky = Homes()  # trajectory -> replica of its last turn, and how many live on each
        self.turns: dict[str, int] = {}  # trajectory -> turns routed
        self.expected_turns: dict[str, float] = {}  # group -> EMA of finished siblings' turns
        self.mean_new_tokens = 64.0  # EMA of tokens generated per request
        self._queue: list[tuple[float, int, _Waiter]] = []
        self._seq = itertools.count()
        self._tasks: list[asyncio.Task] = []
        self._first_load: asyncio.Event | None = None
        kv_budget = getattr(self.policy, "kv_budget", None)  # KV residency, for policies that want it
        self.residency = None if not kv_budget else Residency(
            kv_budget, lambda n: self.loads[n].kv_capacity_tokens if self.loads.get(n) is not None else 0.0,
            getattr(self.policy, "resident_idle_s", 600.0), getattr(self.policy, "kv_growth_prior", 0.0))
        # holding a turn is worth it only while its replica has other work: a replica with nothing in
        # flight (e.g. every resident in a tool call) runs held turns rather than wait
        self.work_conserving = self.residency is not None and getattr(self.policy, "kv_work_conserving", True)
        self.placements = deque(maxlen=100_000) if record_placements else None  # (trajectory, group, turn, replica)
        self.stats = {"requests": 0, "retries": 0, "failovers": 0, "decisions": 0, "decision_s": 0.0, "parked": 0,
                      "queued": 0, "prompt_tokens": 0, "matched_tokens": 0, "cached_tokens": 0, "held": 0,
                      "moves": 0}
        for r in replicas:
            self.add_replica(r)

    async def start(self) -> None:
        if not self._tasks:
            self._first_load = asyncio.Event()
            self._tasks = [asyncio.create_task(self._health_loop()), asyncio.create_task(self._load_loop())]
            self._first_wait = asyncio.ensure_future(self._first_load.wait())  # (one task, however many wait)
            self._tasks.append(self._first_wait)
        if not self._first_load.is_set():  # place nothing before the replicas' load (and KV capacity) is known
            try:
                await asyncio.wait_for(asyncio.shield(self._first_wait), 5.0)
            except TimeoutError:
                pass

    async def close(self) -> None:
        tasks = self._tasks + list(self._sharing)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks = []
        if self.broadcast is not None:
            await self.broadcast.close()

    # the Generator protocol ------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        w = await self._waiter(request)
        for _ in range(self.max_retries + 1):
            name = await self._acquire(w)
            try:
                out = await self._replica(name).generate(request)
            except BaseException as e:
                if self._failed(name, w, e):
                    continue
                raise
            return self._served(name, w, request, out)
        raise ReplicaError(f"request failed on {sorted(w.tried)} after {self.max_retries} retries")

    async def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        """`generate`, piece by piece as the replica sends it: each piece holds the tokens new since
        the last (and their logprobs), the last one also the finish reason and the turn's metadata.
        A turn is retried elsewhere only before its first piece (after it, a client has seen tokens);
        a replica that cannot stream sends its whole output as one piece."""
        w = await self._waiter(request)
        for _ in range(self.max_retries + 1):
            name = await self._acquire(w)
            pieces, served = [], False
            try:
                async for piece in _pieces(self._replica(name), request):
                    piece.replica = name
                    pieces.append(piece)
                    if piece.finish_reason is not None:  # the turn is recorded before the client hears its end
                        self._served(name, w, request, joined(pieces))
                        served = True
                    yield piece
                if not served:
                    raise ReplicaError(f"{name}: the stream ended without a finish reason")
            except BaseException as e:
                if not served and self._failed(name, w, e) and not pieces:
                    continue
                raise
            return
        raise ReplicaError(f"request failed on {sorted(w.tried)} after {self.max_retries} retries")

    async def _waiter(self, request: GenerateRequest) -> _Waiter:
        await self.start()
        tid = request.trajectory_id
        info = RouteInfo(request=request, prompt_len=len(request.prompt_token_ids), arrival=self._now(),
                         sticky=self.sticky.get(tid) if tid else None, turns_done=self.turns.get(tid, 0) if tid else 0,
                         expected_turns=self.expected_turns.get(request.group_id) if request.group_id else None,
                         expected_new_tokens=self.mean_new_tokens)
        self.stats["requests"] += 1
        self.stats["prompt_tokens"] += info.prompt_len
        return _Waiter(info, self.index.hashes(request.prompt_token_ids, tid, request.cache_salt), 0, None)

    def _replica(self, name: str):
        replica = self.replicas.get(name)
        if replica is None:
            raise ReplicaError(f"{name} was removed")
        return replica

    def _failed(self, name: str, w: _Waiter, e: BaseException) -> bool:
        """A turn failed on `name` (or was cancelled): free its slot; whether to retry elsewhere."""
        self._release(name, w.work)
        if isinstance(e, ReplicaError):
            self._mark_down(name)
        elif not isinstance(e, WeightsNotHeld):  # e.g. bad input, or the caller gave up
            return False
        w.tried.add(name)
        if isinstance(e, WeightsNotHeld) and self.healthy <= w.tried:  # pinned to weights no one else holds
            return False
        self.stats["retries"] += 1
        return True

    def _served(self, name: str, w: _Waiter, request: GenerateRequest, out: GenerateOutput) -> GenerateOutput:
        self._release(name, w.work)
        self._record(name, w, request, out)
        out.replica = name
        return out

    @staticmethod
    def _now() -> float:
        """The event loop's clock (virtual in the simulator); monotonic time outside a loop."""
        try:
            return asyncio.get_running_loop().time()
        except RuntimeError:
            return time.monotonic()

    def _unhold(self, name: str) -> None:
        """Residency changed on `name`: held turns go back to the queue."""
        if self.residency is not None:
            for item in self.residency.release(name):
                heapq.heappush(self._queue, item)
            self._pump()

    async def end_trajectory(self, trajectory_id: str, group_id: str | None, token_ids: list[int],
                             num_turns: int) -> None:
        """A trajectory finished: learn its group's turn count and forget its stickiness. (Its
        tokens already reached every replica's drafting cache turn by turn.)"""
        if group_id is not None:
            old = self.expected_turns.get(group_id)
            self.expected_turns[group_id] = num_turns if old is None else 0.7 * old + 0.3 * num_turns
        home = self.sticky.pop(trajectory_id)
        if home is not None:
            self._sync(home)
        self.turns.pop(trajectory_id, None)
        if self.residency is not None:
            for name in self.residency.end(trajectory_id):
                self._unhold(name)  # its KV budget goes to the next resident or a new trajectory

    def _share(self, served_by: str, token_ids: list[int], group_id: str | None, salt: str | None = None) -> None:
        """Every turn's new tokens go to the other replicas' suffix caches (the serving one has
        them), so siblings draft from each other wherever they run; a salted turn's go to its salt's
        trees there."""
        if self._drafters is None:
            self._drafters = [(n, r) for n, r in self.replicas.items()
                              if hasattr(r, "add_sequence") and getattr(r, "speculates", True)]
        targets = [r for n, r in self._drafters if n != served_by]
        if targets and token_ids:
            salted = {} if salt is None else {"cache_salt": salt}
            task = asyncio.ensure_future(asyncio.gather(*(r.add_sequence(token_ids, group_id, **salted)
                                                          for r in targets), return_exceptions=True))
            self._sharing.add(task)
            task.add_done_callback(self._sharing.discard)

    # scheduling ----------------------------------------------------------------------------------
    async def _acquire(self, w: _Waiter) -> str:
        w.future = asyncio.get_running_loop().create_future()
        heapq.heappush(self._queue, (self.policy.priority(w.info), next(self._seq), w))
        self._pump()
        if w.future.done():  # (most requests: no timer to set up)
            return w.future.result()
        self.stats["queued"] += 1
        return await asyncio.wait_for(w.future, self.queue_timeout_s)

    def _pump(self) -> None:
        while self._queue:
            room = [n for n in self.replicas if n in self.healthy and self.inflight[n] < self.capacity]  # not set order
            if not room:
                return
            item = heapq.heappop(self._queue)
            w = item[2]
            if w.future.done():  # the caller gave up
                continue
            tid = w.info.request.trajectory_id
            if self.residency is not None and tid is not None:
                home = self.sticky.get(tid)
                allowed = self.residency.allowed(tid, w.info.request.group_id, w.info.prompt_len, home, room,
                                                 self._left_turns(w.info))
                if not allowed and self.work_conserving:  # an idle replica takes it anyway
                    allowed = [n for n in room if self.inflight[n] == 0]
                room = allowed
                if not room:  # held until residency changes (a trajectory ends, a replica idles or goes)
                    self.residency.hold(item, tid, home)
                    self.stats["held"] += 1
                    continue
            home = w.info.sticky
            if (home is not None and home not in room and home in self.healthy and home in self.replicas
                    and home not in w.tried and self.policy.park(w.info)):
                self._parked.setdefault(home, deque()).append(w)  # wait for its context's replica
                self.stats["parked"] += 1
                continue
            cands = [n for n in room if n not in w.tried] or room
            t0 = time.perf_counter()
            name = self._choose(w, cands)
            self.stats["decision_s"] += time.perf_counter() - t0
            self.stats["decisions"] += 1
            w.future.set_result(name)

    def _choose(self, w: _Waiter, names: list[str]) -> str:
        matched = self.index.match(w.hashes, names)
        cands = [self._cands[n] for n in names]
        for c in cands:  # the rest of each candidate is kept current as requests come and go
            c.matched = min(matched[c.name], w.info.prompt_len)
        name = self.policy.choose(w.info, cands)
        req = w.info.request
        w.work = w.info.prompt_len - matched[name] + int(min(self.mean_new_tokens, req.params.max_tokens))
        self.inflight[name] += 1
        self.inflight_tokens[name] += w.work
        self._sync(name)
        self.stats["matched_tokens"] += min(matched[name], w.info.prompt_len)
        w.weights = self.weight_updates.get(name, 0)
        self.index.insert(name, w.hashes)  # predicted: siblings arriving next see it as cached
        if self.residency is not None and req.trajectory_id is not None:
            self.residency.admit(req.trajectory_id, name, w.info.prompt_len, req.group_id,
                                 self.turns.get(req.trajectory_id, 0) == 0, self._now(), self._left_turns(w.info))
        if self.placements is not None:
            self.placements.append((req.trajectory_id, req.group_id, req.turn, name))
        tid = req.trajectory_id
        if tid is not None:
            if tid not in self.sticky and tid not in self.turns:
                self.assigned[name] += 1
            old = self.sticky.get(tid)
            self.sticky[tid] = name
            if old is not None and old != name:
                self.stats["moves"] += 1
                self._sync(old)
            self._sync(name)
        return name

    def _left_turns(self, info) -> float:
        """Turns expected after this one: finished siblings' count, else the policy's default."""
        total = info.expected_turns if info.expected_turns is not None else getattr(self.policy, "default_turns", 4.0)
        return max(total - info.turns_done - 1, 0.0)

    def _release(self, name: str, work: int) -> None:
        if name in self.inflight:
            self.inflight[name] -= 1
            self.inflight_tokens[name] -= work
            self._sync(name)
            if self.inflight[name] == 0 and self.work_conserving:
                self._unhold(name)  # an idle replica: held turns run there rather than wait
            parked = self._parked.get(name)
            while parked and self.inflight[name] < self.capacity and name in self.healthy:
                w = parked.popleft()
                if not w.future.done():
                    w.future.set_result(self._choose(w, [name]))
        self._pump()

    def _unpark(self, name: str) -> None:
        """Requests waiting for a replica that is gone go back to the queue."""
        for w in self._parked.pop(name, ()):
            if not w.future.done():
                heapq.heappush(self._queue, (self.policy.priority(w.info), next(self._seq), w))

    def _sync(self, name: str) -> None:
        c = self._cands.get(name)
        if c is not None:
            c.inflight, c.inflight_tokens = self.inflight[name], self.inflight_tokens[name]
            c.assigned, c.load, c.homed = self.assigned[name], self.loads.get(name), self.sticky.count(name)

    def _record(self, name: str, w: _Waiter, req: GenerateRequest, out: GenerateOutput) -> None:
        self.stats["cached_tokens"] += out.num_cached_tokens
        self.mean_new_tokens = 0.9 * self.mean_new_tokens + 0.1 * len(out.token_ids)
        if name in self.replicas and self.weight_updates.get(name, 0) == w.weights:  # (else: KV of older weights)
            self.index.reconcile(name, w.hashes, out.num_cached_tokens)
            self.index.insert(name, self.index.hashes(req.prompt_token_ids + out.token_ids, req.trajectory_id,
                                                      req.cache_salt))
        if req.trajectory_id is not None:
            self.turns[req.trajectory_id] = self.turns.get(req.trajectory_id, 0) + 1
            if self.residency is not None and self.residency.is_resident(req.trajectory_id, name):
                self.residency.admit(req.trajectory_id, name, len(req.prompt_token_ids) + len(out.token_ids),
                                     req.group_id, False, self._now())
        if self.share_drafts:
            self._share(name, out.token_ids, req.group_id, req.cache_salt)

    def metrics(self) -> dict[str, float]:
        s = self.stats
        return {**{k: float(v) for k, v in s.items()},
                "decision_us": 1e6 * s["decision_s"] / max(s["decisions"], 1),
                "hit_rate": s["cached_tokens"] / max(s["prompt_tokens"], 1),
                "num_replicas": float(len(self.replicas)), "num_healthy": float(len(self.healthy)),
                "queue_len": float(len(self._queue)),
                **{f"inflight/{n}": float(v) for n, v in self.inflight.items() if n in self.replicas}}


async def _pieces(replica, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
    if hasattr(replica, "stream"):
        async for piece in replica.stream(request):
            yield piece
    else:
        yield await replica.generate(request)


def joined(pieces: list[GenerateOutput]) -> GenerateOutput:
    """A streamed turn's pieces as one output (the last piece carries the turn's metadata)."""
    last = pieces[-1]
    return GenerateOutput(token_ids=[t for p in pieces for t in p.token_ids], logprobs=[x for p in pieces for x in p.logprobs],
                          finish_reason=last.finish_reason, num_cached_tokens=last.num_cached_tokens,
                          policy_version=last.policy_version, request_id=last.request_id, replica=last.replica,
                          version_segments=last.version_segments, top_logprobs=[t for p in pieces for t in p.top_logprobs],
                          prompt_token_logprobs=last.prompt_token_logprobs,
                          prompt_top_logprobs=last.prompt_top_logprobs, prompt_logprob_ranks=last.prompt_logprob_ranks,
                          routed_experts=last.routed_experts, stop_reason=last.stop_reason)
