"""Workloads for the simulator, stored compactly: a trajectory is its final token list plus turn
boundaries (turn k's prompt is tokens[:prompt_end], its response tokens[prompt_end:response_end]);
prompts are sliced only when a turn is sent, so hundreds of 40k-token trajectories fit in memory.

- `war_step`: WAR's setting, SWE-like (P prompts x n rollouts; a long task context shared by the
  siblings; many turns whose count depends on the task; long tool outputs; heavy-tailed tool
  latency) with token content from real agent trajectories: responses are real assistant messages
  and observations real tool/user messages of the same task's recorded trials (siblings draw them in
  different orders), so suffix drafting meets real repetition, not random tokens.
- `from_replay`: the router benchmark's steps (`rollwise.router.workload`), for validation.
- `mooncake_step`: the Mooncake FAST'25 traces; `hash_ids` (512-token blocks, chained) become token
  blocks, so requests that share hash ids share prefixes; sessions are chains of prefix extension.
"""
from __future__ import annotations

import itertools
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class SimTrajectory:
    trajectory_id: str
    group_id: str
    tokens: list[int]
    turns: list[tuple[int, int]]  # (prompt_end, response_end) per turn
    tool_latency: list[float] = field(default_factory=list)  # seconds after each turn but the last
    arrival_s: float = 0.0  # when its first turn is released

    @property
    def decode_tokens(self) -> int:
        return sum(r - p for p, r in self.turns)

    def turn(self, k: int) -> tuple[list[int], list[int]]:
        p, r = self.turns[k]
        return self.tokens[:p], self.tokens[p:r]


def from_replay(step) -> list[SimTrajectory]:
    """`ReplayTrajectory`s (each turn's prompt extends the previous turn's) to the compact form."""
    out = []
    for t in step:
        last_p, last_r = t.turns[-1]
        tokens = last_p + last_r
        spans = []
        for p, r in t.turns:
            if tokens[:len(p)] != p or tokens[len(p):len(p) + len(r)] != r:
                raise ValueError(f"{t.trajectory_id}: a turn's prompt does not extend the previous turn")
            spans.append((len(p), len(p) + len(r)))
        out.append(SimTrajectory(t.trajectory_id, t.group_id, tokens, spans, list(t.tool_latency)))
    return out


def task_pool(groups) -> list[list[list[tuple[list[int], list[int]]]]]:
    """Per task its recorded trials, each a list of (response, observation) pairs in order: the
    observation is what was appended after the response (tool output, user reply)."""
    pool = []
    for trials in groups:
        task = []
        for turns in trials:
            pairs = [(r, p2[len(p) + len(r):]) for (p, r), (p2, _) in zip(turns, turns[1:])]
            pairs.append((turns[-1][1], []))
            task.append(pairs)
        if task:
            pool.append(task)
    if not pool:
        raise ValueError("no trials to build a workload from")
    return pool


def war_step(pool, num_prompts: int, group_size: int = 8, *, seed: int = 0, context: tuple[int, int] = (2048, 8192),
             turns: tuple[int, int] = (10, 50), obs_median: int = 400, obs_max: int = 4096, max_response: int = 512,
             latency: tuple[float, float] = (0.2, 10.0), tool_scale: float = 1.0, max_turns: int = 120,
             vocab: int = 8192) -> list[SimTrajectory]:
    """Sibling s of prompt g replays recorded trials in a stream of its own: trial s of task g first
    (siblings 0..n-1 are the task's real trials), then trials of other tasks. The recordings are
    fewer than a big step's turns, so a trial replayed again in the same step is replayed in another
    "token universe" (ids mapped by a bijection): it keeps its own repetition structure but cannot
    match its other copies, so drafting and prefix caching gain nothing from the reuse. Observations
    are real too, lengthened with the stream's next observations to a heavy-tailed SWE-like length.
    `tool_scale` multiplies every tool latency after it is drawn (0: instant tools), so steps that
    differ only in it have the same tokens and turns."""
    rng = random.Random(seed)
    uses: dict[tuple[int, int], int] = {}
    out = []
    for g in range(num_prompts):
        task = pool[g % len(pool)]
        shared = [t for seg in (task[0][0][0], *(o for _, o in task[0])) for t in seg] if task[0] else []
        target = rng.randint(*context)
        k = 1
        while len(shared) < target:  # the task's files and issue text: real text from the task's neighbours
            shared += [t for _, o in pool[(g + k) % len(pool)][0] for t in o]
            k += 1
        shared = _universe(shared[:target], g // len(pool), vocab)  # a repeated task is another prompt
        typical = rng.randint(*turns)
        for s in range(group_size):
            n = max(2, min(max_turns, round(typical * rng.uniform(0.6, 1.4))))
            stream = _stream(pool, g, s, uses, vocab)
            tokens, spans, lat = list(shared), [], []
            for k in range(n):
                r, o = next(stream)
                r = r[:max_response] or [1]
                spans.append((len(tokens), len(tokens) + len(r)))
                tokens += r
                if k < n - 1:
                    want = max(1, min(obs_max, int(obs_median * math.exp(rng.gauss(0.0, 0.8)))))
                    obs = list(o)
                    while len(obs) < want:
                        obs += next(stream)[1]
                    tokens += obs[:want]
                    lo, hi = latency  # heavy tail: log-uniform between the bounds
                    lat.append(tool_scale * math.exp(rng.uniform(math.log(lo), math.log(hi))))
            out.append(SimTrajectory(f"g{g}/s{s}", f"g{g}", tokens, spans, lat))
    return out


def _universe(tokens: list[int], u: int, vocab: int) -> list[int]:
    if u == 0:
        return tokens
    a, b = 2 * (1000 + 37 * u) + 1, 7919 * u  # odd multiplier: a bijection modulo a power-of-two vocab
    return [(a * t + b) % vocab for t in tokens]


def _stream(pool, g: int, s: int, uses: dict, vocab: int):
    n_trials = max(len(t) for t in pool)
    first = g + (s // n_trials) * (len(pool) // 2)
    for j in itertools.count():
        t = (first + j) % len(pool)
        trial = s % len(pool[t])
        u = uses.get((t, trial), 0)
        uses[(t, trial)] = u + 1
        for r, o in pool[t][trial]:
            yield _universe(r, u, vocab), _universe(o, u, vocab)


def synthetic_scale(num_trajectories: int, group_size: int = 8, *, seed: int = 0, vocab: int = 50_000,
                    context: tuple[int, int] = (512, 2048), turns: tuple[int, int] = (2, 8),
                    response: tuple[int, int] = (32, 256), obs: tuple[int, int] = (32, 512),
                    latency: tuple[float, float] = (0.2, 10.0)) -> list[SimTrajectory]:
    """A cluster-sized step for the simulator's own speed: random tokens, a shared context per group."""
    rng = random.Random(seed)
    out = []
    for g in range(-(-num_trajectories // group_size)):
        shared = [rng.randrange(100, vocab) for _ in range(rng.randint(*context))]
        for s in range(min(group_size, num_trajectories - g * group_size)):
            tokens, spans, lat = list(shared), [], []
            n = rng.randint(*turns)
            for k in range(n):
                r = [rng.randrange(100, vocab) for _ in range(rng.randint(*response))]
                spans.append((len(tokens), len(tokens) + len(r)))
                tokens += r
                if k < n - 1:
                    tokens += [rng.randrange(100, vocab) for _ in range(rng.randint(*obs))]
                    lat.append(math.exp(rng.uniform(math.log(latency[0]), math.log(latency[1]))))
            out.append(SimTrajectory(f"g{g}/s{s}", f"g{g}", tokens, spans, lat))
    return out


def mooncake_step(path: str | Path, *, limit: int | None = None, block: int = 512, time_scale: float = 1.0,
                  vocab: int = 50_000) -> list[SimTrajectory]:
    """Each trace request as a one-turn trajectory released at its timestamp; hash id h becomes a
    fixed block of `block` pseudo-random tokens, so equal hash-id prefixes are equal token prefixes."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()[:limit] if line.strip()]
    blocks: dict[int, list[int]] = {}

    def tokens_of(h: int) -> list[int]:
        if h not in blocks:
            r = random.Random(h)
            blocks[h] = [r.randrange(100, vocab) for _ in range(block)]
        return blocks[h]
    out = []
    for i, row in enumerate(rows):
        n_in, n_out = int(row["input_length"]), max(int(row["output_length"]), 1)
        prompt = [t for h in row["hash_ids"] for t in tokens_of(h)][:n_in]
        if len(prompt) < n_in:  # the last block is partial in the trace; pad deterministically
            r = random.Random(f"pad{i}")
            prompt += [r.randrange(100, vocab) for _ in range(n_in - len(prompt))]
        r = random.Random(f"out{i}")
        tokens = prompt + [r.randrange(100, vocab) for _ in range(n_out)]
        out.append(SimTrajectory(f"m{i}", f"m{row['hash_ids'][0] if row['hash_ids'] else i}", tokens,
                                 [(n_in, n_in + n_out)], [], row["timestamp"] / 1000.0 * time_scale))
    return out


def tau_groups(path: str | Path | None = None, vocab: int = 8192) -> list:
    """The public tau-bench trajectories as token ids (a BPE trained here, as make-model's), grouped by
    task: per task its trials, each a list of (prompt ids, response ids) turns."""
    from collections import defaultdict

    from rollwise.make_model import train_tokenizer
    from rollwise.spec.bench import default_data
    tok = train_tokenizer(vocab)
    by_task: dict[str, list] = defaultdict(list)
    for line in Path(path or default_data()).read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        segs = [tok.encode(f"<|{m['role']}|>\n{m.get('content') or ''}\n").ids for m in row["turns"]]
        turns, ctx = [], []
        for m, seg in zip(row["turns"], segs):
            if m["role"] == "assistant" and seg:
                turns.append((list(ctx), seg))
            ctx += seg
        if turns:
            by_task[row["id"].rsplit("/", 1)[0]].append(turns)
    return list(by_task.values())
