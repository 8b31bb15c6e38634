"""What batching buys a learned reward model: concurrent episodes' answers scored one forward each
(`batch_size = 1`) against together (the default, 16: the waiting answers by length, up to 16 in one
forward, padded on the left), taking turns, on a reward model made from a local model's weights (its config and
tokenizer; a random score head), every side giving the same scores (to 1e-4).

    python benchmarks/reward_model.py [--model DIR] [--answers 256] [--repeats 3] [--smoke] [--json PATH]

Answers: the assistant messages of the public tau-bench trajectories (../shared/data/agent-
trajectories), each after the user message before it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from rollwise.omp import passive_unless_chosen

passive_unless_chosen()

from rollwise.make_model import make_reward_model  # noqa: E402
from common import write_json  # noqa: E402  (benchmarks/common.py)

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "agent-trajectories" / "public.jsonl"


def conversations(path: Path, n: int) -> list[list[dict]]:
    out = []
    with open(path) as f:
        for line in f:
            turns = json.loads(line)["turns"]
            for prev, cur in zip(turns, turns[1:]):
                if prev["role"] == "user" and cur["role"] == "assistant" and cur["content"].strip():
                    out.append([{"role": "user", "content": prev["content"]},
                                {"role": "assistant", "content": cur["content"]}])
                    if len(out) == n:
                        return out
    return out


async def side(rm_dir: str, convs: list[list[dict]], batch_size: int, max_length: int) -> tuple[float, list, int]:
    from rollwise.agent.reward_model import RewardModel, RewardModelConfig
    rm = RewardModel(RewardModelConfig.from_dict({"path": rm_dir, "batch_size": batch_size,
                                                  "max_length": max_length}))
    await asyncio.gather(*(rm.score(c) for c in convs[:2]))  # (warm)
    rm.forwards = 0
    t0 = time.perf_counter()
    scores = await asyncio.gather(*(rm.score(c) for c in convs))
    return time.perf_counter() - t0, scores, rm.forwards


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(Path.home() / ".cache" / "rollwise" / "rl-demo-model"))
    ap.add_argument("--answers", type=int, default=256)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="a few answers on a tiny model (tests)")
    ap.add_argument("--json")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    if args.smoke:
        from rollwise.make_model import make_model
        args.model = str(make_model(tmp / "model", layers=1, hidden=32, heads=2, kv_heads=1, vocab=1024))
        args.answers, args.repeats = 12, 1
    elif not Path(args.model).exists():
        from rollwise.make_model import cached_model
        from rollwise.cli import DEMO_MODEL
        args.model = str(cached_model(args.model, **DEMO_MODEL))
    rm_dir = str(make_reward_model(args.model, tmp / "rm"))
    convs = conversations(DATA, args.answers)
    tokens = None
    secs: dict[str, list[float]] = {"one_at_a_time": [], "batched": []}
    forwards = {}
    for rep in range(args.repeats):
        got = {}
        for name, bs in (("one_at_a_time", 1), ("batched", 16)):
            s, got[name], forwards[name] = asyncio.run(side(rm_dir, convs, bs, args.max_length))
            secs[name].append(s)
        assert all(abs(a - b) <= 1e-4 for a, b in zip(got["one_at_a_time"], got["batched"])), "scores differ"
        print(f"repeat {rep + 1}/{args.repeats}: one at a time {secs['one_at_a_time'][-1]:.2f}s, batched "
              f"{secs['batched'][-1]:.2f}s", flush=True)
    if tokens is None:
        from rollwise.agent.reward_model import RewardModel, RewardModelConfig
        rm = RewardModel(RewardModelConfig.from_dict({"path": rm_dir, "max_length": args.max_length}))
        tokens = sum(len(rm.encode(c)) for c in convs)
    med = {k: statistics.median(v) for k, v in secs.items()}
    out = {"answers": len(convs), "tokens": tokens, "max_length": args.max_length, "forwards": forwards,
           "seconds": med, "answers_per_s": {k: len(convs) / v for k, v in med.items()},
           "ratio": med["one_at_a_time"] / med["batched"]}
    print(f"{len(convs)} answers, {tokens:,} tokens: one at a time {out['answers_per_s']['one_at_a_time']:.1f}/s "
          f"({forwards['one_at_a_time']} forwards), batched {out['answers_per_s']['batched']:.1f}/s "
          f"({forwards['batched']} forwards): {out['ratio']:.2f}x")
    write_json(args.json, out)


if __name__ == "__main__":
    main()
