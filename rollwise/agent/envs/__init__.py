"""Built-in environments, by name: `make_env("sql", tool_latency=Latency(0.05, 0.5))`."""
from __future__ import annotations

from rollwise.agent.envs.calculator import CalculatorEnv
from rollwise.agent.envs.countdown import CountdownEnv
from rollwise.agent.envs.frozenlake import FrozenLakeEnv
from rollwise.agent.envs.phonebook import PhonebookEnv
from rollwise.agent.envs.sql import SqlEnv

ENVS = {e.name: e for e in (CalculatorEnv, CountdownEnv, SqlEnv, FrozenLakeEnv, PhonebookEnv)}


def make_env(name: str, **options):
    if name not in ENVS:
        raise ValueError(f"unknown environment {name!r}; available: {sorted(ENVS)}")
    return ENVS[name](**options)
