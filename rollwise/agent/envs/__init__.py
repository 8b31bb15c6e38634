"""Environments by name: a built-in one (`make_env("sql", tool_latency=Latency(0.05, 0.5))`) or a
user's, named `package.module:Name` or `path/to/file.py:Name`, where Name is an `Env` class or a
function that returns one (`make_env("my_envs.py:TicketEnv", max_turns=6)`)."""
from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path

from rollwise.agent.envs.calculator import CalculatorEnv
from rollwise.agent.envs.code import CodeEnv
from rollwise.agent.envs.countdown import CountdownEnv
from rollwise.agent.envs.frozenlake import FrozenLakeEnv
from rollwise.agent.envs.phonebook import PhonebookEnv
from rollwise.agent.envs.sql import SqlEnv

ENVS = {e.name: e for e in (CalculatorEnv, CodeEnv, CountdownEnv, SqlEnv, FrozenLakeEnv, PhonebookEnv)}


def resolve_env(name: str):
    """The class (or function) that makes environment `name`: built-in, or imported from the module
    or file before the colon. A ValueError names the built-ins and the form of a user's env."""
    if name in ENVS:
        return ENVS[name]
    where, sep, attr = name.rpartition(":")
    if not sep or not where or not attr:
        raise ValueError(f"unknown environment {name!r}; available: {sorted(ENVS)}, or a user's as "
                         "'package.module:Name' or 'path/to/file.py:Name'")
    try:
        module = _load_file(Path(where)) if where.endswith(".py") else importlib.import_module(where)
    except (ImportError, OSError, SyntaxError) as e:
        raise ValueError(f"cannot load environment {name!r}: {type(e).__name__}: {e}") from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"environment {name!r}: {where} has no class or function {attr!r}")
    return factory


def _load_file(path: Path):
    key = f"rollwise_user_env_{abs(hash(str(path.resolve())))}"
    if key not in sys.modules:  # once per process, so its classes stay the same objects
        spec = importlib.util.spec_from_file_location(key, path)
        if spec is None or not path.is_file():
            raise OSError(f"no such file: {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[key]
            raise
    return sys.modules[key]


def make_env(name: str, **options):
    env = resolve_env(name)(**options)
    missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
    if missing:
        raise ValueError(f"environment {name!r} made a {type(env).__name__} without {missing} (see rollwise.agent.env.Env)")
    return env


def load_tasks(path: str | Path) -> list[dict]:
    """Tasks from a file: JSON lines (`.jsonl`, one object per line) or a JSON list. A task without an
    `id` gets `<file stem>-<line>`; ids must be unique (they name groups and trajectories)."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        rows = []
        for i, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i}: not JSON: {e}") from e
    else:
        rows = json.loads(text)
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
