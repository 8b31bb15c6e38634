"""WAR's global scheduler: below a total-load threshold, least-request with stickiness; above it,
the queue goes by waiting time (guarding sandbox expiry), then by expected remaining turns (from
finished siblings), and placement by cache hit for the request, then in-flight load."""
from __future__ import annotations

from rollwise.router.policies.base import Policy, least_loaded


class War(Policy):
    name = "war"

    def __init__(self, load_threshold: float = 0.5, capacity: int | None = None, turn_s: float = 1.0) -> None:
        # high load: more than load_threshold x capacity requests in flight per replica; capacity
        # defaults to the router's max_inflight_per_replica (what a replica can take from it; 64 without one)
        self.threshold, self.capacity, self.turn_s = load_threshold, capacity, turn_s
        self.high = False

    def attach(self, max_inflight_per_replica: int) -> None:
        if self.capacity is None:
            self.capacity = max_inflight_per_replica

    def choose(self, info, cands):
        total = sum(c.inflight for c in cands)
        self.high = total > self.threshold * (self.capacity or 64) * len(cands)
        names = {c.name for c in cands}
        if not self.high:
            return info.sticky if info.sticky in names else least_loaded(cands).name
        return max(cands, key=lambda c: (c.matched, -c.inflight, c.name)).name

    def priority(self, info):
        # waiting time first (FIFO); among requests of similar age, more expected turns left goes first
        left = max((info.expected_turns or 0.0) - info.turns_done, 0.0)
        return info.arrival - 0.01 * self.turn_s * left
