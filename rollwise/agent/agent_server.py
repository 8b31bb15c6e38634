"""Agent programs that stay up: one long-lived process (or a few) runs every episode's agent,
instead of a process started per episode (`env_options = { command = [...], serve = true }`).
A program pays its start (an interpreter, the openai SDK: ~0.5 s of CPU for Python here) once.

The protocol is JSON lines. rollwise writes one line per episode to the program's stdin:

    {"id": "3f2a...", "task": {...}, "base_url": "http://127.0.0.1:PORT/v1", "api_key": "..."}

and the program answers, whenever that episode's agent is done, with one line on stdout:

    {"id": "3f2a...", "reward": 1.0}        or        {"id": "3f2a...", "error": "why"}

Episodes arrive while others run: the program runs them concurrently (or queues them). Each
episode has its own key (it stops working when the episode ends); the base URL is also in
OPENAI_BASE_URL. When an episode ends before its answer (a turn limit, its deadline) rollwise
writes `{"id": "3f2a...", "cancel": true}`; the program may stop that agent (its requests fail
from then on anyway). Other stdout lines are ignored, so use stderr for logs. A program that exits
fails the episodes it had (their status `error`, with its stderr's tail; the training run reruns
them) and is started again for the next. Processes run in process groups of their own and are
killed, with their children, when the event loop that started them ends or the interpreter exits.
"""
from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import json
import os
import secrets
import signal

from rollwise.agent.env import loop_shared

_GROUPS: set[int] = set()  # process groups to kill at exit (a loop that never ended cleanly)


@atexit.register
def _kill_all() -> None:
    for pgid in list(_GROUPS):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


class _Process:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.ids: set[str] = set()  # episodes it has not answered
        self.stderr: collections.deque[str] = collections.deque(maxlen=20)
        self.readers: list[asyncio.Task] = []


class AgentServer:
    """The processes that serve one command's episodes on one event loop (`shared`)."""

    def __init__(self, command: list[str], processes: int = 1) -> None:
        if processes < 1:
            raise ValueError(f"processes must be >= 1, got {processes}")
        self.command, self.slots = command, [None] * processes
        self.pending: dict[str, asyncio.Future] = {}
        self.stats = {"started": 0, "episodes": 0, "exits": 0}
        self._lock = asyncio.Lock()
        self._task = asyncio.create_task(self._held())

    @classmethod
    def shared(cls, command: list[str], processes: int = 1) -> AgentServer:
        return loop_shared(("agent_server", tuple(command), processes), lambda: cls(command, processes))

    async def run(self, base_url: str, api_key: str, task: dict) -> float:
        """One episode's agent: its line to the least busy process; its reward when it answers."""
        async with self._lock:  # (one start at a time)
            p = await self._process(base_url)
        eid = secrets.token_hex(8)
        fut = asyncio.get_running_loop().create_future()
        self.pending[eid] = fut
        p.ids.add(eid)
        self.stats["episodes"] += 1
        try:
            await self._send(p, {"id": eid, "task": task, "base_url": base_url, "api_key": api_key}, fut)
            return await fut
        except asyncio.CancelledError:
            if eid in p.ids:
                with contextlib.suppress(Exception):
                    await self._send(p, {"id": eid, "cancel": True})
            raise
        finally:
            self.pending.pop(eid, None)
            p.ids.discard(eid)

    async def _process(self, base_url: str) -> _Process:
        for i, p in enumerate(self.slots):
            if p is None or p.proc.returncode is not None:
                self.slots[i] = await self._start(base_url)
        return min(self.slots, key=lambda p: len(p.ids))

    async def _start(self, base_url: str) -> _Process:
        proc = await asyncio.create_subprocess_exec(
            *self.command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env={**os.environ, "OPENAI_BASE_URL": base_url},
            start_new_session=True, limit=1 << 24)
        _GROUPS.add(proc.pid)
        self.stats["started"] += 1
        p = _Process(proc)
        p.readers = [asyncio.create_task(self._read(p)), asyncio.create_task(self._read_stderr(p))]
        return p

    async def _send(self, p: _Process, msg: dict, fut: asyncio.Future | None = None) -> None:
        try:
            p.proc.stdin.write(json.dumps(msg).encode() + b"\n")
            await p.proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as e:  # it died: its reader fails its episodes
            await asyncio.gather(p.readers[0], return_exceptions=True)
            if fut is not None and not fut.done():
                fut.set_exception(RuntimeError(f"the agent server {self.command[0]!r} is gone: {e}"))

    async def _read(self, p: _Process) -> None:
        async for line in p.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue  # not a protocol line
            fut = self.pending.get(msg.get("id")) if isinstance(msg, dict) else None
            if fut is None or fut.done():
                continue
            p.ids.discard(msg["id"])
            if "error" in msg:
                fut.set_exception(RuntimeError(f"the agent server reported an error: {str(msg['error'])[:800]}"))
            elif isinstance(msg.get("reward"), (int, float)) and not isinstance(msg.get("reward"), bool):
                fut.set_result(float(msg["reward"]))
            else:
                fut.set_exception(TypeError(f"the agent server's answer has no number 'reward': {line[:200]!r}"))
        rc = await p.proc.wait()
        await asyncio.gather(p.readers[1], return_exceptions=True)
        _GROUPS.discard(p.proc.pid)
        self.stats["exits"] += 1
        why = RuntimeError(f"the agent server {self.command[0]!r} exited with status {rc}: "
                           + " | ".join(p.stderr)[-800:])
        for eid in list(p.ids):
            fut = self.pending.get(eid)
            if fut is not None and not fut.done():
                fut.set_exception(why)

    async def _read_stderr(self, p: _Process) -> None:
        async for line in p.proc.stderr:
            p.stderr.append(line.decode(errors="replace").rstrip())

    async def _held(self) -> None:
        """Lives as long as the loop; when the loop ends, the processes and their children go too."""
        try:
            await asyncio.Event().wait()
        finally:
            for p in self.slots:
                if p is not None:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(p.proc.pid, signal.SIGKILL)
                    _GROUPS.discard(p.proc.pid)
