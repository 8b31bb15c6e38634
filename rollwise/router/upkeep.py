"""The router's upkeep of its members: joining and leaving, failover when one goes down, weight
updates to all of them, and the two background loops (health: rejoin and catch up on weights; load:
the snapshots that placement and its cost model read). Mixed into `Router`, whose state it keeps.
"""
from __future__ import annotations

import asyncio

from rollwise.router.policies import Candidate
from rollwise.router.replica import ReplicaError, gather_loads
from rollwise.wire import AdapterWeights


class Upkeep:
    """Membership, failover, weights and the background loops of a `Router` (the queue and
    placement that these keep fed are in router.py: `_pump`, `_sync`, `_unpark`, `_unhold`)."""

    def add_replica(self, replica, healthy: bool = True) -> None:
        """A new member; `healthy` false: routed to once the health loop hears it answer."""
        if replica.name in self.replicas:
            raise ValueError(f"replica {replica.name!r} is already a member")
        self.replicas[replica.name] = replica
        if healthy:
            self.healthy.add(replica.name)
        for d in (self.inflight, self.inflight_tokens, self.assigned):
            d.setdefault(replica.name, 0)
        self.loads[replica.name] = None
        self._cands[replica.name] = Candidate(replica.name, 0, 0, 0, None, 0)
        self._drafters = None
        self._sync(replica.name)
        self._pump()

    def remove_replica(self, name: str) -> None:
        """Stop routing to it; its in-flight requests finish (or fail over if it goes away)."""
        if name not in self.replicas:
            raise ValueError(f"unknown replica {name!r}; members: {sorted(self.replicas)}")
        del self.replicas[name]
        self._cands.pop(name, None)
        self._drafters = None
        self.healthy.discard(name)
        self.asleep.discard(name)
        self._unpark(name)
        self._forget_contents(name)
        self.sticky.drop_replica(name)
        self._pump()

    def _new_weights(self, name: str) -> None:
        """The replica took new weights: the prefixes it cached under older ones are never matched
        again (an engine forgets them; requests in flight under them do not add theirs here)."""
        self.weight_updates[name] = self.weight_updates.get(name, 0) + 1
        self.index.remove_replica(name)

    def _forget_contents(self, name: str) -> None:
        """What the replica held is gone (it left or went down): its prefixes and KV residents."""
        self.index.remove_replica(name)
        if self.residency is not None:
            self.residency.drop_replica(name)
            self._unhold(name)

    async def update_weights(self, weights, version: int, partial_rollout: bool = False) -> dict[str, int]:
        """New weights to every member replica at once (requests in flight finish under the old ones,
        or with `partial_rollout` continue under these). One that fails to take them is out of
        routing (stale) until the health loop has given it the latest weights."""
        names = list(self.replicas)
        sent: list[str] = []  # (taken in the broadcast group: replica_weights_via = "broadcast", broadcast.py)
        if self.broadcast is not None and isinstance(weights, dict):  # (not a directory, not an adapter)
            sent = await self.broadcast.send(self, weights, version, partial_rollout)
        res = await asyncio.gather(*(asyncio.sleep(0, version) if n in sent else  # (taken: its version, as a reply)
                                     self.replicas[n].update_weights(weights, version, partial_rollout) for n in names),
                                   return_exceptions=True)
        if res and all(isinstance(r, ValueError) for r in res):  # bad weights (every replica refused them):
            raise ValueError(f"no replica took the new weights: {res[0]}")  # the fleet stays as it was
        if isinstance(weights, AdapterWeights):  # on the weights last sent: a stale replica needs both
            self._latest_adapter = (weights, version, partial_rollout)
        else:
            if isinstance(weights, dict) and self._latest is not None and isinstance(self._latest[0], dict):
                weights = {**self._latest[0], **weights}  # a subset (LoRA's linears): a stale replica needs all
            self._latest, self._latest_adapter = (weights, version, partial_rollout), None
        out = {}
        for n, r in zip(names, res):
            if isinstance(r, BaseException):
                self._mark_down(n)
                self.stale.add(n)
            else:
                self.stale.discard(n)
                out[n] = r
                self._new_weights(n)
        if not out:
            raise ReplicaError(f"no replica took the new weights: {dict(zip(names, map(str, res)))}")
        self.policy_version = version
        return out

    async def sleep(self, level: int) -> list[str]:
        """Every idle replica gives back its KV pool (level 1), and its weights (level 2: the next
        update must bring every weight), as vLLM's sleep mode does; the names of those that did (a
        busy or unreachable one stays as it is). They are out of routing until `wake_up` (requests
        wait for a replica meanwhile), and what they cached is forgotten here too."""
        names = [n for n, r in self.replicas.items() if hasattr(r, "sleep")]  # (optional, as update_weights)
        res = await asyncio.gather(*(self.replicas[n].sleep(level) for n in names), return_exceptions=True)
        slept = [n for n, r in zip(names, res) if r is True]
        for n in slept:
            self._forget_contents(n)
            self.healthy.discard(n)
            self.asleep.add(n)
        return slept

    async def wake_up(self, names: list[str]) -> None:
        """The replicas named take their memory again and are routed to; one that fails to is out of
        routing (stale) until the health loop has woken it and given it the latest weights."""
        res = await asyncio.gather(*(self.replicas[n].wake_up() for n in names), return_exceptions=True)
        for n, r in zip(names, res):
            self.asleep.discard(n)
            if isinstance(r, BaseException):
                self._mark_down(n)
                self.stale.add(n)
            elif n not in self.stale:
                self.healthy.add(n)
        self._pump()

    def _mark_down(self, name: str) -> None:
        if name in self.healthy:
            self.healthy.discard(name)
            self.stats["failovers"] += 1
            self._forget_contents(name)
            self._unpark(name)
            self._pump()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            if self.residency is not None:
                for name in self.residency.drop_idle(self._now()):
                    self._unhold(name)
            for name, r in list(self.replicas.items()):
                ok = await r.health()
                if ok and name in self.stale and self._latest is not None:
                    try:
                        if hasattr(r, "wake_up"):  # (if it slept: sleep mode)
                            await r.wake_up()
                        await r.update_weights(*self._latest)
                        if self._latest_adapter is not None:
                            await r.update_weights(*self._latest_adapter)
                        self.stale.discard(name)
                        self._new_weights(name)
                    except (ReplicaError, OSError, ValueError):
                        continue
                if ok and name not in self.healthy and name not in self.stale and name not in self.asleep:
                    self.healthy.add(name)
                    self._pump()
                elif not ok and name in self.healthy:
                    self._mark_down(name)

    async def _load_loop(self) -> None:
        while True:
            snaps = await gather_loads(list(self.replicas.values()))
            self.loads.update(snaps)
            for name, snap in snaps.items():
                self.cost_model.observe(name, snap)
                self._sync(name)
            calibrate = getattr(self.policy, "calibrate", None)
            if calibrate is not None:
                calibrate(*self.cost_model.fit(), token_time=self.cost_model.token_time())
            self._first_load.set()
            await asyncio.sleep(self.load_interval_s)
