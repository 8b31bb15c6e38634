"""What an agent on the OpenAI API costs against a built-in env: the demo's phonebook task as the
built-in `phonebook` env and as examples/phonebook_agent.py (the openai SDK to rollwise's agent
gateway, on chat completions and on the Responses API), the same episodes in one run, taking turns.

    python benchmarks/agent_gateway.py [--quick | --smoke] [--json PATH]

Both replay each task's scripted expert (a lookup, then the answer): on an instant generator (the
loops' own cost per turn) and on the real engine teacher-forced to the expert (real forwards and
logprobs on a 2-layer model), so both sides generate the same tokens in the same turns; the run
checks that their trajectories' token ids are identical.
"""
from __future__ import annotations

import argparse
import asyncio
import json
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

from common import cached_model  # noqa: E402  (benchmarks/common.py)

AGENT = str(Path(__file__).resolve().parent.parent / "examples" / "phonebook_agent.py") + ":PhonebookAgent"
SIDES = {"env": lambda: make_env("phonebook"), "agent": lambda: make_env("agent", agent=AGENT),
         "responses": lambda: make_env("agent", agent=AGENT, agent_options={"api": "responses"})}


async def measure(gen, side: str, tasks: list[dict], concurrency: int) -> tuple[dict, list]:
    params = SamplingParams(temperature=0, max_tokens=64)
    t0 = time.perf_counter()
    trajs = [t async for g in collect(gen, SIDES[side], tasks, params, group_size=1, max_concurrency=concurrency)
             for t in g]
    dt = time.perf_counter() - t0
    turns = sum(t.num_turns for t in trajs)
    return ({"episodes": len(trajs), "turns": turns, "seconds": dt, "episodes_per_s": len(trajs) / dt,
             "ms_per_turn": 1e3 * dt / turns, "generated_tokens": sum(t.num_generated for t in trajs),
             "solved": sum(t.reward == 1.0 for t in trajs) / len(trajs)},
            sorted((t.trajectory_id, tuple(t.token_ids)) for t in trajs))


async def compare(gen, tasks: list[dict], concurrency: int, repeats: int) -> dict:
    runs: dict[str, list] = {side: [] for side in SIDES}
    ids = {}
    for _ in range(repeats):  # taking turns, so drifting machine load falls on both
        for side in runs:
            m, ids[side] = await measure(gen, side, tasks, concurrency)
            runs[side].append(m)
    best = {side: min(r, key=lambda m: m["seconds"]) for side, r in runs.items()}
    return {**best, "agent_over_env_time": best["agent"]["seconds"] / best["env"]["seconds"],
            "responses_over_env_time": best["responses"]["seconds"] / best["env"]["seconds"],
            "same_token_ids": ids["env"] == ids["agent"] == ids["responses"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    model = cached_model("agent-bench-model", family="qwen3", layers=2, hidden=128, heads=4, kv_heads=2,
                         vocab=4096, seed=0)
    n = 8 if args.smoke else 64 if args.quick else 256
    conc = [1, 8] if args.smoke else [1, 16, 64]
    repeats = 1 if args.smoke else 3
    tasks = make_env("phonebook").sample_tasks(n, seed=0)
    policy = expert_policy(SIDES["env"], tasks)
    out: dict = {"episodes": n, "repeats": repeats, "instant": {}, "engine": {}}
    rows = []
    instant = ScriptedGenerator(Tokenizer(model), policy)
    for c in conc:
        out["instant"][c] = r = asyncio.run(compare(instant, tasks, c, repeats))
        rows.append(("instant", c, r))
    engine = AsyncEngine(model, max_num_seqs=64)
    try:
        forced = ForcedGenerator(engine, policy)
        for c in conc:
            out["engine"][c] = r = asyncio.run(compare(forced, tasks, c, repeats))
            rows.append(("engine", c, r))
    finally:
        engine.shutdown()
    print("| generator | concurrency | built-in env ep/s | OpenAI-SDK agent ep/s, chat / Responses | agent / env time, "
          "chat / Responses | ms per turn (env / chat / Responses) | turns / tokens | same token ids |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for gen, c, r in rows:
        e, a, q = r["env"], r["agent"], r["responses"]
        print(f"| {gen} | {c} | {e['episodes_per_s']:.1f} | {a['episodes_per_s']:.1f} / {q['episodes_per_s']:.1f} | "
              f"{r['agent_over_env_time']:.2f}x / {r['responses_over_env_time']:.2f}x | "
              f"{e['ms_per_turn']:.2f} / {a['ms_per_turn']:.2f} / {q['ms_per_turn']:.2f} | "
              f"{a['turns']} / {a['generated_tokens']} | {r['same_token_ids']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    if not all(r["same_token_ids"] for _, _, r in rows):
        raise SystemExit("the agent's trajectories differ from the built-in env's")


if __name__ == "__main__":
    main()
