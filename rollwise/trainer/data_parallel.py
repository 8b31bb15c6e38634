"""Data-parallel training: the trainer on N processes (verl's and AReaL's data-parallel ranks; here
torch.distributed's gloo, on 127.0.0.1 alone).

Every rank holds the whole policy and its optimizer. Every rank is given every group of a step (rank
0, the run's process, sends them), computes what needs no model over all of them (advantages, the
batch's totals, the episode metrics), and runs the forward and backward of its own share: whole
groups, placed on the rank with the fewest generated tokens so far this step. Before each optimizer
update the gradients are summed over the ranks, as are the loss statistics, the whitening sums and
the logprob check's differences (and the critic's, `advantage = "gae"`): every rank then takes the
same update, so the weights stay equal without being sent, and the step is the one-process step's
up to the order of its sums. With `mini_batches` > 1 the k-th update takes every rank's k-th part.
KL in the reward (`reward_kl_coef`) needs every episode's KL on every rank: each rank computes a
share and they exchange them (kl_reward.py).

`Comm` is what the trainer sees (one process: every collective is the identity); `Gloo` is the
process group; `DataParallelTrainer` is the trainer as the run sees it: rank 0 in the run's process,
handing each call on to the other ranks (worker processes started by `start`), or with the trainer
apart (`start_apart`) every rank a worker, rank 0 training the run's weights in shared memory."""
from __future__ import annotations

import contextlib
import hashlib
import multiprocessing as mp
import pickle
import time
from datetime import timedelta
from typing import Any, Callable

import torch

from rollwise.serve.process import exit_reason, free_port


class Comm:
    """One process: rank 0 of 1."""
    rank, world = 0, 1

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def gather(self, obj: Any) -> list:
        return [obj]

    def grads(self, params) -> None:
        """Each parameter's gradient summed over the ranks (None where no rank has one)."""

    def shard(self, groups: list, loads: list[float], size=None) -> list:
        """The groups this rank trains (`loads`: each rank's generated tokens so far this step; `size`:
        an item's measure, default its generated tokens)."""
        return groups

    def broadcast_params(self, module: torch.nn.Module) -> None:
        """Rank 0's weights to every rank (here: none other)."""


TIMEOUT = timedelta(seconds=1800)  # a collective's wait for the other ranks (their share of a step)


def store(port: int, world: int, master: bool):
    """The group's rendezvous: a TCP store on 127.0.0.1 (rank 0's), listening there alone."""
    import torch.distributed as dist
    from rollwise.engine.weight_transfer import listening_store
    if master:
        return listening_store("127.0.0.1", port, world, TIMEOUT, wait_for_workers=False)
    return dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=TIMEOUT)


class Gloo(Comm):
    """The ranks' gloo group (a group of its own, not torch's default one: its sockets on the loopback)."""

    def __init__(self, rank: int, world: int, kv) -> None:
        import torch.distributed as dist
        from rollwise.engine.weight_transfer import gloo_options
        self.rank, self.world = rank, world
        self.pg = dist.ProcessGroupGloo(kv, rank, world, gloo_options("127.0.0.1", rank, TIMEOUT))

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        self.pg.allreduce([t]).wait()
        return t

    def gather(self, obj: Any) -> list:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.long) for _ in range(self.world)]
        self.pg.allgather([sizes], [torch.tensor([data.numel()])]).wait()
        n = int(max(sizes))
        bufs = [torch.empty(n, dtype=torch.uint8) for _ in range(self.world)]
        self.pg.allgather([bufs], [torch.cat([data, data.new_zeros(n - data.numel())])]).wait()
        return [pickle.loads(b[:int(k)].numpy().tobytes()) for b, k in zip(bufs, sizes)]

    def grads(self, params) -> None:
        params = list(params)
        has = torch.tensor([float(p.grad is not None) for p in params])
        flat = torch.cat([has] + [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                                  for p in params])
        self.pg.allreduce([flat]).wait()
        k = len(params)
        for i, p in enumerate(params):
            g = flat[k:k + p.numel()].view_as(p)
            k += p.numel()
            if flat[i] > 0:
                p.grad = g.clone() if p.grad is None else p.grad.copy_(g)

    def shard(self, groups: list, loads: list[float], size=None) -> list:
        """Largest group first onto the least-loaded rank (every rank computes the same placement)."""
        size, mine = size or generated, set()
        for i in sorted(range(len(groups)), key=lambda i: -size(groups[i])):
            r = min(range(self.world), key=lambda r: (loads[r], r))
            loads[r] += max(size(groups[i]), 1)
            if r == self.rank:
                mine.add(i)
        return [g for i, g in enumerate(groups) if i in mine]  # in their order

    def broadcast_params(self, module: torch.nn.Module) -> None:
        for t in list(module.state_dict().values()):
            if t.is_floating_point():
                self.pg.broadcast(t, 0).wait()

    def close(self) -> None:
        self.pg.shutdown()


def fingerprint(trainer) -> str:
    h = hashlib.sha256()
    for p in [*trainer.policy.parameters(), *(trainer.critic.parameters() if trainer.critic is not None else [])]:
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def generated(group: list) -> int:
    return sum(t.num_generated for t in group)


class DataParallelTrainer:
    """The trainer on processes of its own. Rank 0 here (`trainer`): each call runs here and on every
    worker rank, with the same arguments (sent down a pipe to each: a worker waits for its next call
    however long the rollouts take). Or apart (`trainer` None, `trainer_apart`): every rank is a
    worker, rank 0 the one that trains this process's weights in shared memory (`share_weights`), and
    its results come back up `reply`; the run's process keeps its GIL for the rollouts."""
    CALLS = ("begin", "add", "finish", "step", "sft_begin", "sft_step")

    def __init__(self, trainer, comm: Gloo | None, workers: list[tuple], reply=None, version: int = 0,
                 kv=None) -> None:
        self.trainer, self.comm, self.workers, self.reply = trainer, comm, workers, reply  # workers: (process, pipe)
        self.broken = False  # a call raised here: the workers may wait in a collective that never comes
        self.kv = kv  # apart: the group's rendezvous (a TCP store), served from here
        if trainer is None:
            self.version = version  # rank 0's, as its last reply gave it

    def __getattr__(self, name: str):
        trainer = self.__dict__.get("trainer")
        if trainer is None:
            if name in self.CALLS:
                return lambda *args: self._run(name, args, self._reply)
            raise AttributeError(f"{name!r} is not reachable from the run's process: the trainer runs apart "
                                 f"(trainer_apart); it answers {', '.join(self.CALLS)}, save_checkpoint and "
                                 "load_checkpoint")
        attr = getattr(trainer, name)
        if name not in self.CALLS:
            return attr

        def call(*args):
            return self._run(name, args, lambda: attr(*args))
        return call

    def _reply(self):
        """Rank 0's result of the call sent to it (raised, if it raised)."""
        kind, out, self.version = self.reply.recv()
        if kind == "error":
            raise out
        return out

    def _run(self, name: str, args: tuple, here: Callable, everyone: bool = True):
        """`name(*args)` on every rank (`everyone`) or on rank 0 alone (here, or its worker when apart)."""
        ranks = self.workers if everyone else [] if self.trainer is not None else self.workers[:1]
        try:
            for _, pipe in ranks:
                pipe.send((name, args))
            return here()
        except BaseException as e:
            self.broken = True
            dead = self._dead(wait=2.0 if isinstance(e, (OSError, EOFError)) or "gloo" in str(e) else 0.0)
            if dead:  # (rank 0's own error is then gloo's "connection reset" or a broken pipe)
                raise RuntimeError(f"trainer process {dead.name} exited ({exit_reason(dead.exitcode)}) "
                                   f"during `{name}`; the run stops here and resumes from its last checkpoint "
                                   "(the same run_dir)") from e
            raise

    def _dead(self, wait: float):
        """A worker that has exited (given `wait` s on a broken connection: it closes before the exit)."""
        for proc, _ in self.workers:
            proc.join(timeout=wait)
            if not proc.is_alive():
                return proc
        return None

    def become(self, shared: tuple | None = None) -> DataParallelTrainer:
        """Every rank's trainer on its warm-started policy, in place of its `Rank` (rl_trainer.py)."""
        def here():
            self.trainer = self.trainer.become(shared)
        self._run("become", (shared,), self._reply if self.trainer is None else here)
        return self

    def save_checkpoint(self, path: str, extra: dict) -> None:
        """Rank 0's state (every rank holds the same) and `extra`, written by rank 0."""
        here = self._reply if self.trainer is None else lambda: self.trainer.save_checkpoint(path, extra)
        self._run("save_checkpoint", (path, extra), here, everyone=False)

    def load_checkpoint(self, path: str, state: dict | None = None) -> None:
        """A checkpoint on every rank, each loading the file itself (`state`: the file's contents,
        already loaded here), checked to be the same bits on each."""
        here = self._reply if self.trainer is None else lambda: self.trainer.load_checkpoint(path, state)
        self._run("load_checkpoint", (path,), here)
        prints = self.fingerprints()
        if len(set(prints)) > 1:
            raise RuntimeError(f"trainer ranks hold different weights after loading a checkpoint: {prints}")

    def load_state(self, state: dict) -> None:
        """A state on every rank, through a file (tensors down pipes would each hold a file descriptor)."""
        import tempfile
        with tempfile.TemporaryDirectory(prefix="rollwise-state-") as tmp:
            torch.save(state, f"{tmp}/state.pt")
            self.load_checkpoint(f"{tmp}/state.pt", state)

    def fingerprints(self) -> list[str]:
        """Each rank's trained weights (the critic's too) as a hash of their bits: equal on every rank."""
        here = self._reply if self.trainer is None else lambda: self.comm.gather(fingerprint(self.trainer))
        return self._run("fingerprints", (), here)

    def close(self) -> None:
        """Stop the workers (at once, after a call that raised), then leave the group."""
        for proc, pipe in self.workers:
            with contextlib.suppress(OSError):  # (a worker that is gone)
                if not self.broken:
                    pipe.send(None)
                pipe.close()
        for proc, _ in self.workers:
            proc.join(timeout=0 if self.broken else 30)
            if proc.is_alive():
                proc.terminate()
                proc.join()
        if self.comm is not None:
            self.comm.close()
        if self.reply is not None:
            self.reply.close()


def share_weights(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], list[tuple]]:
    """The model's parameters moved into shared memory, one buffer per dtype (each parameter becomes
    a view of it), and where each lies: a trainer apart takes them (`adopt_weights`) and updates them
    in place, so this process reads each step's weights without a copy crossing."""
    params = list(model.named_parameters())
    buffers, layout = {}, []
    for dtype in sorted({p.dtype for _, p in params}, key=str):
        mine = [(n, p) for n, p in params if p.dtype == dtype]
        flat = torch.empty(sum(p.numel() for _, p in mine), dtype=dtype).share_memory_()
        at = 0
        for n, p in mine:
            view = flat[at:at + p.numel()].view(p.shape)
            view.copy_(p.detach())
            p.data = view
            layout.append((n, str(dtype), at, tuple(p.shape)))
            at += p.numel()
        buffers[str(dtype)] = flat
    return buffers, layout


def adopt_weights(model: torch.nn.Module, shared: tuple[dict, list]) -> None:
    """`model`'s parameters (built alike) become views of the shared buffers `share_weights` made."""
    buffers, layout = shared
    params = dict(model.named_parameters())
    differ = sorted(set(params) ^ {n for n, *_ in layout})
    if differ:
        raise RuntimeError(f"the trainer's model differs from the run's in {differ}")
    for n, dtype, at, shape in layout:
        if tuple(params[n].shape) != shape:
            raise RuntimeError(f"the trainer's {n} is {tuple(params[n].shape)}, the run's {shape}")
        params[n].data = buffers[dtype][at:at + params[n].numel()].view(shape)


def start(world: int, build: Callable, args: tuple, threads: int) -> tuple[Gloo, list[tuple]]:
    """Start ranks 1..world-1, each `build(comm, *args)` -> its trainer (or a rank that `become`s one:
    rollwise.rl_trainer.Rank, which warm-starts first), then join them as rank 0: the
    caller builds its own trainer with the returned comm, broadcasts its weights (`comm.broadcast_params`)
    and wraps it in `DataParallelTrainer`. `build` must be a module-level function (spawned processes)."""
    port = free_port()
    kv = store(port, world, master=True)
    workers = [_spawn(r, world, port, build, args, threads) for r in range(1, world)]
    # the workers' arrival, watched: one that dies first fails the start at once
    _watch(workers, lambda: kv.check([f"joined/{r}" for r in range(1, world)]))
    return Gloo(0, world, kv), workers


def start_apart(world: int, build: Callable, args: tuple, threads: int, shared: tuple) -> DataParallelTrainer:
    """Start ranks 0..world-1, each `build(comm, *args)` -> its trainer (rank 0's with `shared` last:
    this process's weights, `share_weights`), and return rank 0's trainer as seen from here."""
    port = free_port()
    kv = store(port, world, master=True) if world > 1 else None  # (the group's rendezvous, held here)
    ctx = mp.get_context("spawn")
    reply, their_end = ctx.Pipe(duplex=False)
    workers = [_spawn(0, world, port, build, (*args, shared), threads, their_end)]
    their_end.close()
    workers += [_spawn(r, world, port, build, args, threads) for r in range(1, world)]
    _watch(workers, lambda: reply.poll())  # rank 0 answers once every rank has its trainer
    try:
        _, _, version = reply.recv()  # ("ok", None, its version)
    except EOFError:  # rank 0 exited
        _watch(workers, lambda: False)
    return DataParallelTrainer(None, None, workers, reply, version, kv)


def _spawn(rank: int, world: int, port: int, build: Callable, args: tuple, threads: int, reply=None) -> tuple:
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_worker, args=(rank, world, port, build, args, threads, recv, reply), daemon=True,
                       name=f"rollwise-trainer-rank{rank}")
    proc.start()
    recv.close()  # (the worker's end)
    return proc, send


def _watch(workers: list[tuple], ready: Callable[[], bool]) -> None:
    """Wait for `ready()`; a worker that dies first fails the start at once (its error is above)."""
    while not ready():
        dead = [proc for proc, _ in workers if not proc.is_alive()]
        if dead:
            for proc, _ in workers:
                proc.terminate()
            raise RuntimeError(f"trainer process {dead[0].name} exited ({exit_reason(dead[0].exitcode)}) before "
                               "joining the data-parallel group; its error is above")
        time.sleep(0.05)


def _worker(rank: int, world: int, port: int, build: Callable, args: tuple, threads: int, pipe, reply=None) -> None:
    """A worker rank: its rank (`build`), then the run's calls until it sends None or goes away. With
    `reply` (rank 0 of a trainer apart) each call's result, or its exception, goes back up it. Ctrl-C
    is the run's process's to handle: it stops the workers (or they find its pipe closed)."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    if world > 1:
        kv = store(port, world, master=False)
        kv.set(f"joined/{rank}", "1")
        comm: Comm = Gloo(rank, world, kv)
    else:
        comm = Comm()
    trainer = build(comm, *args)
    if reply is not None:
        reply.send(("ok", None, trainer.version))
    while True:
        try:
            cmd = pipe.recv()
        except EOFError:  # the run's process is gone
            break
        if cmd is None:
            break
        name, a = cmd
        try:
            if name == "become":  # (the trainer on the warm-started policy, in place of its rank)
                trainer, out = trainer.become(*a), None
            else:
                out = comm.gather(fingerprint(trainer)) if name == "fingerprints" else getattr(trainer, name)(*a)
            answer = ("ok", out, trainer.version)
        except Exception as e:  # every rank raises it (each sees the same sums); the next call goes on
            answer = ("error", _portable(e), trainer.version)
        if reply is not None:
            reply.send(answer)
    if reply is not None:
        reply.close()
    if world > 1:
        comm.close()


def _portable(e: Exception) -> Exception:
    """`e` as it can cross to the run's process: itself with its traceback as a note, or a RuntimeError
    naming it where it does not pickle."""
    import pickle
    import traceback
    e.add_note("in the trainer process:\n" + "".join(traceback.format_exception(e)).rstrip())
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}\n" + "\n".join(getattr(e, "__notes__", [])))
