"""What an agent on the OpenAI API costs against a built-in env: the demo's phonebook task as the
built-in `phonebook` env and as examples/phonebook_agent.py (the openai SDK to rollwise's agent
gateway, on chat completions and on the Responses API; or the anthropic SDK on the Messages API),
the same episodes in one run, taking turns.

    python benchmarks/agent_gateway.py [--quick | --smoke] [--json PATH]
    python benchmarks/agent_gateway.py --sides env,agent,program,server --episodes 64   # agent programs

Sides: `env` (built-in), `agent` (the openai-SDK agent in process, chat), `responses` (the same on
the Responses API), `messages` (the same on Anthropic's Messages API, the anthropic SDK), `program`
(examples/phonebook_agent_cli.py, a process per episode) and `server` (the same program, one
long-lived process serving every episode: `serve = true`).

Both replay each task's scripted expert (a lookup, then the answer): on an instant generator (the
loops' own cost per turn) and on the real engine teacher-forced to the expert (real forwards and
logprobs on a 2-layer model), so both sides generate the same tokens in the same turns; the run
checks that their trajectories' token ids are identical.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from rollwise.omp import passive_unless_chosen
passive_unless_chosen()  # before torch loads

from rollwise.agent.envs import make_env  # noqa: E402
from rollwise.agent.episode import collect  # noqa: E402
from rollwise.agent.generator import ForcedGenerator, ScriptedGenerator, expert_policy  # noqa: E402
from rollwise.engine.async_engine import AsyncEngine  # noqa: E402
from rollwise.engine.tokenizer import Tokenizer  # noqa: E402
from rollwise.types import SamplingParams  # noqa: E402

from common import cached_model, write_json  # noqa: E402  (benchmarks/common.py)

AGENT = str(Path(__file__).resolve().parent.parent / "examples" / "phonebook_agent.py") + ":PhonebookAgent"
CLI = [sys.executable, str(Path(AGENT.split(":")[0]).with_name("phonebook_agent_cli.py"))]
SIDES = {"env": lambda: make_env("phonebook"), "agent": lambda: make_env("agent", agent=AGENT),
         "responses": lambda: make_env("agent", agent=AGENT, agent_options={"api": "responses"}),
         "messages": lambda: make_env("agent", agent=AGENT, agent_options={"api": "messages"}, client="anthropic"),
         "program": lambda: make_env("agent", command=CLI),
         "server": lambda: make_env("agent", command=CLI + ["--serve"], serve=True)}


async def measure(gen, side: str, tasks: list[dict], concurrency: int) -> tuple[dict, list]:
    params = SamplingParams(temperature=0, max_tokens=64)
    t0 = time.perf_counter()
    trajs = [t async for g in collect(gen, SIDES[side], tasks, params, group_size=1, max_concurrency=concurrency)
             for t in g]
    dt = time.perf_counter() - t0
    turns = sum(t.num_turns for t in trajs)
    failed = [t for t in trajs if t.status != "done"]
    if failed:
        raise SystemExit(f"{side}: {len(failed)} of {len(trajs)} episodes failed, "
                         f"e.g. {failed[0].status}: {failed[0].error}")
    return ({"episodes": len(trajs), "turns": turns, "seconds": dt, "episodes_per_s": len(trajs) / dt,
             "ms_per_turn": 1e3 * dt / turns, "generated_tokens": sum(t.num_generated for t in trajs),
             "solved": sum(t.reward == 1.0 for t in trajs) / len(trajs)},
            sorted((t.trajectory_id, tuple(t.token_ids)) for t in trajs))


async def compare(gen, tasks: list[dict], concurrency: int, repeats: int, sides: list[str]) -> dict:
    runs: dict[str, list] = {side: [] for side in sides}
    ids = {}
    for _ in range(repeats):  # taking turns, so drifting machine load falls on every side
        for side in runs:
            m, ids[side] = await measure(gen, side, tasks, concurrency)
            runs[side].append(m)
    best = {side: min(r, key=lambda m: m["seconds"]) for side, r in runs.items()}
    return {**best, **{f"{s}_over_env_time": best[s]["seconds"] / best["env"]["seconds"] for s in sides if s != "env"},
            "same_token_ids": all(ids[s] == ids["env"] for s in sides)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--sides", default="env,agent,responses", help=f"comma-separated, env first; of {list(SIDES)}")
    ap.add_argument("--episodes", type=int, help="episodes per run (default 256; --quick 64, --smoke 8)")
    args = ap.parse_args()
    sides = args.sides.split(",")
    if sides[0] != "env" or not set(sides) <= set(SIDES):
        ap.error(f"--sides: env first, then any of {list(SIDES)}")
    model = cached_model("agent-bench-model", family="qwen3", layers=2, hidden=128, heads=4, kv_heads=2,
                         vocab=4096, seed=0)
    n = args.episodes or (8 if args.smoke else 64 if args.quick else 256)
    conc = [1, 8] if args.smoke else [1, 16, 64]
    repeats = 1 if args.smoke else 3
    tasks = make_env("phonebook").sample_tasks(n, seed=0)
    policy = expert_policy(SIDES["env"], tasks)
    out: dict = {"episodes": n, "repeats": repeats, "sides": sides, "instant": {}, "engine": {}}
    rows = []
    instant = ScriptedGenerator(Tokenizer(model), policy)
    for c in conc:
        out["instant"][c] = r = asyncio.run(compare(instant, tasks, c, repeats, sides))
        rows.append(("instant", c, r))
    engine = AsyncEngine(model, max_num_seqs=64)
    try:
        forced = ForcedGenerator(engine, policy)
        for c in conc:
            out["engine"][c] = r = asyncio.run(compare(forced, tasks, c, repeats, sides))
            rows.append(("engine", c, r))
    finally:
        engine.shutdown()
    others = sides[1:]
    print(f"| generator | concurrency | built-in env ep/s | {' / '.join(others)} ep/s | {' / '.join(others)} time "
          f"over env | ms per turn ({' / '.join(sides)}) | turns / tokens | same token ids |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for gen, c, r in rows:
        e = r["env"]
        rate = " / ".join(f"{r[s]['episodes_per_s']:.1f}" for s in others)
        over = " / ".join(f"{r[s + '_over_env_time']:.2f}x" for s in others)
        ms = " / ".join(f"{r[s]['ms_per_turn']:.2f}" for s in sides)
        print(f"| {gen} | {c} | {e['episodes_per_s']:.1f} | {rate} | {over} | {ms} | "
              f"{e['turns']} / {e['generated_tokens']} | {r['same_token_ids']} |")
    write_json(args.json, out)
    if not all(r["same_token_ids"] for _, _, r in rows):
        raise SystemExit("the agent's trajectories differ from the built-in env's")


if __name__ == "__main__":
    main()
