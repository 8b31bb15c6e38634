"""A synchronous agentic-RL step as a workload: P prompts x n siblings released together, each a
multi-turn trajectory whose turns are replayed (recorded prompt and response tokens) with tool
latency between turns. Turn counts and lengths vary within and between groups as in real data.

`replayed_step` takes the turns from real agent trajectories (the trials of a task are the
siblings); `swe_step` builds SWE-like groups (a long task context shared by the siblings, many
turns with long tool outputs, turn counts that depend on the task); `synthetic_step` builds
trajectories with no shared prefixes (a control workload).
"""
from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

from rollwise.types import GenerateRequest, SamplingParams


@dataclass
class ReplayTrajectory:
    trajectory_id: str
    group_id: str
    turns: list[tuple[list[int], list[int]]]  # (prompt ids, response ids); each prompt extends the last
    tool_latency: list[float] = field(default_factory=list)  # seconds after each turn but the last
    arrival_s: float = 0.0  # when its first turn is released

    def turn(self, k: int) -> tuple[list[int], list[int]]:
        return self.turns[k]


def replayed_step(groups: list[list[list[tuple[list[int], list[int]]]]], *, max_turns: int, max_response: int,
                  latency: tuple[float, float], seed: int = 0) -> list[ReplayTrajectory]:
    rng = random.Random(seed)
    out = []
    for g, sibs in enumerate(groups):
        for s, turns in enumerate(sibs):
            turns = [(p, r[:max_response]) for p, r in turns[:max_turns] if r]
            if turns:
                out.append(ReplayTrajectory(f"g{g}/s{s}", f"g{g}", turns, [rng.uniform(*latency) for _ in turns[1:]]))
    return out


def synthetic_step(num_groups: int, group_size: int, *, vocab: int, seed: int = 0, prompt_len: int = 300,
                   turns: tuple[int, int] = (2, 5), response: tuple[int, int] = (16, 64), obs: int = 48,
                   latency: tuple[float, float] = (0.05, 0.5)) -> list[ReplayTrajectory]:
    """Control workload: every trajectory has its own random prompt (no sharing between siblings)."""
    rng = random.Random(seed)
    out = []
    for g in range(num_groups):
        for s in range(group_size):
            ctx = [rng.randrange(100, vocab) for _ in range(prompt_len)]
            ts = []
            for _ in range(rng.randint(*turns)):
                resp = [rng.randrange(100, vocab) for _ in range(rng.randint(*response))]
                ts.append((list(ctx), resp))
                ctx = ctx + resp + [rng.randrange(100, vocab) for _ in range(obs)]
            out.append(ReplayTrajectory(f"g{g}/s{s}", f"g{g}", ts, [rng.uniform(*latency) for _ in ts[1:]]))
    return out


def swe_step(num_groups: int, group_size: int, *, vocab: int, seed: int = 0, context: tuple[int, int] = (1024, 2048),
             turns: tuple[int, int] = (2, 10), response: tuple[int, int] = (16, 96), obs: tuple[int, int] = (32, 256),
             latency: tuple[float, float] = (0.05, 0.5)) -> list[ReplayTrajectory]:
    """SWE-like step (WAR's setting in miniature): each prompt is a long task context (issue text and
    repository files) shared by its siblings; each sibling then takes its own path of tool calls
    with long observations. A task's difficulty sets its typical turn count; siblings vary around it."""
    rng = random.Random(seed)
    out = []
    for g in range(num_groups):
        shared = [rng.randrange(100, vocab) for _ in range(rng.randint(*context))]
        typical = rng.randint(*turns)
        for s in range(group_size):
            ctx = list(shared)
            ts = []
            for _ in range(max(turns[0], min(turns[1], typical + rng.randint(-2, 2)))):
                resp = [rng.randrange(100, vocab) for _ in range(rng.randint(*response))]
                ts.append((list(ctx), resp))
                ctx = ctx + resp + [rng.randrange(100, vocab) for _ in range(rng.randint(*obs))]
            out.append(ReplayTrajectory(f"g{g}/s{s}", f"g{g}", ts, [rng.uniform(*latency) for _ in ts[1:]]))
    return out


async def run_step(generator, trajectories, ttl_s: float | None = None, bar=None) -> dict:
    """Release every trajectory (at its `arrival_s`); each runs its turns in order (forced to the
    recorded tokens: `t.turn(k)` gives prompt and response ids) with its tool latency in between, and
    ends with `end_trajectory` when the generator has one (the router). A turn that waited longer
    than `ttl_s` (a sandbox's time to live) ends its trajectory there. Returns makespan, turn
    latencies, the work done and the step's critical path: the trajectory that ended last, with
    its makespan split into arrival, tool time and generation (its turns' latencies, queueing
    included); time is the running loop's (virtual under the simulator)."""
    loop = asyncio.get_running_loop()
    lat: list[float] = []
    acc = {"turns": 0, "decode_tokens": 0, "truncated": 0}
    last: dict = {}

    async def one(t) -> None:
        if t.arrival_s > 0:
            await asyncio.sleep(t.arrival_s)
        done, gen_s, tool_s = 0, 0.0, 0.0
        for k in range(len(t.turns)):
            prompt, resp = t.turn(k)
            t0 = loop.time()
            await generator.generate(GenerateRequest(
                prompt_token_ids=prompt, params=SamplingParams(temperature=0, max_tokens=len(resp), ignore_eos=True),
                trajectory_id=t.trajectory_id, group_id=t.group_id, turn=k, forced_output=resp))
            lat.append(loop.time() - t0)
            gen_s += lat[-1]
            acc["turns"] += 1
            acc["decode_tokens"] += len(resp)
            done = k + 1
            if bar is not None:
                bar.update(1)
            if ttl_s and lat[-1] > ttl_s and k < len(t.turns) - 1:
                acc["truncated"] += 1
                break
            if k < len(t.tool_latency):
                await asyncio.sleep(t.tool_latency[k])
                tool_s += t.tool_latency[k]
        # the loop's clock only moves forward: whoever finishes now is the latest so far
        last.update(trajectory_id=t.trajectory_id, arrival_s=t.arrival_s, tool_s=tool_s, generate_s=gen_s, turns=done)
        end = getattr(generator, "end_trajectory", None)
        if end is not None:
            await end(t.trajectory_id, t.group_id, [], done)

    t0 = loop.time()
    await asyncio.gather(*(one(t) for t in trajectories))
    lat.sort()
    return {"makespan_s": loop.time() - t0, **acc,
            "p99_turn_latency_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else 0.0,
            "mean_turn_latency_s": sum(lat) / max(len(lat), 1),
            "last": last}
