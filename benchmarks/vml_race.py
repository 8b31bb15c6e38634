"""MKL's vector math on its first call, from several OpenMP threads at once (rollwise/mkl.py).

    python benchmarks/vml_race.py [--starts N] [--threads T] [--json PATH] [--smoke]

Each start is a fresh Python process: torch's threads are set to T and woken by a matmul and an
elementwise add, then cos of a 40,000-element tensor (split between the threads) is taken twice and
the two compared. A start "races" when the first differs from the second anywhere. The starts alternate between processes that
do nothing first ("cold") and processes that call `rollwise.mkl.settle()` first, as the trainer's
policy and the engine do. The work done is the same in both: two cos of the same tensor.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from tqdm import tqdm

from rollwise.omp import passive_env

START = """
import torch
from rollwise import mkl
torch.set_num_threads({threads})
a = torch.randn(512, 256)
(a @ a.t()).sum()
torch.randn(100000).add(1)
if {settle}:
    mkl.settle()
x = torch.rand(40000, generator=torch.Generator().manual_seed(0)) * 0.9 + 0.05
first, second = torch.cos(x), torch.cos(x)
print(int((first != second).sum()))
"""


def start(threads: int, settle: bool) -> int:
    """One fresh process; how many of the first cos's elements differ from the second's."""
    out = subprocess.run([sys.executable, "-c", START.format(threads=threads, settle=settle)], env=passive_env(),
                         capture_output=True, text=True, timeout=120)
    if out.returncode:
        raise RuntimeError(f"a start failed ({out.returncode}): {out.stderr[-2000:]}")
    return int(out.stdout.split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--starts", type=int, default=300, help="fresh processes per arm")
    ap.add_argument("--threads", type=int, default=4, help="torch threads in each")
    ap.add_argument("--smoke", action="store_true", help="2 starts per arm (CI)")
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()
    if args.starts < 1 or args.threads < 2:
        ap.error("--starts must be >= 1 and --threads >= 2 (one thread has no one to race)")
    n = 2 if args.smoke else args.starts
    arms = {"cold": [], "settled": []}
    bar = tqdm(total=2 * n, desc="starts", file=sys.stderr)
    for _ in range(n):
        for arm in arms:  # (taking turns: a slow spell of the machine falls on both)
            arms[arm].append(start(args.threads, arm == "settled"))
            bar.update()
            bar.set_postfix({a: sum(d > 0 for d in v) for a, v in arms.items()})
    bar.close()
    results = {"threads": args.threads, "elements": 40000, "arms": {
        arm: {"starts": len(v), "raced": sum(d > 0 for d in v), "differing": [d for d in v if d]}
        for arm, v in arms.items()}}
    print(f"\nfirst cos of 40,000 elements on {args.threads} threads, against the second, in fresh processes")
    print(f"{'arm':<10}{'starts':>8}{'raced':>8}  elements differing where raced")
    for arm, r in results["arms"].items():
        print(f"{arm:<10}{r['starts']:>8}{r['raced']:>8}  {r['differing'] or '-'}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
