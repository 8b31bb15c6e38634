"""A run's weight updates to its HTTP replicas in one process group (`replica_weights_via =
"broadcast"`, rollwise/router/broadcast.py): the router joins `rollwise serve` processes into a gloo
group once and broadcasts each update into all of them; a change of members builds the group again;
an update the group fails (a server refuses, or is gone) reaches each replica its own way instead."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from rollwise.engine.group_transfer import GroupTrainer
from rollwise.rl_config import TrainConfig
from rollwise.rollout.fleet import make_router
from rollwise.router.broadcast import FleetBroadcast, facing_address
from rollwise.router.replica import HttpReplica
from rollwise.router.router import Router
from rollwise.serve.process import ServerProcess, free_port
from tests.serve.test_group_transfer import _expected, _greedy

ARGS = ("--max-model-len", "256")


@pytest.fixture(scope="module")
def servers(model_dir):
    with ServerProcess(model_dir, *ARGS, threads=1) as a, ServerProcess(model_dir, *ARGS, threads=1) as b:
        yield [a.url, b.url]


def _weights(model: str) -> dict[str, torch.Tensor]:
    return load_file(str(Path(model) / "model.safetensors"))


def test_updates_go_through_one_group_and_fall_back_when_it_fails(servers, model_dir, other_dir):
    before, after = _expected(model_dir), _expected(other_dir)
    assert before != after
    mine, other = _weights(model_dir), _weights(other_dir)

    async def go():
        router = Router([HttpReplica(u) for u in servers], "round_robin")
        fleet = router.broadcast = FleetBroadcast(timeout=120)
        try:
            assert await router.update_weights(other, 3) == {u: 3 for u in servers}
            assert [_greedy(u) for u in servers] == [(after, 3)] * 2
            assert fleet.stats == {"groups_built": 1, "updates": 1, "fallbacks": 0}
            assert await router.update_weights(mine, 4, partial_rollout=True) == {u: 4 for u in servers}
            assert [_greedy(u) for u in servers] == [(before, 4)] * 2
            assert fleet.stats["groups_built"] == 1 and fleet.stats["updates"] == 2  # the same group

            # a replica out of the members (stale): the group is built again without it, and it gets
            # the update its own way
            router.stale.add(servers[1])
            assert await router.update_weights(other, 5) == {u: 5 for u in servers}
            assert fleet.members == [servers[0]] and fleet.stats["groups_built"] == 2
            assert [_greedy(u) for u in servers] == [(after, 5)] * 2 and not router.stale

            assert await router.update_weights(mine, 6) == {u: 6 for u in servers}  # both members again
            assert fleet.members == servers and fleet.stats["groups_built"] == 3

            # the group fails (a server left it behind the router's back: it refuses the update): the
            # update reaches each replica its own way, and the next one builds a new group
            name = fleet.trainer.group_name
            assert httpx.post(servers[0] + "/destroy_weights_update_group", json={"group_name": name}).json()["success"]
            assert await router.update_weights(other, 7) == {u: 7 for u in servers}
            assert fleet.stats["fallbacks"] == 1 and fleet.trainer is None
            assert [_greedy(u) for u in servers] == [(after, 7)] * 2
            assert await router.update_weights(mine, 8) == {u: 8 for u in servers}
            assert fleet.stats == {"groups_built": 4, "updates": 5, "fallbacks": 1}
            assert [_greedy(u) for u in servers] == [(before, 8)] * 2
            last = fleet.trainer.group_name
            # a subset (LoRA's merged linears): the rest stays as it was
            norm = "model.norm.weight"
            assert await router.update_weights({norm: other[norm]}, 9) == {u: 9 for u in servers}
            for u in servers:
                got = httpx.post(u + "/get_weights_by_name", json={"name": norm, "truncate_size": 4}).json()
                assert got == other[norm][:4].tolist() and _greedy(u)[1] == 9
        finally:
            await router.update_weights(mine, 10)
            await router.close()
        assert fleet.trainer is None
        for u in servers:  # the router left its group on every server
            r = httpx.post(u + "/destroy_weights_update_group", json={"group_name": last})
            assert r.status_code == 400 and "no group" in r.json()["message"]
    asyncio.run(go())


def test_a_replica_gone_mid_run_costs_the_group_not_the_update(servers, model_dir, other_dir):
    """A member that went down after the group was built: the broadcast fails (at once, not after the
    group's timeout), the live replica gets the update its own way, the dead one is out of routing."""
    other, mine = _weights(other_dir), _weights(model_dir)

    async def go():
        with ServerProcess(model_dir, *ARGS, threads=1) as gone:
            router = Router([HttpReplica(servers[0]), HttpReplica(gone.url)], "round_robin")
            fleet = router.broadcast = FleetBroadcast(timeout=600)
            assert await router.update_weights(other, 11) == {servers[0]: 11, gone.url: 11}
            gone.proc.kill()
            gone.proc.wait()
            t = asyncio.get_running_loop().time()
            assert await router.update_weights(mine, 12) == {servers[0]: 12}
            assert asyncio.get_running_loop().time() - t < 300  # (the group's timeout is 600 s)
            assert fleet.stats["fallbacks"] == 1 and gone.url not in router.healthy and gone.url in router.stale
            assert _greedy(servers[0])[1] == 12
            await router.close()
    asyncio.run(go())


def test_a_join_that_fails_fails_the_group_at_once(servers):
    """A server that is down fails the group's building when its join does, not after the rendezvous's
    timeout (the others' joins end at that timeout)."""
    t = time.monotonic()
    with pytest.raises(httpx.ConnectError):
        GroupTrainer([servers[0], "http://127.0.0.1:1"], free_port(), group_name="never", timeout=120)
    assert time.monotonic() - t < 60


def test_a_run_config_picks_the_broadcast(model_dir):
    cfg = TrainConfig.from_dict({"model": model_dir, "replica_urls": ["http://127.0.0.1:1", "http://127.0.0.1:2"],
                                 "replica_weights_via": "broadcast"})
    router = make_router(cfg, None)
    assert isinstance(router.broadcast, FleetBroadcast)
    assert {r.weights_via for r in router.replicas.values()} == {"file"}  # (each its own way when the group fails)
    assert make_router(TrainConfig.from_dict({"model": model_dir, "replica_urls": ["http://127.0.0.1:1"]}),
                       None).broadcast is None
    with pytest.raises(ValueError, match="broadcast"):
        TrainConfig.from_dict({"model": model_dir, "replica_weights_via": "nfs"})
    assert facing_address(["http://127.0.0.1:8000", "http://localhost:9"]) == "127.0.0.1"
