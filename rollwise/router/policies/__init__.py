"""Placement policies, one file each, all behind `Policy.choose` / `Policy.priority`."""
from __future__ import annotations

from rollwise.router.policies.base import Candidate, Policy, RouteInfo
from rollwise.router.policies.dynamo import Dynamo
from rollwise.router.policies.least_load import LeastLoad
from rollwise.router.policies.rollwise import Rollwise
from rollwise.router.policies.round_robin import RoundRobin
from rollwise.router.policies.sglang_cache_aware import SglangCacheAware
from rollwise.router.policies.sticky_least_load import StickyLeastLoad
from rollwise.router.policies.verl import Verl
from rollwise.router.policies.war import War

POLICIES = {p.name: p for p in (RoundRobin, LeastLoad, Verl, StickyLeastLoad, SglangCacheAware, Dynamo, War,
                                Rollwise)}


def make_policy(name: str, **options) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; available: {sorted(POLICIES)}")
    return POLICIES[name](**options)


__all__ = ["POLICIES", "Candidate", "Policy", "RouteInfo", "make_policy"]
