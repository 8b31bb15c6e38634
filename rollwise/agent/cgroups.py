"""A sandbox run's processes in control groups of their own, where this process may make them (root,
or a cgroup delegated to it): at most `max_processes` processes and threads, and `memory_mb` of
memory, for the program and everything it starts together. The rlimits bound each process alone:
a loop of forks, or many children each under the limit, can still take the machine's memory or
process table down with the training run. cgroup v2 where our cgroup's children get the pids and
memory controllers, else v1's pids and memory hierarchies; neither (no permission, no
controllers): `RunGroup.make` gives None, and the rlimits alone apply. Swap counts against
`memory_mb` where the kernel accounts it (v2 memory.swap.max 0; v1 memsw and swappiness 0): a run
past its bound is killed rather than swapped out.

The sandbox moves the run's child into the groups while the child starts, and the child waits
until it is in them (sandbox_child.joined) before the program runs, so nothing forks outside
them; `close()` kills what is left in them and removes them, and a process's first group sweeps
away those of processes that died without closing theirs (`sweep`).
"""
from __future__ import annotations

import os
import secrets
import signal
import time
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
PREFIX = "rollwise-sandbox-"  # a run's group: PREFIX + "{pid namespace}-{pid}-{random}"
_USABLE: list[tuple[str, list[Path]]] | None = None  # where groups were made (or [] if nowhere): tried once


def _own() -> dict[str, str]:
    """Our cgroup per hierarchy, from /proc/self/cgroup: {"": v2 path, "pids": ..., "memory": ...}."""
    out = {}
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        _, names, path = line.split(":", 2)
        for name in names.split(",") if names else [""]:
            out[name] = path
    return out


def _candidates() -> list[tuple[str, list[Path]]]:
    """Where a run's groups could go: ("v2", [dir]) and ("v1", [pids dir, memory dir])."""
    own, found = _own(), []
    if "" in own:  # the unified hierarchy: mounted at the root (v2 only) or at unified/ (hybrid)
        for mount in (ROOT, ROOT / "unified"):
            if (mount / "cgroup.controllers").exists():
                found.append(("v2", [mount / own[""].lstrip("/")]))
                break
    if "pids" in own and "memory" in own:
        found.append(("v1", [ROOT / "pids" / own["pids"].lstrip("/"), ROOT / "memory" / own["memory"].lstrip("/")]))
    return found


class RunGroup:
    def __init__(self, dirs: list[Path], version: str, swap_bounded: bool = True) -> None:
        self.dirs, self.version = dirs, version
        self.swap_bounded = swap_bounded  # False: past memory_mb the run's memory goes to swap, not to the OOM killer

    @classmethod
    def make(cls, max_processes: int, memory_mb: int) -> RunGroup | None:
        """New groups bounding a run, or None where none can be made here (tried once a process)."""
        global _USABLE
        name = f"{PREFIX}{_namespace()}-{os.getpid()}-{secrets.token_hex(4)}"
        for version, parents in _candidates() if _USABLE is None else _USABLE:
            made: list[Path] = []
            try:
                for parent in parents:
                    (parent / name).mkdir()
                    made.append(parent / name)
                (made[0] / "pids.max").write_text(str(max_processes))
                if version == "v2":
                    (made[0] / "memory.max").write_text(str(memory_mb << 20))
                    swap = _try_write(made[0] / "memory.swap.max", "0")
                else:  # (memsw after the memory limit: the kernel wants it no lower)
                    (made[1] / "memory.limit_in_bytes").write_text(str(memory_mb << 20))
                    swap = _try_write(made[1] / "memory.memsw.limit_in_bytes", str(memory_mb << 20))
                    swap = _try_write(made[1] / "memory.swappiness", "0") or swap
                if _USABLE is None:
                    _USABLE = [(version, parents)]
                    sweep(parents)
                return cls(made, version, swap_bounded=swap or not _swapping())
            except OSError:  # no permission, or the controllers are not ours to use here
                for d in made:
                    _remove(d)
        if _USABLE is None:  # (nowhere on the first try: not again; a later failure is that run's alone)
            _USABLE = []
        return None

    @property
    def name(self) -> str:
        return self.dirs[0].name

    def add(self, pid: int) -> bool:
        """Move a process into the groups (before it forks: the run's child waits for it).
        A move can take ~10 ms in the kernel: the sandbox makes it from a thread while the child starts."""
        try:
            for d in self.dirs:
                (d / "cgroup.procs").write_text(str(pid))
        except OSError:
            return False
        return True

    def out_of_memory(self) -> bool:
        """Whether the kernel killed a process of the run for the memory bound."""
        d = self.dirs[-1]
        try:
            text = (d / ("memory.events" if self.version == "v2" else "memory.oom_control")).read_text()
        except OSError:
            return False
        counts = dict(line.split() for line in text.splitlines() if len(line.split()) == 2)
        return int(counts.get("oom_kill", 0)) > 0

    def close(self) -> None:
        """Kill whatever is left in the groups (a process that left the process group too), then remove them."""
        for _ in range(50):
            pids = {int(p) for d in self.dirs for p in _read(d / "cgroup.procs").split()}
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.002)
        for d in self.dirs:
            _remove(d)


def sweep(parents: list[Path]) -> int:
    """Remove the groups a process of this pid namespace left when it died without closing them (SIGKILL,
    the OOM killer), killing what still runs in them: a program that sleeps would outlive it for good.
    Another namespace's groups are left alone (its pids are not ours to read). Returns how many."""
    ns, n = _namespace(), 0
    for parent in parents if ns != "0" else []:  # (no namespace to tell ours by: none swept)
        for d in parent.glob(PREFIX + "*"):
            parts = d.name.removeprefix(PREFIX).split("-")
            if len(parts) == 3 and parts[0] == ns and parts[1].isdigit() and not _alive(int(parts[1])):
                RunGroup([d], "").close()
                n += not d.exists()
    return n


def _namespace() -> str:
    """This process's pid namespace, by its inode ("0" where /proc does not say)."""
    try:
        return os.readlink("/proc/self/ns/pid").split("[")[1].rstrip("]")
    except (OSError, IndexError):
        return "0"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _try_write(path: Path, text: str) -> bool:
    try:
        path.write_text(text)
    except OSError:  # (no swap accounting in this kernel, or not ours to set)
        return False
    return True


def _swapping() -> bool:
    """Whether this machine has swap on (/proc/swaps lists a device past its header)."""
    return len(_read(Path("/proc/swaps")).splitlines()) > 1


def _remove(d: Path) -> None:
    for _ in range(50):  # (a killed process leaves its cgroup a moment after it is reaped)
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.002)

