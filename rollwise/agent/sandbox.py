"""Running model-written code: every run is a fresh subprocess (a Python program, or a shell command
line) in a temporary directory of its own or a given workspace, with a wall-clock deadline,
CPU-time, memory, file-size and open-file limits, no network (its own network namespace, where the
kernel allows one), a clean environment, output capped, and its whole process group killed when it
ends, times out or its caller is cancelled (an episode's deadline), so nothing it started outlives
it.

    sandbox = Sandbox(timeout_s=5, memory_mb=512)
    result = await sandbox.run("print(sum(range(10)))")   # result.stdout == "45\n", result.ok
    result = await sandbox.shell("python test_calc.py", cwd=workspace_dir)
    tool = sandbox.tool()                                   # a `python(code)` tool for an environment

The limits are per process (rlimits) and, where this process may make cgroups, on the run as a
whole (`max_processes`, `memory_mb`: rollwise.agent.cgroups; a fork loop, or children each under
the per-process limit), not a container: enough for an RL model's own mistakes (infinite loops,
memory blow-ups, runaway output or processes, stray files, network calls), not a boundary against
hostile code; run the replicas' tool workers in a container for that.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

from rollwise.agent.cgroups import RunGroup
from rollwise.agent.tools import Tool

NETWORK = ("auto", "deny", "allow")  # auto: isolated where the kernel allows; deny: refuse to run otherwise
_CHILD = Path(__file__).with_name("sandbox_child.py")
_SLOTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> {limit: semaphore}


@dataclass(slots=True)
class RunResult:
    stdout: str
    stderr: str
    exit_code: int | None  # None: killed at the deadline; negative: ended by that signal
    timed_out: bool
    seconds: float
    truncated: bool  # stdout or stderr went past max_output (the rest was read and dropped)
    network_isolated: bool
    bounded: bool = False  # the whole run held to max_processes and memory_mb (cgroups), not each process alone
    out_of_memory: bool = False  # the kernel killed a process of the run at the run's memory bound

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def observation(self) -> str:
        """What the model reads: the output, and the error or limit that ended the program, if any."""
        parts = [self.stdout.rstrip("\n")] if self.stdout.strip() else []
        if self.stderr.strip():
            parts.append("stderr:\n" + self.stderr.rstrip("\n"))
        if self.timed_out:
            parts.append(f"error: timed out after {self.seconds:.1f} s (killed)")
        elif self.out_of_memory:
            parts.append("error: memory limit exceeded (killed)")
        elif self.exit_code == -signal.SIGXCPU:
            parts.append("error: CPU time limit exceeded (killed)")
        elif self.exit_code == -signal.SIGXFSZ:
            parts.append("error: file size limit exceeded (killed)")
        elif self.exit_code:
            parts.append(f"exit code {self.exit_code}")
        if self.truncated:
            parts.append("(output truncated)")
        return "\n".join(parts) if parts else "(no output)"


class Sandbox:
    def __init__(self, *, timeout_s: float = 5.0, cpu_s: int | None = None, memory_mb: int = 1024,
                 file_mb: int = 16, open_files: int = 64, max_output: int = 8192, network: str = "auto",
                 max_concurrent: int | None = None, max_processes: int = 64, python: str = sys.executable) -> None:
        if network not in NETWORK:
            raise ValueError(f"unknown network setting {network!r}; valid: {list(NETWORK)}")
        if timeout_s <= 0 or memory_mb < 32 or file_mb < 0 or open_files < 8 or max_output < 1 or max_processes < 1:
            raise ValueError("need timeout_s > 0, memory_mb >= 32, file_mb >= 0, open_files >= 8, max_output >= 1 "
                             f"and max_processes >= 1; got {timeout_s}, {memory_mb}, {file_mb}, {open_files}, "
                             f"{max_output}, {max_processes}")
        self.timeout_s, self.memory_mb, self.file_mb = timeout_s, memory_mb, file_mb
        self.cpu_s = cpu_s if cpu_s is not None else max(1, int(timeout_s + 0.999))
        self.open_files, self.max_output, self.network, self.python = open_files, max_output, network, python
        self.max_processes = max_processes
        # runs at once, over every Sandbox with this limit on the event loop (default: the cores)
        self.max_concurrent = max_concurrent or os.cpu_count() or 1

    def _slot(self) -> asyncio.Semaphore:
        per_loop = _SLOTS.setdefault(asyncio.get_running_loop(), {})
        return per_loop.setdefault(self.max_concurrent, asyncio.Semaphore(self.max_concurrent))

    async def run(self, code: str, stdin: str = "", *, cwd: str | Path | None = None) -> RunResult:
        """Run a Python program, in `cwd` (a workspace that outlives the run) or else in a fresh
        temporary directory removed afterwards."""
        return await self._exec({"python": code}, stdin, cwd)

    async def shell(self, command: str, stdin: str = "", *, cwd: str | Path | None = None) -> RunResult:
        """Run a shell command line (`/bin/sh -c`) under the same limits, in `cwd` or a fresh directory."""
        return await self._exec({"shell": command}, stdin, cwd)

    async def _exec(self, what: dict, stdin: str, cwd: str | Path | None) -> RunResult:
        async with self._slot():
            private = Path(tempfile.mkdtemp(prefix="rollwise-sandbox-"))  # HOME, TMPDIR and the program file
            try:
                if "python" in what:
                    (private / "main.py").write_text(what.pop("python"), encoding="utf-8")
                    what["program"] = str(private / "main.py")
                return await self._run(what, stdin, Path(cwd) if cwd is not None else private, private)
            finally:
                shutil.rmtree(private, ignore_errors=True)

    async def _run(self, what: dict, stdin: str, work: Path, private: Path) -> RunResult:
        limits = {"cpu_s": self.cpu_s, "memory_mb": self.memory_mb, "file_mb": self.file_mb,
                  "open_files": self.open_files, "network": self.network, **what}
        if "program" in what and self.python == sys.executable:  # (another interpreter runs its own `site`)
            limits["path"] = [p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages")]
        path = os.pathsep.join([os.path.dirname(self.python), os.defpath])  # `python` is the sandbox's Python
        env = {"PATH": path, "HOME": str(private), "TMPDIR": str(private), "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MPLBACKEND": "Agg",
               "PYTHONDONTWRITEBYTECODE": "1"}  # no stale .pyc when a file is edited within the second
        status_r, status_w = os.pipe()
        try:
            return await self._spawn(work, limits, env, stdin, status_r, status_w)
        finally:
            os.close(status_r)

    async def _spawn(self, work: Path, limits: dict, env: dict, stdin: str, status_r: int, status_w: int) -> RunResult:
        t0 = time.perf_counter()
        group = RunGroup.make(self.max_processes, self.memory_mb)
        if group is not None:  # the child waits to be moved into it before the program starts
            limits = {**limits, "cgroup": [group.name, len(group.dirs)]}
        try:
            # without `site` Python starts several times faster (most of a start is .pth processing): a
            # shell command's launcher needs no packages, and a program under this same interpreter
            # gets its site-packages directories on sys.path directly
            flags = ["-I", "-S"] if "shell" in limits or "path" in limits else ["-I"]
            proc = await asyncio.create_subprocess_exec(
                self.python, *flags, str(_CHILD), json.dumps(limits), str(status_w), cwd=work, env=env,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                pass_fds=(status_w,), start_new_session=True)
        except BaseException:
            if group is not None:
                group.close()
            raise
        finally:
            os.close(status_w)
        moved = None if group is None else asyncio.get_running_loop().run_in_executor(None, group.add, proc.pid)
        readers = [asyncio.ensure_future(_read_capped(s, self.max_output)) for s in (proc.stdout, proc.stderr)]
        feeder = asyncio.ensure_future(_feed(proc.stdin, stdin.encode()))
        timed_out = False
        try:
            await asyncio.wait_for(_exited(proc), self.timeout_s)
        except asyncio.TimeoutError:
            timed_out = True
        finally:  # also on cancellation: nothing the program started outlives it
            _kill_group(proc.pid)
            oom = False
            if group is not None:
                oom = group.out_of_memory()
                await asyncio.shield(moved)  # (a move under way ends first)
                group.close()  # (what left the process group too)
            # a process that left the group may still hold the pipes: give them a moment, then stop reading
            done, pending = await asyncio.wait([asyncio.ensure_future(proc.wait()), *readers, feeder], timeout=1.0)
            for task in pending:
                task.cancel()
        seconds = time.perf_counter() - t0
        (out, cut_out), (err, cut_err) = [r.result() if r in done else (b"", False) for r in readers]
        status = json.loads(os.read(status_r, 4096) or b"{}")
        return RunResult(out.decode("utf-8", "replace"), err.decode("utf-8", "replace"),
                         None if timed_out else proc.returncode, timed_out, seconds, cut_out or cut_err,
                         bool(status.get("network_isolated")), bool(status.get("bounded")), oom)

    def tool(self, name: str = "python") -> Tool:
        """A tool that runs the model's program here and returns `RunResult.observation()`. Its only
        deadline is the sandbox's, which starts when the program does: a call that waits for a free
        slot (many episodes, few cores) is not timed out for it, which would punish the policy for
        the machine's load. The episode's deadline still bounds the wait."""
        async def python(code: str) -> str:
            """Run a Python 3 program and return what it prints (stdout, then any error). Use print() to show results."""
            return (await self.run(code)).observation()
        return Tool(python, name=name, timeout=None, pure=True)  # (a fresh process each run)


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> tuple[bytes, bool]:
    """Everything the stream gives, keeping the first `cap` bytes (the rest is read and dropped, so
    a program printing without end never blocks on a full pipe or fills our memory)."""
    kept, cut = bytearray(), False
    while chunk := await stream.read(65536):
        room = cap - len(kept)
        kept += chunk[:max(room, 0)]
        cut = cut or len(chunk) > room
    return bytes(kept), cut


async def _feed(stdin: asyncio.StreamWriter, data: bytes) -> None:
    try:
        if data:
            stdin.write(data)
            await stdin.drain()
        stdin.close()
    except (BrokenPipeError, ConnectionResetError):  # the program did not read it all
        pass


async def _exited(proc: asyncio.subprocess.Process) -> None:
    """When the program's own process ends. `proc.wait()` also waits for its pipes to close, which a
    process it left running in the background holds; a pidfd becomes readable at the exit itself."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # no pidfd (old kernel), or already gone
        await proc.wait()
        return
    loop = asyncio.get_running_loop()
    gone = loop.create_future()
    loop.add_reader(fd, lambda: gone.done() or gone.set_result(None))
    try:
        await gone
    finally:
        loop.remove_reader(fd)
        os.close(fd)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
