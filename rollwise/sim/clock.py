"""An asyncio event loop on virtual time: when nothing is ready to run, the clock jumps to the next
timer instead of waiting for it. Coroutines written for real time (the router, its health and load
loops, tool latency sleeps) run unchanged, as fast as the CPU allows, and `loop.time()` is
simulated seconds. Nothing here may wait on real I/O: a loop with no timers and nothing ready is a
deadlock and raises."""
from __future__ import annotations

import asyncio
import selectors


class _VirtualSelector(selectors.DefaultSelector):
    def __init__(self) -> None:
        super().__init__()
        self.loop: VirtualClockLoop | None = None
        self.passes = 0

    def select(self, timeout: float | None = None):
        # The loop's own wake-up pipe only (signals); never block. With callbacks ready (timeout 0)
        # only every 64th pass polls it: a system call per pass is a good part of a large run.
        self.passes += 1
        events = super().select(0) if timeout != 0 or self.passes % 64 == 0 else []
        if events or timeout == 0:
            return events
        if timeout is None:
            raise RuntimeError("simulation deadlock: nothing is scheduled and nothing can wake the loop")
        self.loop._now += max(timeout, 0.0)
        return []


class VirtualClockLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        sel = _VirtualSelector()
        super().__init__(sel)
        sel.loop = self
        self._now = 0.0
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self._now


def run(coro):
    """asyncio.run on a fresh virtual-time loop."""
    with asyncio.Runner(loop_factory=VirtualClockLoop) as runner:
        return runner.run(coro)
