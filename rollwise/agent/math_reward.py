"""The `math` reward: is the answer's final expression (its last `\\boxed{...}` first) equal to the
task's, as mathematics rather than as text (`\\frac{1}{2}` = `0.5`, `x = 3` = `3`, sets, intervals,
matrices)? The comparison is Hugging Face's math-verify (`pip install 'rollwise[math]'`), the
verifier of Open-R1 and of verl's math recipes.

A model's answer can make a symbolic comparison run for ever (`9^{9^{9^9}}`), and math-verify's own
timeouts use SIGALRM, which works only in a process's main thread. So every comparison runs in a
small pool of worker processes, where it has the main thread, under math-verify's timeouts and
under a deadline of ours: a comparison past the deadline scores 0.0 and its pool is replaced, so
a stuck worker holds up no other episode.
"""
from __future__ import annotations

import asyncio
import importlib
import logging
import multiprocessing
import os
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from rollwise.agent.env import loop_shared


def check_installed() -> None:
    try:
        importlib.import_module("math_verify")
    except ImportError as e:
        raise ValueError("reward = 'math' needs math-verify: pip install 'rollwise[math]'") from e


def equivalent(want: str, answer: str, timeout_s: int = 5) -> bool:
    """math-verify's verdict on `answer` against `want` (run in a worker process's main thread)."""
    from math_verify import parse, verify
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # a comparison that times out is a 0, not news
    want = str(want)
    gold = parse(want if "$" in want or "\\boxed" in want else f"${want}$", parsing_timeout=timeout_s)
    pred = parse(answer, parsing_timeout=timeout_s)
    return bool(gold and pred and verify(gold, pred, timeout_seconds=timeout_s))


def _warm() -> None:
    importlib.import_module("math_verify")  # before the first deadline runs


class MathVerifier:
    """Comparisons in `workers` processes (started together on first use, `spawn`ed so that no torch
    or event-loop state is forked), each under `timeout_s`. More workers than cores by default:
    math-verify's timeout is a wall-clock alarm, so comparisons that run to it share the cores and
    the normal answers go between them (on 2 cores, 8 workers score a step with 10% such answers
    6.6x faster than the loop's thread does, 2 workers 1.9x: benchmarks/math_reward.py); each
    worker costs about 65 MB."""

    _shared: dict[float, MathVerifier] = {}
    _lock = threading.Lock()

    def __init__(self, timeout_s: float = 5.0, workers: int | None = None) -> None:
        if not timeout_s > 0:
            raise ValueError(f"math timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.workers = workers or max(8, min(16, os.cpu_count() or 1))
        self._pool: ProcessPoolExecutor | None = None
        self._ready = None
        self.timeouts = 0  # comparisons cut off at the deadline

    @classmethod
    def shared(cls, timeout_s: float = 5.0) -> MathVerifier:
        """One pool per process and setting, whatever the env instances and event loops."""
        with cls._lock:
            if timeout_s not in cls._shared:
                cls._shared[timeout_s] = cls(timeout_s)
            return cls._shared[timeout_s]

    def _get_pool(self):
        """The pool, and futures that are done once its workers have started and imported math-verify
        (one warm-up call each: the pool starts a process for every call it cannot hand to an idle one)."""
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"))
                self._ready = [self._pool.submit(_warm) for _ in range(self.workers)]
            return self._pool, self._ready

    def _replace(self, pool: ProcessPoolExecutor) -> None:
        """Drop a pool whose worker is stuck or dead; the next call makes one. Its processes are
        killed: other comparisons running there fail with BrokenProcessPool and are run again."""
        with self._lock:
            if self._pool is pool:
                self._pool = None
        for p in list((getattr(pool, "_processes", None) or {}).values()):
            p.kill()
        pool.shutdown(wait=False)

    async def run(self, fn, *args, deadline_s: float | None = None):
        """`fn(*args)` in a worker: TimeoutError when it runs past the deadline (by default, past
        math-verify's own timeouts, `3 * timeout_s`, and 5 s more), and the pool is then replaced.
        At most `workers` calls of one event loop are in the pool at once, so the deadline counts
        running time, not time waiting behind other episodes' comparisons."""
        async with loop_shared(("math-verify", id(self)), lambda: asyncio.Semaphore(self.workers)):
            for attempt in range(2):
                pool, ready = self._get_pool()
                started = False
                try:
                    await asyncio.wait_for(asyncio.gather(*map(asyncio.wrap_future, ready)), 120)  # workers start
                    started = True
                    fut = asyncio.wrap_future(pool.submit(fn, *args))
                    return await asyncio.wait_for(fut, deadline_s or 3 * self.timeout_s + 5)
                except asyncio.TimeoutError:
                    self._replace(pool)
                    if not started:  # not the answer's doing: the episode fails (and is run again)
                        raise RuntimeError("math-verify's worker processes did not start within 120 s") from None
                    self.timeouts += 1
                    raise
                except (BrokenProcessPool, RuntimeError):  # a worker died (killed, out of memory), or another
                    self._replace(pool)                     # call replaced the pool: once more on a fresh one
                    if attempt:
                        raise
        raise AssertionError("unreachable")

    async def score(self, want, answer: str) -> float:
        """1.0 when the answer equals `want` (or one of a list of them) as mathematics; 0.0 when not,
        or when the comparison outlived its deadline."""
        wants = want if isinstance(want, (list, tuple)) else [want]
        for w in wants:
            try:
                if await self.run(equivalent, str(w), answer, max(1, round(self.timeout_s))):
                    return 1.0
            except asyncio.TimeoutError:
                continue
        return 0.0

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
