from __future__ import annotations

from rollwise.router.policies.base import Policy, least_loaded


class LeastLoad(Policy):
    name = "least_load"

    def choose(self, info, cands):
        return least_loaded(cands).name
