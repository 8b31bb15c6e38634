"""NVIDIA Dynamo's KV-aware routing: the cost of a replica is the prefill blocks it would compute
(prompt not cached there) plus its active decode blocks; siblings routed together count as cached
because the router records each placement in its prefix index at once."""
from __future__ import annotations

from rollwise.router.policies.base import Policy


class Dynamo(Policy):
    name = "dynamo"

    def __init__(self, block_size: int = 16) -> None:
        self.block_size = block_size

    def choose(self, info, cands):
        def cost(c):
            return ((info.prompt_len - c.matched) / self.block_size + c.inflight_tokens / self.block_size, c.name)
        return min(cands, key=cost).name
