"""MKL's vector math on its first call, from several OpenMP threads at once (rollwise/mkl.py), where a
CI run met it: the trainer's first step, in fresh processes.

    python benchmarks/vml_race.py [--starts N] [--json PATH] [--smoke]

Each start is a fresh Python process that builds the trainer's policy (a small Qwen3-style model,
made locally; 2 threads), moves its weights into one shared buffer as a trainer apart holds them,
and takes one SFT step on 3 expert episodes of the calculator env, as `rollwise train`'s warm start
does; it reports that step's loss to the last bit. The starts take turns between processes that
leave MKL's vector math cold (`rollwise.mkl.settle` skipped) and processes that settle it first, as
the policy does. Every start does the same work, on the same weights and tokens, so every loss
should be the same bits; a start that differs from the most common value raced.
"""
from __future__ import annotations

import argparse
import collections
import subprocess
import sys
from pathlib import Path

from tqdm import tqdm

from rollwise.omp import passive_env

HERE = Path(__file__).resolve().parent
MODEL = dict(family="qwen3", layers=2, hidden=64, heads=4, kv_heads=2, vocab=1024, std=0.1, seed=2, tie=True,
             head_dim=32)  # (the tests' qwen3, tests/conftest.py)

START = """
import asyncio, sys
from rollwise import mkl
if sys.argv[2] == "cold":
    mkl._settled = True  # (settle() then does nothing: the first calls race as they did before it)
from rollwise.agent.envs.calculator import CalculatorEnv
from rollwise.engine.tokenizer import Tokenizer
from rollwise.rl import expert_trajectories
from rollwise.rl_config import TrainConfig
from rollwise.rl_trainer import TrainerRanks, make_policy
from rollwise.trainer.data_parallel import share_weights
env = CalculatorEnv()
demos = asyncio.run(expert_trajectories(Tokenizer(sys.argv[1]), CalculatorEnv, env.sample_tasks(6, seed=0)))
cfg = TrainConfig.from_dict({"model": sys.argv[1], "run_dir": sys.argv[3], "seed": 3, "trainer_threads": 2,
                             "sft_steps": 1, "sft_batch": 3, "sft_lr": 3e-3, "micro_batch_tokens": 256})
policy = make_policy(cfg)
share_weights(policy.model)  # (its weights in one shared buffer, as a trainer apart holds them: where CI met it)
print(TrainerRanks(cfg, policy).sft(demos)[0].hex())
"""


def start(model: str, arm: str, run_dir: str) -> str:
    """One fresh process's first SFT loss, as hex (every bit)."""
    out = subprocess.run([sys.executable, "-c", START, model, arm, run_dir], env=passive_env(), capture_output=True,
                         text=True, timeout=300)
    if out.returncode:
        raise RuntimeError(f"a start failed ({out.returncode}): {out.stderr[-2000:]}")
    return out.stdout.split()[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--starts", type=int, default=100, help="fresh processes per arm")
    ap.add_argument("--smoke", action="store_true", help="2 starts per arm (CI)")
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()
    if args.starts < 1:
        ap.error("--starts must be >= 1")
    sys.path.insert(0, str(HERE))
    from common import cached_model, write_json  # benchmarks/common.py
    model = cached_model("vml-race-model", **MODEL)
    run_dir = str(Path.home() / ".cache" / "rollwise" / "vml-race-run")
    n = 2 if args.smoke else args.starts
    arms: dict[str, list[str]] = {"cold": [], "settled": []}
    bar = tqdm(total=2 * n, desc="starts", file=sys.stderr)
    for _ in range(n):
        for arm in arms:  # (taking turns: a slow spell of the machine falls on both)
            arms[arm].append(start(model, arm, run_dir))
            bar.update()
    bar.close()
    usual = collections.Counter(v for got in arms.values() for v in got).most_common(1)[0][0]
    results = {"model": model, "usual_loss": float.fromhex(usual), "arms": {
        arm: {"starts": len(got), "raced": sum(v != usual for v in got),
              "losses": {float.fromhex(v): c for v, c in collections.Counter(got).items()}}
        for arm, got in arms.items()}}
    print(f"\nfirst SFT loss of a fresh process (the usual value: {float.fromhex(usual)!r})")
    print(f"{'arm':<10}{'starts':>8}{'raced':>8}  other values")
    for arm, r in results["arms"].items():
        other = {v: c for v, c in r["losses"].items() if v != results["usual_loss"]}
        print(f"{arm:<10}{r['starts']:>8}{r['raced']:>8}  {other or '-'}")
    write_json(args.json, results)


if __name__ == "__main__":
    main()
