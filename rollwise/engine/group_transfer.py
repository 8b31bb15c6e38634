"""SGLang's weight update from a process group (`init_weights_update_group`,
`update_weights_from_distributed`, `destroy_weights_update_group`), as AReaL, slime and SkyRL drive
SGLang servers from their trainers, on the backend that runs on CPUs: "gloo".

The group is laid out as those trainers make theirs (a copy of torch's `init_process_group` that
builds a group other than the default one): torch's TCP rendezvous at master_address:master_port,
the store under the group's name, and torch's group builder under that name. The trainer is rank 0;
an engine joins as rank_offset. For each update the trainer names the weights (names, dtypes,
shapes) in a request and broadcasts them in that order: one broadcast a weight, or with
load_format "flattened_bucket" one broadcast of all their bytes one after another (SGLang's
FlattenedTensorBucket). Each update is a weight update of the engine's own (`update_weights`): the
weights named replace the newest ones' (a bucket of them, or all), requests in flight finish under
the weights they began with. `GroupTrainer` is a trainer's side. Between rollwise's two sides each
update's broadcasts wait for the handshake (handshake.py: every engine checked it and takes it);
SGLang's trainers and servers send and take them at once.
"""
from __future__ import annotations

import contextlib
import datetime
import itertools
import os
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from rollwise.engine.handshake import take_part
from rollwise.engine.weight_transfer import (TIMEOUT, OutOfStep, broadcast_agreed, check_update, listening_store,
                                              receive_into, resolve)
from rollwise.wire import GROUP

BROKEN = "broken"  # a group that failed an update: left, its name kept until destroyed


def torch_group(address: str, port: int, world_size: int, rank: int, group_name: str,
                timeout: datetime.timedelta = TIMEOUT, backend: str = "gloo"):
    """A process group besides torch's default one, laid out as SGLang's and its trainers' are (above),
    and its store (the handshake's: rollwise.engine.handshake)."""
    if rank == 0:  # (torch's rendezvous would listen on every interface)
        store = listening_store(address, port, world_size, timeout)
    else:
        store, rank, world_size = next(c10d.rendezvous(f"tcp://{address}:{port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    with _device_on(address):
        group, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend),
                                                  c10d.PrefixStore(group_name, store), group_name=group_name,
                                                  timeout=timeout)
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group, store


_DEVICE = threading.Lock()  # (the environment that gloo's default device is read from, while a group is built)


@contextlib.contextmanager
def _device_on(address: str):
    """torch's group builder takes no gloo options, and gloo's default device listens on the address
    this host's name resolves to: in a cluster, one other hosts reach. For a group on a loopback
    address, the group is built with the loopback's interface (gloo's GLOO_SOCKET_IFNAME, set meanwhile)
    so its sockets listen there alone, as the trainer's store does; other groups keep gloo's default."""
    if not resolve(address)[1].is_loopback:
        yield
        return
    with _DEVICE:
        before = os.environ.get("GLOO_SOCKET_IFNAME")
        os.environ["GLOO_SOCKET_IFNAME"] = loopback_interface()
        try:
            yield
        finally:
            if before is None:
                os.environ.pop("GLOO_SOCKET_IFNAME", None)
            else:
                os.environ["GLOO_SOCKET_IFNAME"] = before


def loopback_interface() -> str:
    """The loopback's network interface (Linux: "lo"), as GLOO_SOCKET_IFNAME names one."""
    for _, name in socket.if_nameindex():
        try:
            if int(Path(f"/sys/class/net/{name}/flags").read_text(), 16) & 0x8:  # IFF_LOOPBACK
                return name
        except (OSError, ValueError):
            pass
    return "lo"


class GroupReceiver:
    """An engine's side: the groups it joined, by name; `receive` takes one update's weights.
    `check({name: shape})` (the engine's): would the engine take such weights (the handshake asks)."""

    def __init__(self, check: Callable[[dict], object] | None = None) -> None:
        self.check = check
        self.groups: dict[str, object] = {}  # name -> group (None while joining)
        self.stores: dict[str, object] = {}  # name -> the group's store
        self.busy: set[str] = set()  # groups receiving now
        self.lock = threading.Lock()  # (an HTTP server calls from several threads)

    def init(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
             group_name: str = GROUP, backend: str = "gloo", timeout_s: float = TIMEOUT.total_seconds()) -> None:
        """Join the trainer's group as rank `rank_offset` (waits for every rank, up to `timeout_s`)."""
        if backend != "gloo":
            raise ValueError(f"backend {backend!r} is not taken: this engine runs on the CPU, where the "
                             "weights come over 'gloo'")
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (master_port, rank_offset, world_size)) \
                or not (0 < master_port < 65536 and 0 < rank_offset < world_size):
            raise ValueError(f"master_port in 1..65535 and 0 < rank_offset < world_size (the trainer is rank 0), "
                             f"got {master_port!r}, {rank_offset!r}, {world_size!r}")
        if not isinstance(group_name, str) or not group_name:
            raise ValueError(f"group_name must be a non-empty string, got {group_name!r}")
        with self.lock:
            if group_name in self.groups:
                raise ValueError(f"group {group_name!r} is joined already: destroy_weights_update_group first")
            if group_name in c10d._world.pg_names.values():  # (torch names a process's groups once)
                raise ValueError(f"this process has a group {group_name!r} of its own (a trainer here?): the trainer "
                                 "and the engine join from different processes")
            self.groups[group_name] = None
        try:
            group, store = torch_group(master_address, master_port, world_size, rank_offset, group_name,
                                       datetime.timedelta(seconds=timeout_s))
        except (RuntimeError, ValueError) as e:  # (torch's DistStoreError and the like: no trainer there in time)
            with self.lock:
                del self.groups[group_name]
            raise ValueError(f"could not join group {group_name!r} at {master_address}:{master_port} as rank "
                             f"{rank_offset}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
        with self.lock:
            self.groups[group_name], self.stores[group_name] = group, store

    def _take(self, group_name: str, broken_ok: bool = False):
        with self.lock:
            group = self.groups.get(group_name)
            if group is None:
                raise ValueError(f"no group {group_name!r} joined (joined: {sorted(self.groups)}): call "
                                 "init_weights_update_group first")
            if group is BROKEN and not broken_ok:
                raise ValueError(f"group {group_name!r} failed an update and was left: destroy it and join again")
            if group_name in self.busy:
                raise ValueError(f"group {group_name!r} is receiving an update already")
            self.busy.add(group_name)
        return group

    def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str = GROUP,
                flattened: bool = False, update_id: int | None = None) -> dict[str, torch.Tensor]:
        """One update's weights, by name, as the trainer broadcasts them (flattened: in one broadcast).
        With `update_id` (a trainer's that takes part in the handshake) the engine's check first, and
        the trainer's word (ValueError: refused or called off, the group in step). Weights that do not
        come (the trainer or another rank gone, or the group's timeout passed) leave the group (it is
        out of step): its name stays, refusing updates, until it is destroyed."""
        check_update(names, dtypes, shapes)
        group = self._take(group_name)
        try:
            if update_id is not None:
                take_part(self.stores[group_name], update_id, group.rank(), self.check, dict(zip(names, shapes)))
            return receive_into({}, group, names, dtypes, shapes, packed=(1 << 62) if flattened else 0)
        except RuntimeError as e:  # (gloo's: the trainer gone, or no broadcast within the group's timeout)
            with self.lock:
                self.groups[group_name] = BROKEN
            dist.destroy_process_group(group)
            raise ValueError(f"group {group_name!r}: the weights did not come ({str(e).splitlines()[0]}); the group "
                             "is out of step and was left: destroy it and join again") from e
        finally:
            with self.lock:
                self.busy.discard(group_name)

    def destroy(self, group_name: str = GROUP) -> None:
        group = self._take(group_name, broken_ok=True)
        with self.lock:
            self.groups.pop(group_name)
            self.stores.pop(group_name, None)
            self.busy.discard(group_name)
        if group is not BROKEN:
            dist.destroy_process_group(group)


class GroupTrainer:
    """A trainer's side, rank 0, against SGLang servers or `rollwise serve` (URLs): `GroupTrainer(urls,
    port)` joins every server into one group, `send_weights(named tensors)` sends them in one update
    (`flattened`: one broadcast, SGLang's "flattened_bucket"), `close()` leaves it."""

    def __init__(self, urls: list[str], master_port: int, master_address: str = "127.0.0.1",
                 group_name: str = GROUP, timeout: float = 300.0, api_key: str | None = None) -> None:
        import httpx
        self.group_name, self.world_size = group_name, 1 + len(urls)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self.clients = [httpx.Client(base_url=u.rstrip("/"), timeout=timeout, headers=headers) for u in urls]
        self.pool = ThreadPoolExecutor(len(urls) + 1)
        joins = [self.pool.submit(self._post, c, "/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": i + 1,
            "world_size": self.world_size, "group_name": group_name, "backend": "gloo", "timeout_s": timeout})
            for i, c in enumerate(self.clients)]
        mine = self.pool.submit(torch_group, master_address, master_port, self.world_size, 0, group_name,
                                datetime.timedelta(seconds=timeout))
        try:
            for j in as_completed([*joins, mine]):  # a server that refuses (or is down) fails this at once,
                j.result()  # not after the rendezvous's timeout (which then ends the other joins)
        except BaseException:
            for c in self.clients:
                c.close()
            self.pool.shutdown(wait=False)
            raise
        self.group, self.store = mine.result()
        self.timeout, self.updates = timeout, itertools.count(1)
        # the handshake before each update's broadcasts (rollwise.engine.handshake) when every server
        # takes part (`rollwise serve` says so as it joins; SGLang's servers do not)
        self.handshake = all(j.result().get("update_handshake") is True for j in joins)
        self.broken: str | None = None  # (OutOfStep's message: an update whose broadcasts did not all go)

    @staticmethod
    def _post(client, path: str, body: dict) -> dict:
        r = client.post(path, json=body)
        if r.status_code != 200:
            raise ValueError(f"{client.base_url}{path}: HTTP {r.status_code}: {r.text[:500]}")
        return r.json()

    def send_weights(self, weights: dict, weight_version: str | None = None, flattened: bool = False,
                     partial_rollout: bool = False) -> list[dict]:
        """One update to every server; their replies. `partial_rollout` (rollwise's own: `rollwise
        serve` takes it, SGLang does not): requests in flight continue under the new weights."""
        if self.broken:
            raise OutOfStep(self.broken)
        items = [(n, t.detach().contiguous()) for n, t in weights.items()]
        body = {"names": [n for n, _ in items], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in items],
                "shapes": [list(t.shape) for _, t in items], "group_name": self.group_name,
                "load_format": "flattened_bucket" if flattened else None, "weight_version": weight_version,
                **({"partial_rollout": True} if partial_rollout else {})}
        check_update(body["names"], body["dtypes"], body["shapes"])  # (before any server is asked: in step)
        uid, ranks = next(self.updates), list(range(1, self.world_size))
        if self.handshake:
            body["update_id"] = uid
        replies = [self.pool.submit(self._post, c, "/update_weights_from_distributed", body) for c in self.clients]
        tensors = [t for _, t in items]
        if flattened:
            tensors = [torch.cat([t.view(-1).view(torch.uint8) for t in tensors])] if tensors else []
        try:  # (every reply waited for: a server still receiving would refuse the next update)
            return broadcast_agreed(self.group, self.store if self.handshake else None, uid, ranks, tensors, replies,
                                    self.timeout)  # (a refusal in the handshake: CalledOff, in step)
        except OutOfStep as e:
            self.broken = str(e)
            raise

    def close(self, strict: bool = True) -> None:
        """Leave the group: every server destroys it, then this side. Not `strict` (after a failure):
        this side first, and what a server answers (or whether it answers) is let be."""
        if not strict:
            dist.destroy_process_group(self.group)
        for c in self.clients:
            try:
                self._post(c, "/destroy_weights_update_group", {"group_name": self.group_name})
            except Exception:  # noqa: BLE001 - not strict: a server down, or still receiving (it leaves the
                if strict:  # group itself when the weights do not come)
                    raise
            c.close()
        if strict:
            dist.destroy_process_group(self.group)
        self.pool.shutdown(wait=strict)
