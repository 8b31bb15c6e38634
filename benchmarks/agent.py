"""Agent loop throughput: episodes/s versus concurrency, with tool latency, on the real engine and on
an instant scripted generator (which isolates the loop's own overhead), in one run.

    python benchmarks/agent.py [--quick | --smoke] [--env sql] [--json PATH]

Episodes replay each task's scripted expert (a tool call, then the answer; several moves for
frozenlake): the engine runs are teacher-forced to emit the expert's tokens, so every forward and
logprob is real and every configuration does the same work. Tool latency: uniform 50-500 ms.
"""
from __future__ import annotations

import argparse
import asyncio
import time

from rollwise.omp import passive_unless_chosen
passive_unless_chosen()  # before torch loads

from rollwise.agent.envs import make_env  # noqa: E402
from rollwise.agent.episode import collect  # noqa: E402
from rollwise.agent.generator import ForcedGenerator, ScriptedGenerator, expert_policy  # noqa: E402
from rollwise.agent.tools import Latency  # noqa: E402
from rollwise.engine.async_engine import AsyncEngine  # noqa: E402
from rollwise.engine.tokenizer import Tokenizer  # noqa: E402
from rollwise.types import SamplingParams  # noqa: E402

from common import cached_model, write_json  # noqa: E402  (benchmarks/common.py)


async def measure(gen, env_name: str, tasks: list[dict], concurrency: int, latency: Latency | None) -> dict:
    params = SamplingParams(temperature=0, max_tokens=256)
    factory = lambda: make_env(env_name, tool_latency=latency, tool_timeout=10.0)  # noqa: E731
    t0 = time.perf_counter()
    trajs = [t async for g in collect(gen, factory, tasks, params, group_size=1, max_concurrency=concurrency)
             for t in g]
    dt = time.perf_counter() - t0
    turns = sum(t.num_turns for t in trajs)
    return {"episodes": len(trajs), "turns": turns, "seconds": dt, "episodes_per_s": len(trajs) / dt,
            "turns_per_s": turns / dt, "generated_tokens": sum(t.num_generated for t in trajs),
            "solved": sum(t.reward == 1.0 for t in trajs) / len(trajs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", default="sql")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    model = cached_model("agent-bench-model", family="qwen3", layers=2, hidden=128, heads=4, kv_heads=2,
                         vocab=4096, seed=0)
    conc = [1, 4] if args.smoke else [1, 8, 64, 512] if args.quick else [1, 4, 16, 64, 256, 512]
    latency = Latency(0.05, 0.5)
    env = make_env(args.env)
    out: dict = {"env": args.env, "tool_latency_s": [0.05, 0.5], "fake": {}, "engine": {}}

    # the loop's own cost: instant generator, no tool latency, many episodes at once
    tok = Tokenizer(model)
    tasks = env.sample_tasks(64 if args.smoke else 2000, seed=1)
    fake = ScriptedGenerator(tok, expert_policy(lambda: make_env(args.env), tasks))
    r = asyncio.run(measure(fake, args.env, tasks, 256, None))
    out["loop_overhead_us_per_turn"] = 1e6 * r["seconds"] / r["turns"]
    print(f"loop overhead: {out['loop_overhead_us_per_turn']:.0f} us per turn ({r['turns']} turns, "
          f"{r['episodes']} episodes, instant generator, no tool latency)")

    engine = AsyncEngine(model, max_num_seqs=256)
    print(f"\n{'concurrency':>11}{'fake ep/s':>11}{'engine ep/s':>13}{'engine turns/s':>16}{'gen tokens':>12}{'solved':>8}")
    try:
        for c in conc:
            n_fake = max(2 * c, 16) if not args.smoke else 8
            n_eng = (max(c, 16) if args.quick or args.smoke else max(2 * c, 32)) if not args.smoke else 4
            ts = env.sample_tasks(max(n_fake, n_eng), seed=2 + c)
            f = asyncio.run(measure(ScriptedGenerator(tok, expert_policy(lambda: make_env(args.env), ts)),
                                    args.env, ts[:n_fake], c, latency))
            g = asyncio.run(measure(ForcedGenerator(engine, expert_policy(lambda: make_env(args.env), ts)),
                                    args.env, ts[:n_eng], c, latency))
            out["fake"][c], out["engine"][c] = f, g
            print(f"{c:>11}{f['episodes_per_s']:>11.1f}{g['episodes_per_s']:>13.1f}{g['turns_per_s']:>16.1f}"
                  f"{g['generated_tokens']:>12}{g['solved']:>8.2f}", flush=True)
    finally:
        engine.shutdown()
    write_json(args.json, out)


if __name__ == "__main__":
    main()
