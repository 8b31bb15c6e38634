"""New weights to a fleet's HTTP replicas in one process group (`replica_weights_via = "broadcast"`):
the router's process joins its replicas into a gloo group (SGLang's `init_weights_update_group`, as
`rollwise serve` and SGLang serve it; `GroupTrainer`) and broadcasts each update into all of them at
once, where "file" and "stream" send it to each in turn (benchmarks/weight_sync.py).

The group is built on the first update and kept while the members it was built for are the ones to
update (healthy, with the latest weights); a change (one down, stale, asleep, joined or gone) builds
it again at the next update. An update that fails in the group (a server refuses, goes down, or does
not take a broadcast within `timeout` seconds) leaves the group, and the router sends that update
to each replica its own way ("file" or "stream"), so nothing is lost but time.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import uuid

import httpx

from rollwise.config import LOOPBACK
from rollwise.engine.group_transfer import GroupTrainer
from rollwise.router.replica import HttpReplica
from rollwise.serve.process import free_port

log = logging.getLogger("rollwise.router")


def facing_address(urls: list[str]) -> str:
    """The address of this host that the replicas reach it by: loopback when they are all here, else
    the one its route to the first remote replica leaves from (no packet is sent)."""
    hosts = [httpx.URL(u).host for u in urls]
    remote = [h for h in hosts if h not in LOOPBACK]
    if not remote:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((remote[0], 9))
        return s.getsockname()[0]


class FleetBroadcast:
    """`send(router, weights, version, partial_rollout)` -> the replicas that took the update in the group."""

    def __init__(self, api_key: str | None = None, timeout: float = 60.0) -> None:
        self.api_key, self.timeout = api_key, timeout
        self.trainer: GroupTrainer | None = None
        self.members: list[str] = []  # the replicas (names) the group was built for
        self._names = itertools.count()
        self._prefix = f"rollwise-fleet-{uuid.uuid4().hex[:8]}"  # (torch names a process's groups once)
        self.stats = {"groups_built": 0, "updates": 0, "fallbacks": 0}

    async def send(self, router, weights: dict, version: int, partial_rollout: bool = False) -> list[str]:
        members = [n for n, r in router.replicas.items() if isinstance(r, HttpReplica) and n in router.healthy
                   and n not in router.stale and n not in router.asleep]  # (`rollwise serve` or SGLang)
        if not members:
            return []
        try:
            if self.trainer is None or self.members != members:
                await self.close()
                urls = [router.replicas[n].url for n in members]
                self.trainer = await asyncio.to_thread(
                    GroupTrainer, urls, free_port(), facing_address(urls), f"{self._prefix}-{next(self._names)}",
                    self.timeout, self.api_key)
                self.members = members
                self.stats["groups_built"] += 1
            await asyncio.to_thread(self.trainer.send_weights, weights, str(version), False, partial_rollout)
        except Exception as e:  # noqa: BLE001 - the update goes to each replica its own way instead
            log.warning("weight broadcast to %s failed (%s): sending to each replica instead", members, e)
            self.stats["fallbacks"] += 1
            await self.close()
            return []
        self.stats["updates"] += 1
        return members

    async def close(self) -> None:
        """Leave the group, whatever the servers answer (one that is down took its group with it)."""
        trainer, self.trainer, self.members = self.trainer, None, []
        if trainer is not None:
            await asyncio.to_thread(trainer.close, False)
