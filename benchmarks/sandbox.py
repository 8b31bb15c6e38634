"""What the code sandbox costs: sandboxed runs against bare subprocesses of the same Python doing the
same work, taking turns, at one run at a time and at one per core.

    python benchmarks/sandbox.py [--runs N] [--smoke] [--json PATH]

Work per run: a short program (a loop over 20,000 integers and a print, about what a model's
`python` call does) and a shell command line (`python test_x.py` in a workspace, as the bugfix
env's `bash` does). The sandbox adds the rlimits, a network namespace, a clean environment, a
private directory, output capture with caps and a process-group kill; the baseline is
`asyncio.create_subprocess_exec(python, -I, -c, program)` with its output read.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rollwise.agent.sandbox import Sandbox
from common import write_json  # (benchmarks/common.py)

PROGRAM = "print(sum(i * i for i in range(20000)))"
TEST = "from x import f\nassert f(3) == 9\nprint('all tests passed')\n"


async def bare(argv: list[str], cwd: str) -> str:
    proc = await asyncio.create_subprocess_exec(*argv, cwd=cwd, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    return out.decode()


async def batch(make, runs: int, concurrency: int) -> float:
    """Seconds for `runs` runs, `concurrency` at a time."""
    slots = asyncio.Semaphore(concurrency)

    async def one():
        async with slots:
            out = await make()
            assert out.strip() in ("all tests passed", str(sum(i * i for i in range(20000)))), out
    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(runs)))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    runs, reps = (8, 1) if args.smoke else (args.runs, args.reps)
    cores = len(os.sched_getaffinity(0))
    work = tempfile.mkdtemp(prefix="rollwise-bench-")
    Path(work, "x.py").write_text("def f(n):\n    return n * n\n")
    Path(work, "test_x.py").write_text(TEST)
    results: dict = {"runs": runs, "cores": cores, "cases": {}}
    for conc in sorted({1, cores}):
        sandbox = Sandbox(max_concurrent=conc)
        cases = {
            "python program": (lambda: _text(sandbox.run(PROGRAM)),
                               lambda: bare([sys.executable, "-I", "-c", PROGRAM], work)),
            "shell command in a workspace": (lambda: _text(sandbox.shell("python test_x.py", cwd=work)),
                                             lambda: bare(["/bin/sh", "-c", f"{sys.executable} test_x.py"], work)),
        }
        for name, (boxed, plain) in cases.items():
            t_box, t_bare = [], []
            for _ in range(reps):  # taking turns
                t_box.append(asyncio.run(batch(boxed, runs, conc)))
                t_bare.append(asyncio.run(batch(plain, runs, conc)))
            sb, bb = statistics.median(t_box), statistics.median(t_bare)
            row = {"sandbox_ms": 1000 * sb / runs, "bare_ms": 1000 * bb / runs, "overhead": sb / bb,
                   "sandbox_runs_per_s": runs / sb, "bare_runs_per_s": runs / bb}
            results["cases"][f"{name}, {conc} at once"] = row
            print(f"{name}, {conc} at once: sandbox {row['sandbox_ms']:.1f} ms/run ({row['sandbox_runs_per_s']:.0f}/s), "
                  f"bare subprocess {row['bare_ms']:.1f} ms/run: {row['overhead']:.2f}x the time ({runs} runs)")
    write_json(args.json, results)


async def _text(run) -> str:
    r = await run
    assert r.ok, r.observation()
    return r.stdout


if __name__ == "__main__":
    main()
