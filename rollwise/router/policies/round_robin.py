from __future__ import annotations

from rollwise.router.policies.base import Policy


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self.next = 0

    def choose(self, info, cands):
        c = sorted(cands, key=lambda c: c.name)[self.next % len(cands)]
        self.next += 1
        return c.name
