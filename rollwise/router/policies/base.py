"""What a placement policy sees, and its interface: `choose` a replica for a request among those
with room, and optionally a `priority` that orders the global queue (lower goes first)."""
from __future__ import annotations

from dataclasses import dataclass

from rollwise.router.replica import LoadSnapshot
from rollwise.types import GenerateRequest


@dataclass(slots=True)
class Candidate:
    name: str
    inflight: int  # requests this router has in flight there
    inflight_tokens: int  # their work estimate (prompt not cached + max new tokens)
    matched: int  # prompt tokens it holds (prefix index, including routed-but-unfinished siblings)
    load: LoadSnapshot | None  # last snapshot from the replica itself
    assigned: int  # trajectories ever assigned to it
    homed: int = 0  # live trajectories whose last turn ran there (their next turns come back to it)


@dataclass(slots=True)
class RouteInfo:
    request: GenerateRequest
    prompt_len: int
    arrival: float  # monotonic seconds
    sticky: str | None  # replica of the trajectory's previous turn
    turns_done: int
    expected_turns: float | None  # from finished siblings (EMA), None before any finished
    expected_new_tokens: float = 64.0  # tokens a turn generates (EMA over finished requests)


class Policy:
    name = "base"

    def choose(self, info: RouteInfo, cands: list[Candidate]) -> str:
        raise NotImplementedError

    def priority(self, info: RouteInfo) -> float:
        return info.arrival  # FIFO

    def attach(self, max_inflight_per_replica: int) -> None:
        """Called by the router that uses this policy, with the requests it sends a replica at most."""

    def park(self, info: RouteInfo) -> bool:
        """When the replica holding this trajectory's context is full: wait for a slot there
        (True) rather than go elsewhere now."""
        return False


def least_loaded(cands: list[Candidate]) -> Candidate:
    return min(cands, key=lambda c: (c.inflight, c.inflight_tokens, c.name))
