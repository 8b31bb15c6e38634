"""KV residency: thrashing control for agentic turns. When the live contexts exceed a replica's KV
pool, every context is evicted during its tool calls and recomputed at its next turn. Instead, the
trajectories whose contexts fit `fraction` of the pool keep it ("active" residents, oldest first);
turns of the others wait (held) until one ends, or run on another replica with room for their
whole context. An active resident may move too, where the policy finds its home too crowded
(residency does not pin a trajectory to a busier replica than its cost says). A new trajectory is
admitted only where every resident is active and its prompt fits with everyone's expected growth
(contexts grow by a response and a tool output every turn; admitting by today's sizes alone
overfills the pool a few turns later and thrashes anyway). Siblings' shared prompt counts once.
The router owns the queue (and runs held turns on a replica with nothing in flight:
work-conserving); this keeps who is resident where and which held turns a change releases.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable


class Residency:
    def __init__(self, fraction: float, capacity: Callable[[str], float], idle_s: float = 600.0,
                 growth_prior: float = 0.0) -> None:
        self.fraction, self.capacity, self.idle_s = fraction, capacity, idle_s
        # contexts grow every turn (response + tool output): a new trajectory is admitted only where
        # the residents' contexts still fit once each has grown by its expected remaining turns
        self.growth = growth_prior  # EMA of context tokens added per turn (a prior until seen)
        # replica -> trajectory -> [context tokens, last activity, group, its first prompt's tokens,
        #                           context at its last turn's start, expected turns left]
        self.residents: dict[str, dict[str, list]] = {}
        self._active: dict[str, tuple[set[str], float]] = {}
        self.held_new: list[tuple] = []  # new trajectories waiting for a replica with room (a heap)
        self.held_res: dict[str, list[tuple]] = {}  # replica -> turns of its waiting residents

    def budget(self, name: str) -> float | None:
        cap = self.capacity(name)
        return self.fraction * cap if cap else None

    def active(self, name: str, budget: float) -> tuple[set[str], float]:
        got = self._active.get(name)
        if got is None:
            active, used, groups = set(), 0.0, set()
            for tid, (tokens, _, group, shared, *_) in self.residents.get(name, {}).items():
                if group is not None and group in groups:
                    tokens -= shared  # siblings share their prompt's KV blocks
                if active and used + tokens > budget:
                    break
                active.add(tid)
                used += tokens
                groups.add(group)
            got = self._active[name] = (active, used)
        return got

    def is_resident(self, tid: str, name: str | None) -> bool:
        return name is not None and tid in self.residents.get(name, {})

    def allowed(self, tid: str, group: str | None, prompt_len: int, home: str | None, names: list[str],
                left_turns: float = 0.0) -> list[str]:
        """Where a turn may go now. A new trajectory (`left_turns` expected): replicas whose residents
        are all active with room for its prompt and everyone's expected growth (or empty). A resident:
        home while it is active there, and any other replica with room for its whole context (it
        moves, and its KV budget at home goes to the next in line): the policy weighs recomputing the
        context against a crowded home; a waiting resident runs elsewhere only where it fits."""
        if self.is_resident(tid, home):
            budget = self.budget(home)
            if home not in names:  # home is full or gone: anywhere
                return names
            entry = self.residents[home][tid]
            here = [home] if budget is None or tid in self.active(home, budget)[0] else []
            return here + [n for n in names if n != home and self._fits(n, group, entry[0], entry[3], left_turns)]
        return [n for n in names if self._fits(n, group, prompt_len, prompt_len, left_turns)]

    def _fits(self, name: str, group: str | None, tokens: float, shared: float, left_turns: float) -> bool:
        """Room on `name` for a context of `tokens` (of which `shared` is its group's prompt, held
        once by siblings) growing for `left_turns` more turns, with every resident's growth."""
        budget, res = self.budget(name), self.residents.get(name)
        if budget is None or not res:
            return True
        active, used = self.active(name, budget)
        if len(active) < len(res):  # a resident is waiting: no newcomer before it
            return False
        if group is not None and any(e[2] == group for e in res.values()):
            tokens -= shared
        return used + tokens + self.growth * (left_turns + sum(e[5] for e in res.values())) <= budget

    def admit(self, tid: str, name: str, tokens: int, group: str | None, first_turn: bool, now: float,
              left_turns: float | None = None) -> None:
        """`tid` is (or stays) resident on `name` with a context of `tokens`; `left_turns` (its expected
        turns after this one) is given when a turn starts."""
        for n, res in self.residents.items():
            if n != name and res.pop(tid, None) is not None:
                self._active.pop(n, None)
        res = self.residents.setdefault(name, {})
        self._active.pop(name, None)
        entry = res.get(tid)
        if entry is None:  # a trajectory that starts here shares its first prompt with its group
            res[tid] = entry = [float(tokens), now, group, float(tokens) if first_turn else 0.0, float(tokens), 0.0]
        else:
            if left_turns is not None and tokens > entry[4]:  # a new turn: what the last one added
                self.growth = 0.9 * self.growth + 0.1 * (tokens - entry[4])
                entry[4] = float(tokens)
            entry[0], entry[1] = max(entry[0], float(tokens)), now
        if left_turns is not None:
            entry[5] = max(left_turns, 0.0)

    def end(self, tid: str) -> list[str]:
        """The trajectory ended: the replicas whose residency changed."""
        changed = [n for n, res in self.residents.items() if res.pop(tid, None) is not None]
        for n in changed:
            self._active.pop(n, None)
        return changed

    def drop_replica(self, name: str) -> None:
        self.residents.pop(name, None)
        self._active.pop(name, None)

    def drop_idle(self, now: float) -> list[str]:
        """Residents idle past `idle_s` (an episode that never ended) go; the replicas changed."""
        changed = []
        for name, res in self.residents.items():
            gone = [t for t, entry in res.items() if now - entry[1] > self.idle_s]
            for t in gone:
                del res[t]
            if gone:
                self._active.pop(name, None)
                changed.append(name)
        return changed

    def hold(self, item: tuple, tid: str | None, home: str | None) -> None:
        if tid is not None and self.is_resident(tid, home):
            self.held_res.setdefault(home, []).append(item)
        else:
            heapq.heappush(self.held_new, item)

    def release(self, name: str) -> list[tuple]:
        """Held turns that a change on `name` may let through: its residents' and every new one."""
        items = self.held_new + self.held_res.pop(name, [])
        self.held_new = []
        return items
