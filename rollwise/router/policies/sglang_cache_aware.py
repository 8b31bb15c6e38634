"""sglang-router's cache_aware policy: if the load is imbalanced (max - min > 64 and max > 1.5 min)
go to the shortest queue; else if some replica holds > 30% of the prompt, go to the best match;
else to the least loaded."""
from __future__ import annotations

from rollwise.router.policies.base import Policy, least_loaded


class SglangCacheAware(Policy):
    name = "sglang_cache_aware"

    def __init__(self, abs_threshold: int = 64, rel_threshold: float = 1.5, cache_threshold: float = 0.3) -> None:
        self.abs, self.rel, self.cache = abs_threshold, rel_threshold, cache_threshold

    def choose(self, info, cands):
        loads = [c.inflight for c in cands]
        if max(loads) - min(loads) > self.abs and max(loads) > self.rel * min(loads):
            return least_loaded(cands).name
        best = max(cands, key=lambda c: (c.matched, -c.inflight))
        if best.matched / max(info.prompt_len, 1) > self.cache:
            return best.name
        return least_loaded(cands).name
