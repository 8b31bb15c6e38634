"""Where each live trajectory lives: the replica of its last turn (its context is there), and how
many live on each replica. One structure, so the counts cannot drift from the map: the router,
benchmarks and tests that set a trajectory's home all go through `__setitem__`."""
from __future__ import annotations

from collections import Counter


class Homes:
    def __init__(self) -> None:
        self._home: dict[str, str] = {}  # trajectory -> replica of its last turn
        self._count: Counter[str] = Counter()  # replica -> trajectories living there

    def __setitem__(self, tid: str, name: str) -> None:
        old = self._home.get(tid)
        if old != name:
            self._count[name] += 1
            if old is not None:
                self._count[old] -= 1
        self._home[tid] = name

    def get(self, tid: str) -> str | None:
        return self._home.get(tid)

    def pop(self, tid: str) -> str | None:
        """The trajectory ended: forget it (its former replica, if it had one)."""
        name = self._home.pop(tid, None)
        if name is not None:
            self._count[name] -= 1
        return name

    def drop_replica(self, name: str) -> None:
        """The replica left: its trajectories have no home any more."""
        self._home = {t: r for t, r in self._home.items() if r != name}
        self._count.pop(name, None)

    def count(self, name: str) -> int:
        return self._count[name]

    def __contains__(self, tid: str) -> bool:
        return tid in self._home

    def __len__(self) -> int:
        return len(self._home)

    def values(self):
        return self._home.values()
