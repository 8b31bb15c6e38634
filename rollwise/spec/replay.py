"""Offline replay of drafting on real agent text (no model): how many drafted tokens would a greedy
verifier accept, and what does drafting cost?

Every assistant turn is decoded step by step from its recorded tokens: draft from the cache, accept
the longest drafted path that matches the recorded continuation, emit it plus one more token (the
verifier's own), append those to the cache. Siblings (`group_size` trials of one task) run
interleaved, one step each in turn, as GRPO rollouts of one prompt do.

Runs under any Python that has numpy, so the same loop drives ArcticInference's
`SuffixDecodingCache` in the peers venv: `python -m rollwise.spec.replay arctic IN.json OUT.json`,
and vLLM's prompt lookup there (`vllm-ngram`) beside ours (`ngram`).
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass

TURN = tuple[list[int], list[int]]  # (prompt: everything before the turn, response: the turn)


@dataclass
class ReplayParams:
    max_depth: int = 24
    max_spec_tokens: int = 16
    alpha: float = 1.0
    offset: float = 0.0
    min_token_prob: float = 0.1
    tree: bool = False
    max_cached_requests: int = 10000
    lookup_min: int = 5  # prompt lookup (ngram adapters): the n-gram lengths matched
    lookup_max: int = 5


class RollwiseAdapter:
    def __init__(self, p: ReplayParams, use_group_tree: bool = True, backend: str = "cpp") -> None:
        from rollwise.spec.suffix_cache import SuffixCache
        self.p = p
        self.cache = SuffixCache(max_depth=p.max_depth, max_spec_tokens=p.max_spec_tokens, alpha=p.alpha,
                                 offset=p.offset, min_token_prob=p.min_token_prob,
                                 max_cached_requests=p.max_cached_requests, use_group_tree=use_group_tree,
                                 tree=p.tree, backend=backend)

    def start(self, rid, prompt, group):
        self.cache.start_request(rid, prompt, group)

    def append(self, rid, toks):
        self.cache.append(rid, toks)

    def speculate(self, rid, context):
        d = self.cache.speculate(rid)
        return d.token_ids, d.parents

    def stop(self, rid):
        self.cache.stop_request(rid)


class ArcticAdapter:
    def __init__(self, p: ReplayParams) -> None:
        import numpy as np
        from arctic_inference.suffix_decoding import SuffixDecodingCache
        self.np, self.p = np, p
        self.cache = SuffixDecodingCache(max_tree_depth=p.max_depth, max_cached_requests=p.max_cached_requests)

    def start(self, rid, prompt, group):
        self.cache.start_request(rid, self.np.asarray(prompt, dtype=self.np.int32))

    def append(self, rid, toks):
        self.cache.add_active_response(rid, list(toks))

    def speculate(self, rid, context):
        d = self.cache.speculate(rid, self.np.asarray(context[-self.p.max_depth:], dtype=self.np.int32),
                                 max_spec_tokens=self.p.max_spec_tokens, max_spec_factor=self.p.alpha,
                                 max_spec_offset=self.p.offset, min_token_prob=self.p.min_token_prob,
                                 use_tree_spec=self.p.tree)
        return list(d.token_ids), list(d.parents)

    def stop(self, rid):
        self.cache.stop_request(rid)


class NgramAdapter(RollwiseAdapter):
    """rollwise's prompt lookup (rollwise.spec.ngram): the request's own context only (the group
    is taken and not drafted from); the same calls as the suffix cache's."""

    def __init__(self, p: ReplayParams) -> None:
        from rollwise.spec.ngram import NgramCache
        self.p = p
        self.cache = NgramCache(min_n=p.lookup_min, max_n=p.lookup_max, max_spec_tokens=p.max_spec_tokens)


class VllmNgramAdapter:
    """vLLM's own prompt-lookup function (the peers venv), on the whole context each step, kept in
    an int32 row as its proposer keeps token_ids_cpu."""

    def __init__(self, p: ReplayParams) -> None:
        import numpy as np
        from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as find
        self.np, self.p, self.find, self.rows = np, p, find, {}

    def start(self, rid, prompt, group):
        self.rows[rid] = (self.np.asarray(prompt, dtype=self.np.int32), len(prompt))

    def append(self, rid, toks):
        row, n = self.rows[rid]
        if n + len(toks) > len(row):
            row = self.np.concatenate([row[:n], self.np.empty(max(len(toks), n), dtype=self.np.int32)])
        row[n:n + len(toks)] = toks
        self.rows[rid] = (row, n + len(toks))

    def speculate(self, rid, context):
        row, n = self.rows[rid]
        got = self.find(row[:n], self.p.lookup_min, self.p.lookup_max, 1 << 30, self.p.max_spec_tokens).tolist()
        return got, list(range(-1, len(got) - 1))

    def stop(self, rid):
        self.rows.pop(rid, None)


def accept(draft: list[int], parents: list[int], truth: list[int]) -> int:
    """Draft tokens a greedy verifier accepts when the target continues with `truth`."""
    node, n = -1, 0
    while n < len(truth):
        nxt = next((i for i, p in enumerate(parents) if p == node and draft[i] == truth[n]), None)
        if nxt is None:
            break
        node, n = nxt, n + 1
    return n


def replay(adapter, groups: list[list[list[TURN]]]) -> dict:
    """groups: list of sibling sets; each sibling is a trajectory (its turns in order)."""
    steps = tokens = accepted = drafted = calls = appended = prompt_tokens = 0
    t_spec = t_app = t_start = 0.0
    rss0 = rss_mb()
    for g, siblings in enumerate(groups):
        cursors = [[0, 0] for _ in siblings]  # (turn index, position in the response)
        live = [i for i, s in enumerate(siblings) if s]
        for i in live:
            t0 = time.perf_counter()
            adapter.start(f"{g}.{i}.0", siblings[i][0][0], f"g{g}")
            t_start += time.perf_counter() - t0
            prompt_tokens += len(siblings[i][0][0])
        while live:
            for i in list(live):
                turn_i, pos = cursors[i]
                prompt, resp = siblings[i][turn_i]
                rid = f"{g}.{i}.{turn_i}"
                t0 = time.perf_counter()
                draft, parents = adapter.speculate(rid, prompt + resp[:pos])
                t_spec += time.perf_counter() - t0
                calls += 1
                a = accept(draft, parents, resp[pos:])
                emit = resp[pos:pos + a + 1]
                t0 = time.perf_counter()
                adapter.append(rid, emit)
                t_app += time.perf_counter() - t0
                steps, tokens, accepted, drafted = steps + 1, tokens + len(emit), accepted + min(a, len(emit)), drafted + len(draft)
                appended += len(emit)
                cursors[i][1] = pos + len(emit)
                if cursors[i][1] >= len(resp):
                    adapter.stop(rid)
                    cursors[i] = [turn_i + 1, 0]
                    if turn_i + 1 < len(siblings[i]):
                        t0 = time.perf_counter()
                        adapter.start(f"{g}.{i}.{turn_i + 1}", siblings[i][turn_i + 1][0], f"g{g}")
                        t_start += time.perf_counter() - t0
                        prompt_tokens += len(siblings[i][turn_i + 1][0])
                    else:
                        live.remove(i)
    return {"steps": steps, "tokens": tokens, "accepted": accepted, "drafted": drafted,
            "mean_accepted_per_step": accepted / max(steps, 1), "tokens_per_step": tokens / max(steps, 1),
            "us_per_speculate": 1e6 * t_spec / max(calls, 1), "us_per_appended_token": 1e6 * t_app / max(appended, 1),
            "us_per_prompt_token": 1e6 * t_start / max(prompt_tokens, 1), "rss_growth_mb": rss_mb() - rss0}


def rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return 0.0


ADAPTERS = {"arctic": lambda p: ArcticAdapter(p),
            "rollwise": lambda p: RollwiseAdapter(p, use_group_tree=False),
            "rollwise+group": lambda p: RollwiseAdapter(p, use_group_tree=True),
            "ngram": NgramAdapter, "vllm-ngram": VllmNgramAdapter}


def _main(argv: list[str]) -> None:
    """ADAPTER IN.json OUT.json: one replay in a fresh process (so memory growth is its own)."""
    if len(argv) != 3 or argv[0] not in ADAPTERS:
        raise SystemExit(f"usage: python -m rollwise.spec.replay {{{','.join(ADAPTERS)}}} IN.json OUT.json")
    spec = json.loads(open(argv[1]).read())
    p = ReplayParams(**spec["params"])
    groups = [[[(t[0], t[1]) for t in traj] for traj in sib] for sib in spec["groups"]]
    res = replay(ADAPTERS[argv[0]](p), groups)
    with open(argv[2], "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    _main(sys.argv[1:])
