"""OpenMP's wait policy for torch processes, chosen before torch loads (libgomp reads it once).

libgomp's default keeps a thread spinning for a while after each parallel region. On cores shared
with another busy process that spinning takes the cores from it (DESIGN.md; `benchmarks/omp_wait.py`
measures it), so rollwise's entry points make idle threads sleep instead (`OMP_WAIT_POLICY=PASSIVE`).
A process that has its cores to itself decodes faster with libgomp's bounded spin: set
`GOMP_SPINCOUNT` (e.g. 300000) and leave `OMP_WAIT_POLICY` unset, and these leave it alone. An
explicit `GOMP_SPINCOUNT` wins over `OMP_WAIT_POLICY=PASSIVE` in libgomp, so a passive environment
has none.
"""
from __future__ import annotations

import os
from collections.abc import Mapping


def passive_unless_chosen() -> None:
    """Set OMP_WAIT_POLICY=PASSIVE unless the environment already chose a policy or a spin count."""
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def passive_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) for a subprocess that shares the cores: idle threads sleep."""
    out = {k: v for k, v in (os.environ if env is None else env).items() if k != "GOMP_SPINCOUNT"}
    out["OMP_WAIT_POLICY"] = "PASSIVE"
    return out


def spin_env(spin_count: int, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) for a subprocess with the cores to itself: libgomp's bounded spin."""
    if spin_count < 1:
        raise ValueError(f"spin_count must be >= 1, got {spin_count}")
    out = {k: v for k, v in (os.environ if env is None else env).items() if k != "OMP_WAIT_POLICY"}
    out["GOMP_SPINCOUNT"] = str(spin_count)
    return out
