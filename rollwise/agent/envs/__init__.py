"""Environments by name: a built-in one (`make_env("sql", tool_latency=Latency(0.05, 0.5))`) or a
user's, named `package.module:Name` or `path/to/file.py:Name`, where Name is an `Env` class or a
function that returns one (`make_env("my_envs.py:TicketEnv", max_turns=6)`). `agent` runs an agent
written against the OpenAI API (`make_env("agent", agent="my_agent.py:run")`)."""
from __future__ import annotations

import inspect
import json
from pathlib import Path

from rollwise.agent.envs.agent import AgentEnv
from rollwise.agent.envs.airline import AirlineEnv
from rollwise.agent.envs.bugfix import BugfixEnv
from rollwise.agent.envs.calculator import CalculatorEnv
from rollwise.agent.envs.code import CodeEnv
from rollwise.agent.envs.countdown import CountdownEnv
from rollwise.agent.envs.dataset import DatasetEnv
from rollwise.agent.envs.frozenlake import FrozenLakeEnv
from rollwise.agent.envs.inline import InlineEnv
from rollwise.agent.envs.mix import MixEnv
from rollwise.agent.envs.phonebook import PhonebookEnv
from rollwise.agent.envs.search import SearchEnv
from rollwise.agent.envs.search_r1 import SearchR1Env
from rollwise.agent.envs.sql import SqlEnv
from rollwise.agent.plugins import FORM, load_object

ENVS = {e.name: e for e in (AgentEnv, AirlineEnv, BugfixEnv, CalculatorEnv, CodeEnv, CountdownEnv, DatasetEnv, SqlEnv,
                            FrozenLakeEnv, InlineEnv, MixEnv, PhonebookEnv, SearchEnv, SearchR1Env)}


def resolve_env(name: str):
    """The class (or function) that makes environment `name`: built-in, or a user's. A ValueError
    names the built-ins and the form of a user's env."""
    if name in ENVS:
        return ENVS[name]
    if ":" not in name:
        raise ValueError(f"unknown environment {name!r}; available: {sorted(ENVS)}, or a user's as {FORM}")
    return load_object(name, "environment")


def taken_options(factory, options: dict) -> dict:
    """Those of `options` that `factory` (an env class or function) takes by name; all of them if it
    takes **kwargs (a run's standard options, such as max_turns, go to the envs that have them)."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
    return {k: v for k, v in options.items() if takes_all or k in params}


def make_env(name: str, **options):
    try:
        env = resolve_env(name)(**options)
    except TypeError as e:  # an option it does not take (a typo in env_options): the caller's error
        if "keyword argument" not in str(e):
            raise
        raise ValueError(f"environment {name!r}: {e}") from e
    missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
    if missing:
        raise ValueError(f"environment {name!r} made a {type(env).__name__} without {missing} (see rollwise.agent.env.Env)")
    return env


def load_tasks(path: str | Path) -> list[dict]:
    """Tasks from a file: JSON lines (`.jsonl`, one object per line), a JSON list, or Parquet (`.parquet`,
    one task per row, nested columns as dicts and lists: verl's and Search-R1's data files; needs
    pyarrow, `pip install 'rollwise[parquet]'`). A task without an `id` gets `<file stem>-<row>`; ids
    must be unique (they name groups and trajectories)."""
    path = Path(path)
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ValueError(f"{path}: reading Parquet needs pyarrow: pip install 'rollwise[parquet]'") from e
        try:
            rows = pq.read_table(path).to_pylist()
        except FileNotFoundError:
            raise
        except Exception as e:  # pyarrow's own errors: not a Parquet file, a truncated one
            raise ValueError(f"{path}: not a readable Parquet file: {e}") from e
    elif path.suffix == ".jsonl":
        rows = []
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i}: not JSON: {e}") from e
    else:
        rows = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(rows, list):
            raise ValueError(f"{path}: expected a JSON list of task objects (or a .jsonl file)")
    tasks = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"{path}: task {i} is {type(row).__name__}, not an object")
        tasks.append({"id": f"{path.stem}-{i}", **row})
    ids = [str(t["id"]) for t in tasks]
    if len(set(ids)) < len(ids):
        raise ValueError(f"{path}: task ids repeat ({len(ids) - len(set(ids))} duplicates)")
    if not tasks:
        raise ValueError(f"{path}: no tasks")
    return tasks
