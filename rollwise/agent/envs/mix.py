"""mix: several environments in one run (multi-task RL), each task naming its env.

    env = "mix"
    env_options = { envs = { phonebook = {}, calculator = { max_turns = 3 } }, weights = { phonebook = 2 } }

Each episode runs on a fresh env of the kind its task names (`task["env"]`), made with that env's
options (plus the run's `max_turns` and `tool_latency` where it takes them and does not set its
own). `sample_tasks(n, seed)` draws from each env's own `sample_tasks` in proportion to `weights`
(default 1 each), tags each task with its env, prefixes its id with the env's name and interleaves
them (seeded); task files name the env per task. `expert(task)` is its env's expert, so the SFT warm
start covers every env. Any env may be a user's (`"my_envs.py:TicketEnv" = {...}`).
"""
from __future__ import annotations

import random

from rollwise.agent.env import maybe_await


class MixEnv:
    name = "mix"

    def __init__(self, envs: dict[str, dict], weights: dict[str, float] | None = None, max_turns: int | None = None,
                 tool_latency=None) -> None:
        from rollwise.agent.envs import resolve_env, taken_options
        if not isinstance(envs, dict) or not envs or not all(isinstance(o, dict) for o in envs.values()):
            raise ValueError("mix needs envs = { name = { options }, ... }: at least one env, each with a table "
                             "of options")
        if "mix" in envs:
            raise ValueError("mix cannot contain mix")
        weights = dict(weights or {})
        unknown = sorted(set(weights) - set(envs))
        if unknown or any(not isinstance(w, (int, float)) or w < 0 for w in weights.values()):
            raise ValueError(f"mix weights: names {unknown} are not among envs {sorted(envs)}, or a weight is < 0")
        self.weights = {name: float(weights.get(name, 1.0)) for name in envs}
        if sum(self.weights.values()) <= 0:
            raise ValueError("mix weights must not all be 0")
        self.options: dict[str, dict] = {}
        run = {k: v for k, v in (("max_turns", max_turns), ("tool_latency", tool_latency)) if v is not None}
        for name, opts in envs.items():  # (resolve_env: a ValueError naming the built-ins for an unknown one)
            self.options[name] = {**taken_options(resolve_env(name), run), **opts}
        self.inner, self.bound = None, ()
        self.max_turns = max(self._make(n).max_turns for n in envs)  # (the episode's own env's, once reset)

    def _make(self, name: str):
        from rollwise.agent.envs import make_env
        return make_env(name, **self.options[name])

    def env_of(self, task: dict) -> str:
        name = task.get("env")
        if name not in self.options:
            raise ValueError(f"task {task.get('id')!r} names env {name!r}; this mix has {sorted(self.options)} "
                             "(a task of a mix needs an \"env\" field)")
        return name

    def bind_generator(self, *bound) -> None:
        """The episode's generator (before reset, when the episode's env is not yet chosen): handed on."""
        self.bound = bound

    async def reset(self, task: dict):
        self.inner = self._make(self.env_of(task))
        self.max_turns = self.inner.max_turns
        if self.bound and hasattr(self.inner, "bind_generator"):
            self.inner.bind_generator(*self.bound)
        return await maybe_await(self.inner.reset(task))

    def step(self, action: str):
        return self.inner.step(action)

    def __getattr__(self, name: str):  # tools, turn_params, observe, close: the episode's env's
        inner = self.__dict__.get("inner")
        if inner is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(inner, name)

    def sample_tasks(self, n: int, seed: int) -> list[dict]:
        total = sum(self.weights.values())
        names = [name for name in self.options if self.weights[name] > 0]
        share = {name: n * self.weights[name] / total for name in names}
        counts = {name: int(share[name]) for name in names}
        for name in sorted(names, key=lambda k: counts[k] - share[k])[:n - sum(counts.values())]:
            counts[name] += 1  # largest remainders
        tasks = []
        for name in names:
            sample = getattr(self._make(name), "sample_tasks", None)
            if sample is None:
                raise ValueError(f"env {name!r} of the mix draws no tasks (no sample_tasks): give a task file instead")
            tasks += [{**t, "id": f"{name}/{t['id']}", "env": name} for t in sample(counts[name], seed)]
        random.Random(seed).shuffle(tasks)
        return tasks

    def expert(self, task: dict) -> list[str]:
        return self._make(self.env_of(task)).expert(task)
