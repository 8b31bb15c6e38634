from __future__ import annotations

from rollwise.router.policies.base import Policy, least_loaded


class StickyLeastLoad(Policy):
    name = "sticky_least_load"

    def choose(self, info, cands):
        if info.sticky in {c.name for c in cands}:
            return info.sticky
        return least_loaded(cands).name

    def park(self, info):
        return True  # the trajectory belongs to its replica: it queues there, as on a verl worker
