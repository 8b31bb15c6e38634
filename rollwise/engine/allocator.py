"""glibc's malloc set up for an engine's activations (`settle()`), and handing free pages back (`trim()`).

A forward pass allocates activations of megabytes and frees them at its end. With glibc's defaults
that memory goes back to the operating system and is faulted in again, zeroed by the kernel, at the
next step: a thread other than the main one (the engine's thread in `rollwise serve`) allocates from
an arena of its own, made of heaps of 64 MiB at most that glibc unmaps or shrinks as they empty, and
chunks past a threshold are mmapped each time. A loop of 4 x 1024 prefills of the bench model took 108,000
page faults in `rollwise serve` (0.25 s of system time in 1.6 s) and 17,000-27,000 in process.
`settle()` gives every thread the main arena (it grows with brk and holds chunks of any size),
chunks below 32 MiB from it, and its free top handed back only past 128 MiB: 16,400 faults both
ways, which are the KV pool's pages touched for the first time (16 KiB a token on that model).
`benchmarks/allocator.py` measures it. rollwise's command line calls it first thing; a program of
one's own that serves an engine on a thread calls it before anything else (or sets glibc's
variables: MALLOC_ARENA_MAX=1 MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=134217728).
Called later, a thread that allocated before keeps an arena of its own, and new threads take turns
between the arenas: an engine slept and woken on such threads kept 10-60 MB more at some cycles.
An environment that sets one of glibc's malloc variables (or GLIBC_TUNABLES' glibc.malloc) keeps
glibc's own choices; not glibc: nothing.
"""
from __future__ import annotations

import ctypes
import os
import platform

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # mallopt's parameters (malloc.h)
SETTINGS = {M_ARENA_MAX: 1, M_MMAP_THRESHOLD: 32 << 20, M_TRIM_THRESHOLD: 128 << 20}
ENV = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
       "MALLOC_MMAP_MAX_")  # (glibc reads these at start: one set means its user chose)
_settled: bool | None = None


def _libc():
    try:
        return ctypes.CDLL(None) if platform.libc_ver()[0] == "glibc" else None
    except OSError:
        return None


def settle() -> bool:
    """SETTINGS through mallopt, once a process and before its threads allocate (the arena limit holds
    for threads that have not yet allocated): whether they were set."""
    global _settled
    if _settled is None:
        libc = _libc()
        chosen = any(k in os.environ for k in ENV) or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "")
        _settled = libc is not None and not chosen and all(libc.mallopt(k, v) == 1 for k, v in SETTINGS.items())
    return _settled


def trim() -> None:
    """Hand the C allocator's free pages back to the OS. glibc keeps freed chunks in its arenas, so
    weights freed by a sleep (allocated again at each wake, on whichever thread) would stay resident:
    without this, level 2 gave back 100 of a model's 210 MB and the process grew by 130 MB a cycle."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
