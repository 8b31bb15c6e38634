"""vLLM 0.32's weight transfer (its RL API: `init_weight_transfer_engine`, `start_weight_update`,
`update_weights`, `finish_weight_update`), on a backend that runs on CPUs: "gloo". vLLM's own ("nccl",
"ipc") need GPUs. The control plane is vLLM's "nccl" one: init_info {master_address, master_port,
rank_offset, world_size, packed, packed_buffer_size_bytes}, update_info {names, dtype_names,
shapes}; the trainer is rank 0 of a process group the engines joined (from rank_offset on) and
broadcasts the weights in the order named, while the engines' `update_weights` calls receive them:
one broadcast a weight, or packed (as vLLM's trainer packs them by default) their bytes in
buffers of up to packed_buffer_size_bytes. Here packing costs a copy on each side: to two replicas
of the 32M model it took 301 ms against 207 ms one by one, so `GlooTrainer` sends one by one
unless told.

An engine stages what it receives and takes it at `finish_weight_update` as one weight update (a
new version: requests in flight finish under the weights they began with, as with every update
here), so a sync cut off midway changes nothing. `GlooTrainer` is the trainer's side; its updates'
broadcasts wait for the handshake (handshake.py: every engine checked the update and takes it).
"""
from __future__ import annotations

import contextlib
import datetime
import ipaddress
import itertools
import math
import socket
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait

import torch
import torch.distributed as dist

from rollwise.engine.handshake import CalledOff, agree, first_line, forget, refusal, take_part

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TIMEOUT = datetime.timedelta(seconds=300)  # a rendezvous or a broadcast that waits longer fails (init_info's
# timeout_s, rollwise's own key, sets another; the trainer passes its own)


PACKED_BYTES = 1 << 30  # vLLM's default packed buffer: the weights go in buffers of about this size


def chunks(sizes: list[int], limit: int) -> list[range]:
    """Consecutive runs of weights (their indexes) whose bytes add up to at most `limit` each (one
    larger weight alone): the packed broadcasts, the same on both sides from update_info alone."""
    out, start, total = [], 0, 0
    for i, n in enumerate(sizes):
        if i > start and total + n > limit:
            out.append(range(start, i))
            start, total = i, 0
        total += n
    return out + ([range(start, len(sizes))] if sizes else [])


def check_update(names, dtypes, shapes, where: str = "", dtype_key: str = "dtypes") -> None:
    """An update's weights as a trainer names them: lists of one length of names, dtype names (DTYPES)
    and shapes (ValueErrors begin with `where`)."""
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
            and len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"{where}names, {dtype_key} and shapes are lists of one length")
    for n, d, s in zip(names, dtypes, shapes):
        if not isinstance(n, str) or d not in DTYPES or not isinstance(s, list) or not all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in s):
            raise ValueError(f"{where}weight {n!r}: a name, a dtype in {sorted(DTYPES)} and a shape "
                             f"(non-negative integers), got {d!r}, {s!r}")


def receive_into(out: dict, group, names: list[str], dtypes: list[str], shapes: list[list[int]], packed: int) -> dict:
    """The weights named, as rank 0 of `group` broadcasts them in that order, into `out`: one broadcast
    a weight, or with `packed` > 0 their bytes one after another in buffers of up to that many (chunks)."""
    sizes = [math.prod(s) * DTYPES[d].itemsize for d, s in zip(dtypes, shapes)]
    for run in chunks(sizes, packed) if packed else [range(i, i + 1) for i in range(len(names))]:
        if not packed:
            t = torch.empty(shapes[run[0]], dtype=DTYPES[dtypes[run[0]]])
            group.broadcast(t, 0).wait()
            out[names[run[0]]] = t
            continue
        buf = torch.empty(sum(sizes[i] for i in run), dtype=torch.uint8)
        group.broadcast(buf, 0).wait()  # (the run's weights' bytes, one after another)
        at = 0
        for i in run:  # (copied out: a weight's offset in the buffer need not suit its dtype's alignment)
            t = torch.empty(shapes[i], dtype=DTYPES[dtypes[i]])
            t.view(-1).view(torch.uint8).copy_(buf[at:at + sizes[i]])
            out[names[i]] = t
            at += sizes[i]
    return out


def broadcast_while_replying(group, buffers: Iterable[torch.Tensor], replies: list[Future]) -> list:
    """Rank 0's side of an update: broadcasts `buffers` (made as they go) in order while the receivers'
    `replies` come; once all went, every reply (no receiver is still receiving when this returns): their
    results, or the first error in their order. A receiver that failed before the last broadcast (it
    did not take them all) or a broadcast that fails (a receiver gone; one that refused while a
    broadcast was under way leaves it to the group's timeout: the handshake first, `broadcast_agreed`,
    prevents that) leaves the group out of step: `OutOfStep`."""
    for b in buffers:
        cause = refusal(replies)
        if cause is None:
            try:
                group.broadcast(b, 0).wait()
                continue
            except RuntimeError as e:  # (gloo's: a receiver gone, or the group's timeout passed)
                wait(replies, 2.0, return_when=FIRST_EXCEPTION)  # (a receiver's own words over gloo's, if it gave them)
                cause = refusal(replies, e)
        raise OutOfStep(f"the weights did not all go ({first_line(cause)}); the group is out of step: close it and "
                        "join again") from cause
    wait(replies)
    return [r.result() for r in replies]


def broadcast_agreed(group, store, update_id: int, ranks: list[int], buffers: Iterable[torch.Tensor],
                     replies: list[Future], timeout: float) -> list:
    """`broadcast_while_replying` once the receivers of `ranks` agreed to update `update_id` in the
    handshake (`CalledOff` if not); `store` None: no handshake, the broadcasts at once (as SGLang's
    servers take them). The handshake's keys are forgotten once every reply came."""
    try:
        if store is not None:
            agree(store, update_id, ranks, replies, timeout)
        return broadcast_while_replying(group, buffers, replies)
    finally:
        if store is not None and all(r.done() for r in replies):
            forget(store, update_id, ranks)


class OutOfStep(ValueError):
    """A trainer's group whose receivers did not all take an update's broadcasts: it takes no more."""


def listening_store(address: str, port: int, world_size: int, timeout: datetime.timedelta, **kw) -> dist.TCPStore:
    """Rank 0's TCP store, listening on `address` alone (torch's own listens on every interface: a group
    on 127.0.0.1 would take connections from the network). The store owns the socket from then on."""
    family, *_, where = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    sock = socket.create_server((where[0], port), family=family)
    try:
        store = dist.TCPStore(address, port, world_size, is_master=True, timeout=timeout,
                              master_listen_fd=sock.fileno(), **kw)
    except BaseException:
        sock.close()
        raise
    sock.detach()
    return store


def resolve(address: str) -> tuple[str, ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """(the address a host name resolves to, as an ip_address)"""
    host = socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)[0][4][0]
    return host, ipaddress.ip_address(host.split("%")[0])


def gloo_options(address: str, rank: int, timeout: datetime.timedelta):
    """A gloo group's options whose device listens where the group's ranks meet: on the loopback for a
    group on a loopback address, on `address` for its rank 0; else gloo's default (the address this
    host's name resolves to, or GLOO_SOCKET_IFNAME's)."""
    host, ip = resolve(address)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host) if ip.is_loopback or (
        rank == 0 and not ip.is_unspecified) else dist.ProcessGroupGloo.create_default_device()]
    return opts


def _group(address: str, port: int, rank: int, world_size: int, timeout: datetime.timedelta):
    store = listening_store(address, port, world_size, timeout) if rank == 0 else \
        dist.TCPStore(address, port, world_size, is_master=False, timeout=timeout)
    return store, dist.ProcessGroupGloo(store, rank, world_size, gloo_options(address, rank, timeout))


class GlooReceiver:
    """An engine's side: joins the trainer's group, receives each update's weights into a staging dict.
    `check({name: shape})` (the engine's): would the engine take such weights (the handshake asks)."""

    def __init__(self, check: Callable[[dict], object] | None = None) -> None:
        self.check = check
        self.group = self.store = None
        self.staged: dict[str, torch.Tensor] | None = None  # an update under way: what came so far
        self.receiving = 0  # update_weights calls receiving now
        self.packed = 0  # init_info's "packed": the bytes of each buffer the weights come in; 0: one a weight
        self.lock = threading.Lock()  # (an HTTP server may call from several threads)

    def init(self, info: dict) -> None:
        if not isinstance(info, dict):
            raise ValueError(f"init_info must be an object, got {type(info).__name__}")
        unknown = set(info) - {"master_address", "master_port", "rank_offset", "world_size", "packed",
                               "packed_buffer_size_bytes", "packed_num_buffers", "timeout_s"}
        if unknown or not {"master_address", "master_port", "rank_offset", "world_size"} <= set(info):
            raise ValueError("init_info takes master_address, master_port, rank_offset and world_size (the gloo "
                             f"backend's, as vLLM's nccl one){f'; unknown: {sorted(unknown)}' if unknown else ''}")
        address, port, rank, size = (info[k] for k in ("master_address", "master_port", "rank_offset", "world_size"))
        if not isinstance(address, str) or not all(isinstance(x, int) and not isinstance(x, bool)
                                                    for x in (port, rank, size)):
            raise ValueError("init_info: master_address a string; master_port, rank_offset, world_size integers")
        if not (0 < port < 65536 and 0 < rank < size):
            raise ValueError(f"init_info: master_port in 1..65535 and 0 < rank_offset < world_size, got "
                             f"{port}, {rank}, {size} (the trainer is rank 0)")
        packed, limit = info.get("packed", False), info.get("packed_buffer_size_bytes", PACKED_BYTES)
        if not isinstance(packed, bool) or isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"init_info: packed true or false, packed_buffer_size_bytes a positive integer, got "
                             f"{packed!r}, {limit!r}")
        # rollwise's own key: how long the rendezvous and each receive may wait for the trainer
        wait_s = info.get("timeout_s", TIMEOUT.total_seconds())
        if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or not 0 < wait_s <= 86400:
            raise ValueError(f"init_info: timeout_s must be a number of seconds in (0, 86400], got {wait_s!r}")
        with self.lock:
            if self.staged is not None:
                raise ValueError("a weight update is under way: finish it first")
            self.packed = limit if packed else 0
            try:
                self.store, self.group = _group(address, port, rank, size, datetime.timedelta(seconds=wait_s))
            except RuntimeError as e:  # (torch's DistStoreError and the like: no trainer there in time)
                raise ValueError(f"could not join the trainer's group at {address}:{port} as rank {rank}: "
                                 f"{str(e).splitlines()[0]}") from e

    def start(self) -> None:
        with self.lock:
            if self.group is None:
                raise ValueError("no weight transfer: call init_weight_transfer_engine first")
            if self.staged is not None:
                raise ValueError("start_weight_update called while a weight update is under way; "
                                 "call finish_weight_update first")
            self.staged = {}

    def receive(self, info: dict) -> None:
        """One chunk: its weights, broadcast by the trainer in the order named, into the staging dict
        (with an update_id, rollwise's own key, after the handshake: rollwise.engine.handshake)."""
        if not isinstance(info, dict) or set(info) - {"names", "dtype_names", "shapes", "packed", "update_id"} \
                or not {"names", "dtype_names", "shapes"} <= set(info):
            raise ValueError("update_info takes names, dtype_names and shapes (lists of one length), and update_id")
        names, dtypes, shapes, uid = info["names"], info["dtype_names"], info["shapes"], info.get("update_id")
        check_update(names, dtypes, shapes, "update_info: ", "dtype_names")
        if uid is not None and (not isinstance(uid, int) or isinstance(uid, bool)):
            raise ValueError(f"update_info: update_id must be an integer, got {uid!r}")
        with self.lock:
            if self.staged is None:
                raise ValueError("start_weight_update must be called before update_weights")
            group, store, staged = self.group, self.store, self.staged
            self.receiving += 1
        try:
            if uid is not None:
                take_part(store, uid, group.rank(), self.check, dict(zip(names, shapes)))
            receive_into(staged, group, names, dtypes, shapes, self.packed)
        except RuntimeError as e:  # (gloo's or the store's: the trainer gone, or the group's timeout passed)
            with self.lock:  # the update is dropped (what came of it is not taken), the group left: out of step
                if self.group is group:
                    self.staged = self.group = self.store = None
            raise ValueError(f"the weights did not come ({first_line(e)}): this update is dropped, nothing changed, "
                             "and the trainer's group is left (out of step): init_weight_transfer_engine again") from e
        finally:
            with self.lock:
                self.receiving -= 1

    def finish(self) -> dict[str, torch.Tensor]:
        with self.lock:
            if self.staged is None:
                raise ValueError("finish_weight_update called without a matching start_weight_update")
            if self.receiving:
                raise ValueError("finish_weight_update called while update_weights is still receiving")
            staged, self.staged = self.staged, None
        return staged

    def shutdown(self) -> None:
        with self.lock:
            if self.staged is not None:
                raise ValueError("cannot release the trainer's connection during a weight update")
            self.group = self.store = None


class GlooTrainer:
    """The trainer's side, rank 0: `GlooTrainer(clients, port)` joins every engine into one group and
    `send_weights(named tensors, weight_version)` sends them all, one broadcast each (or with
    `packed` in buffers of up to `packed_buffer_size_bytes`). A client has
    vLLM's weight-sync calls (its VLLMWeightSyncClient protocol): `EngineClient(llm)` for an `LLM` in
    this process, `HTTPWeightSyncClient(url)` for `rollwise serve` or `rollwise route`; `world_sizes`:
    each client's engines (1 for an engine, a route's /get_world_size for a route)."""

    def __init__(self, clients: list, master_port: int, master_address: str = "127.0.0.1",
                 world_sizes: list[int] | None = None, timeout: float = 300.0, packed: bool = False,
                 packed_buffer_size_bytes: int = PACKED_BYTES) -> None:
        self.clients = list(clients)
        sizes = world_sizes or [1] * len(self.clients)
        self.world_size = 1 + sum(sizes)
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        self.pool = ThreadPoolExecutor(len(self.clients) + 1)
        self.packed = packed_buffer_size_bytes if packed else 0  # (as the engines' receivers: init_info tells them)
        infos = [{"master_address": master_address, "master_port": master_port, "rank_offset": o,
                  "world_size": self.world_size, "packed": packed, "packed_buffer_size_bytes": packed_buffer_size_bytes,
                  "timeout_s": timeout} for o in offsets]
        joins = [self.pool.submit(c.init_weight_transfer_engine, i) for c, i in zip(self.clients, infos)]
        group = self.pool.submit(_group, master_address, master_port, 0, self.world_size,
                                 datetime.timedelta(seconds=timeout))
        wait(joins + [group], return_when=FIRST_EXCEPTION)  # (an engine that refused: not a wait for the timeout)
        for j in joins:
            if j.done():
                j.result()
        self.store, self.group = group.result()
        for j in joins:
            j.result()
        self.timeout, self.updates = timeout, itertools.count(1)  # (each update's id, for the handshake)
        self.broken: str | None = None  # (OutOfStep's message: an update whose broadcasts did not all go)

    def send_weights(self, weights: dict | Iterable, weight_version: str | None = None) -> None:
        if self.broken:
            raise OutOfStep(self.broken)
        items = list(weights.items() if isinstance(weights, dict) else weights)
        info = {"names": [n for n, _ in items], "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in items],
                "shapes": [list(t.shape) for _, t in items]}
        # (checked before any engine is asked: a bad update leaves the group in step)
        check_update(info["names"], info["dtype_names"], info["shapes"], dtype_key="dtype_names")
        for i, c in enumerate(self.clients):
            try:
                c.start_weight_update()
            except Exception:  # (one under way already, say): those started end theirs, unchanged
                self._end(self.clients[:i])
                raise
        uid, ranks = next(self.updates), list(range(1, self.world_size))
        receiving = [self.pool.submit(c.update_weights, {**info, "update_id": uid}) for c in self.clients]
        tensors = [t.detach().contiguous() for _, t in items]
        runs = chunks([t.nbytes for t in tensors], self.packed) if self.packed else [range(i, i + 1) for i in
                                                                                    range(len(tensors))]
        buffers = (tensors[run[0]] if not self.packed else torch.cat([tensors[i].view(-1).view(torch.uint8)
                                                                      for i in run]) for run in runs)
        try:
            broadcast_agreed(self.group, self.store, uid, ranks, buffers, receiving, self.timeout)
        except CalledOff:  # (no weight went: every engine ends the update, unchanged)
            self._end(self.clients)
            raise
        except OutOfStep as e:
            self.broken = str(e)
            raise
        for c in self.clients:
            c.finish_weight_update(weight_version)

    @staticmethod
    def _end(clients: list) -> None:
        """End an update that sent no weight on these engines (nothing staged: no new version)."""
        for c in clients:
            with contextlib.suppress(Exception):  # (one down, say: what went wrong first is the error to raise)
                c.finish_weight_update()

    def close(self) -> None:
        for c in self.clients:
            c.shutdown_weight_transfer_engine()
        self.pool.shutdown()
        self.group = self.store = None


class EngineClient:
    """vLLM's weight-sync client calls on an `LLM` of this process (vLLM's Ray client does the same
    over an actor): raw init and update infos wrapped as the LLM's requests."""

    def __init__(self, llm) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()


class HTTPWeightSyncClient:
    """vLLM's HTTPVLLMWeightSyncClient's calls, on a `rollwise serve` or `rollwise route` URL."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 300.0) -> None:
        import httpx
        self.client = httpx.Client(base_url=url.rstrip("/"), timeout=timeout,
                                   headers={"Authorization": f"Bearer {api_key}"} if api_key else None)

    def _post(self, path: str, body: dict | None = None) -> None:
        r = self.client.post(path, json=body)
        if r.status_code != 200:
            raise ValueError(f"{path}: HTTP {r.status_code}: {r.text[:500]}")

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._post("/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._post("/start_weight_update")

    def update_weights(self, update_info: dict) -> None:
        self._post("/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._post("/finish_weight_update", None if weight_version is None else {"weight_version": weight_version})

    def shutdown_weight_transfer_engine(self) -> None:
        self._post("/shutdown_weight_transfer_engine")
