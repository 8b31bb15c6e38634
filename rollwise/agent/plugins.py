"""A user's code named in a config: `package.module:name` (an importable module) or
`path/to/file.py:name` (a file, loaded once per process). Environments, reward functions and
tools are named this way."""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

FORM = "'package.module:name' or 'path/to/file.py:name'"


def load_object(spec: str, what: str = "object", accept=callable):
    """The object `spec` names (by default, a callable one); a ValueError says why it cannot be had
    (`what` names it there)."""
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise ValueError(f"{what} {spec!r} is not of the form {FORM}")
    try:
        module = _load_file(Path(where)) if where.endswith(".py") else importlib.import_module(where)
    except (ImportError, OSError, SyntaxError) as e:
        raise ValueError(f"cannot load {what} {spec!r}: {type(e).__name__}: {e}") from e
    obj = getattr(module, attr, None)
    if obj is None or not accept(obj):
        raise ValueError(f"{what} {spec!r}: {where} has no class or function {attr!r}")
    return obj


def _load_file(path: Path):
    key = f"rollwise_user_{abs(hash(str(path.resolve())))}"
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
