"""Data-parallel training: the trainer on N processes (verl's and AReaL's data-parallel ranks; here
torch.distributed's gloo, on 127.0.0.1).

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
process group; `DataParallelTrainer` is rank 0's trainer, which hands each call on to the other
ranks, worker processes started by `start`."""
from __future__ import annotations

import contextlib
import hashlib
import multiprocessing as mp
import time
from datetime import timedelta
from typing import Any, Callable

import torch

from rollwise.serve.process import free_port


class Comm:
    """One process: rank 0 of 1."""
    rank, world = 0, 1

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def gather(self, obj: Any) -> list:
        return [obj]

    def grads(self, params) -> None:
        """Each parameter's gradient summed over the ranks (None where no rank has one)."""

    def shard(self, groups: list, loads: list[float]) -> list:
        """The groups this rank trains (`loads`: each rank's generated tokens so far this step)."""
        return groups


TIMEOUT = timedelta(seconds=1800)  # a collective's wait for the other ranks (their share of a step)


def store(port: int, world: int, master: bool):
    """The group's rendezvous: a TCP store on 127.0.0.1 (rank 0's)."""
    import torch.distributed as dist
    return dist.TCPStore("127.0.0.1", port, world, is_master=master, wait_for_workers=False, timeout=TIMEOUT)


class Gloo(Comm):
    def __init__(self, rank: int, world: int, kv) -> None:
        import torch.distributed as dist
        self.dist, self.rank, self.world = dist, rank, world
        dist.init_process_group("gloo", store=kv, rank=rank, world_size=world, timeout=TIMEOUT)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        self.dist.all_reduce(t)
        return t

    def gather(self, obj: Any) -> list:
        out: list = [None] * self.world
        self.dist.all_gather_object(out, obj)
        return out

    def grads(self, params) -> None:
        params = list(params)
        has = torch.tensor([float(p.grad is not None) for p in params])
        flat = torch.cat([has] + [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                                  for p in params])
        self.dist.all_reduce(flat)
        k = len(params)
        for i, p in enumerate(params):
            g = flat[k:k + p.numel()].view_as(p)
            k += p.numel()
            if flat[i] > 0:
                p.grad = g.clone() if p.grad is None else p.grad.copy_(g)

    def shard(self, groups: list, loads: list[float]) -> list:
        """Largest group first onto the least-loaded rank (every rank computes the same placement)."""
        mine = set()
        for i in sorted(range(len(groups)), key=lambda i: -generated(groups[i])):
            r = min(range(self.world), key=lambda r: (loads[r], r))
            loads[r] += max(generated(groups[i]), 1)
            if r == self.rank:
                mine.add(i)
        return [g for i, g in enumerate(groups) if i in mine]  # in their order

    def broadcast_params(self, module: torch.nn.Module) -> None:
        for t in list(module.state_dict().values()):
            if t.is_floating_point():
                self.dist.broadcast(t, src=0)

    def close(self) -> None:
        self.dist.destroy_process_group()


def fingerprint(trainer) -> str:
    h = hashlib.sha256()
    for p in [*trainer.policy.parameters(), *(trainer.critic.parameters() if trainer.critic is not None else [])]:
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        import signal
        name = signal.Signals(-code).name
        return f"{name}" + (": out of memory?" if -code == signal.SIGKILL else "")
    return f"exit code {code}"


def generated(group: list) -> int:
    return sum(t.num_generated for t in group)


class DataParallelTrainer:
    """Rank 0's trainer: each call runs here and on every worker rank, with the same arguments (sent
    down a pipe to each: a worker waits for its next call however long the rollouts take)."""
    CALLS = ("begin", "add", "finish", "step")

    def __init__(self, trainer, comm: Gloo, workers: list[tuple]) -> None:
        self.trainer, self.comm, self.workers = trainer, comm, workers  # workers: (process, pipe)
        self.broken = False  # a call raised here: the workers may wait in a collective that never comes

    def __getattr__(self, name: str):
        attr = getattr(self.trainer, name)
        if name not in self.CALLS:
            return attr

        def call(*args):
            return self._run(name, args, lambda: attr(*args))
        return call

    def _run(self, name: str, args: tuple, here: Callable):
        try:
            for _, pipe in self.workers:
                pipe.send((name, args))
            return here()
        except BaseException as e:
            self.broken = True
            dead = self._dead(wait=2.0 if isinstance(e, OSError) or "gloo" in str(e) else 0.0)
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

    def load_state(self, state: dict) -> None:
        """A checkpoint's state on every rank (sent from here), checked to be the same bits on each."""
        self._run("load_state", (state,), lambda: self.trainer.load_state(state))
        prints = self.fingerprints()
        if len(set(prints)) > 1:
            raise RuntimeError(f"trainer ranks hold different weights after loading a checkpoint: {prints}")

    def fingerprints(self) -> list[str]:
        """Each rank's trained weights (the critic's too) as a hash of their bits: equal on every rank."""
        return self._run("fingerprints", (), lambda: self.comm.gather(fingerprint(self.trainer)))

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
        self.comm.close()


def start(world: int, build: Callable, args: tuple, threads: int) -> tuple[Gloo, list[tuple]]:
    """Start ranks 1..world-1, each `build(comm, *args)` -> its trainer, then join them as rank 0: the
    caller builds its own trainer with the returned comm, broadcasts its weights (`comm.broadcast_params`)
    and wraps it in `DataParallelTrainer`. `build` must be a module-level function (spawned processes)."""
    port = free_port()
    kv = store(port, world, master=True)
    ctx = mp.get_context("spawn")
    workers = []
    for r in range(1, world):
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_worker, args=(r, world, port, build, args, threads, recv), daemon=True,
                           name=f"rollwise-trainer-rank{r}")
        proc.start()
        recv.close()  # (the worker's end)
        workers.append((proc, send))
    # the workers' arrival, watched: one that dies first fails the start at once
    while not kv.check([f"joined/{r}" for r in range(1, world)]):
        dead = [proc for proc, _ in workers if not proc.is_alive()]
        if dead:
            for proc, _ in workers:
                proc.terminate()
            raise RuntimeError(f"trainer process {dead[0].name} exited ({dead[0].exitcode}) before joining the "
                               "data-parallel group; its error is above")
        time.sleep(0.05)
    return Gloo(0, world, kv), workers


def _worker(rank: int, world: int, port: int, build: Callable, args: tuple, threads: int, pipe) -> None:
    """A worker rank: its trainer, then rank 0's calls until it sends None or goes away."""
    torch.set_num_threads(threads)
    kv = store(port, world, master=False)
    kv.set(f"joined/{rank}", "1")
    comm = Gloo(rank, world, kv)
    trainer = build(comm, *args)
    while True:
        try:
            cmd = pipe.recv()
        except EOFError:  # rank 0 is gone
            break
        if cmd is None:
            break
        name, a = cmd
        if name == "fingerprints":
            comm.gather(fingerprint(trainer))
            continue
        try:
            getattr(trainer, name)(*a)
        except Exception:  # rank 0 raises it too (every rank sees the same sums); the next call goes on
            pass
    comm.close()
