"""verl's default: a trajectory sticks to its replica; a new one goes to the replica that has been
given the fewest trajectories so far (it ignores current load and cache contents)."""
from __future__ import annotations

from rollwise.router.policies.base import Policy


class Verl(Policy):
    name = "verl"

    def choose(self, info, cands):
        if info.sticky is not None and any(c.name == info.sticky for c in cands):
            return info.sticky
        return min(cands, key=lambda c: (c.assigned, c.name)).name

    def park(self, info):
        return True  # the trajectory belongs to its replica: it queues there, as on a verl worker
