"""rollwise's policy: one cost in seconds per replica, the expected time to serve this turn there —
prefill of the part of the prompt it does not hold, plus max_tokens decode steps whose length grows
with the replica's batch (continuous batching: a busier replica decodes every sequence slower),
plus a penalty for KV pressure (a nearly full cache preempts someone to fit what this request adds).
Sibling co-location comes out of the prefix term (a group's first turns share its prompt), and so
does stickiness until the per-token time below is measured. Crowding is charged for the
trajectory's expected remaining turns, since they will follow it. The queue goes
longest-expected-remaining-work first, with aging so nothing starves: a request's virtual arrival
is moved earlier by its remaining work, capped.

Later turns (rebalancing) are priced by the sequence-seconds a move saves, from the
measured per-token time of a sequence running beside n others (alpha + beta * n, the router's
cost model). Moving from a replica where h other trajectories live to one where d live speeds
the mover and its h former co-runners and slows the d, by beta per token each, for the W tokens
the trajectory is still expected to generate: 2 * W * beta * (h - d) sequence-seconds. It costs
recomputing the context there, which the d wait out as well: prefill * (1 + d). The move is made
when the saving beats that by one co-runner's worth (no ping-pong). Siblings' lengths are
correlated, so a replica can end up carrying the step's longest group while others idle; this
is what moves part of it. Load here counts the trajectories living on a replica (in a tool call
or not), since they all come back."""
from __future__ import annotations

from rollwise.router.policies.base import Policy


class Rollwise(Policy):
    name = "rollwise"

    def __init__(self, prefill_tok_s: float = 5000.0, step_s: float = 0.01, per_seq_s: float = 0.0004,
                 turn_s: float = 2.0, max_boost_s: float = 30.0, slack: int = 2,
                 default_turns: float = 4.0, sticky_slack: int = 8, kv_budget: float | None = 0.9,
                 resident_idle_s: float = 600.0, kv_growth_prior: float = 128.0,
                 kv_work_conserving: bool = True, move_tokens: int = 64, overrun: float = 0.25) -> None:
        # leaving a trajectory's home is charged this many prompt tokens more: the prefix index is
        # block-granular, so smaller differences between replicas' cached prefixes are noise
        self.move_tokens = move_tokens
        self.prefill_tok_s, self.step_s, self.per_seq_s, self.slack = prefill_tok_s, step_s, per_seq_s, slack
        self.default_turns, self.sticky_slack = default_turns, sticky_slack
        # KV residency (the router's mechanism): trajectories whose contexts fit kv_budget x a replica's
        # KV capacity keep it; turns of the others wait, so contexts are not evicted and recomputed
        # every turn when the live working set exceeds the KV pool (thrashing control); a new trajectory
        # is admitted only where the residents' contexts still fit after their expected remaining
        # turns, each adding what turns have added so far (EMA; until a turn is seen, kv_growth_prior
        # tokens: about one response and one tool output); an idle replica runs held turns anyway
        self.kv_budget, self.resident_idle_s, self.kv_growth_prior = kv_budget, resident_idle_s, kv_growth_prior
        self.kv_work_conserving = kv_work_conserving
        self.turn_s, self.max_boost_s = turn_s, max_boost_s
        # a trajectory already past its siblings' mean turn count is expected to run for `overrun`
        # times the turns it has done
        self.overrun = overrun
        self.token_time: tuple[float, float] | None = None  # (alpha, beta), measured

    def calibrate(self, s_per_prefill_token: float, s_per_decode_token: float, s_per_step: float,
                  token_time: tuple[float, float] | None = None) -> None:
        """The router's fitted cost model (what the replicas' own counters say time goes to)."""
        if s_per_prefill_token > 0:
            self.prefill_tok_s = 1.0 / s_per_prefill_token
        self.per_seq_s, self.step_s = s_per_decode_token, s_per_step
        if token_time is not None:
            self.token_time = token_time

    def rebalance(self, info, cands) -> str | None:
        """Where a trajectory's next turn goes when it has a home among `cands` and the per-token
        time is known (None otherwise): home, or a replica where moving saves more than it costs."""
        home = next((c for c in cands if c.name == info.sticky), None)
        if home is None or self.token_time is None or info.turns_done == 0:
            return None
        beta = self.token_time[1]
        new = min(info.expected_new_tokens, info.request.params.max_tokens)
        left = info.expected_turns - info.turns_done if info.expected_turns is not None else self.default_turns
        work = new * max(left, self.overrun * info.turns_done, 1.0)

        def lives(c) -> int:  # trajectories living there besides this one
            return max(c.inflight, c.homed - (c is home))
        h = lives(home)
        best, gain = home.name, 0.0
        for c in cands:
            if c is home:
                continue
            d = lives(c)
            g = 2 * work * beta * (h - d - 1) - (info.prompt_len - c.matched) / self.prefill_tok_s * (1 + d)
            if g > gain:
                best, gain = c.name, g
        return best

    def cost(self, info, c, least: int = 0) -> float:
        new = min(info.expected_new_tokens, info.request.params.max_tokens)
        missing = info.prompt_len - c.matched  # prompt tokens this replica must compute and allocate
        moving = info.sticky is not None and c.name != info.sticky
        prefill = (missing + (self.move_tokens if moving else 0)) / self.prefill_tok_s
        # under continuous batching the decode work is the same wherever it runs; what a busier
        # replica costs is its longer steps once it is clearly busier than the least busy one
        # the trajectory's later turns will follow it here (their context is here): a crowded replica
        # slows all of them, while the prefix saving is had once
        slack = self.slack if info.sticky is None else self.sticky_slack  # moving a context costs more
        excess = max(c.inflight + 1 - least - slack, 0)
        left = info.expected_turns - info.turns_done if info.expected_turns is not None else self.default_turns
        decode = new * (self.step_s + self.per_seq_s * excess * max(left, 1.0))
        kv = c.load.kv_usage if c.load is not None else 0.0
        # what it must allocate there (the part of the prompt not held, and its output) may preempt someone
        pressure = max(kv - 0.8, 0.0) / 0.2 * 2.0 * (missing + new) / self.prefill_tok_s
        return prefill + decode + pressure

    def choose(self, info, cands):
        moved = self.rebalance(info, cands)
        if moved is not None:
            return moved
        least = min(c.inflight for c in cands)
        # replicas holding none of the prompt differ only in load and KV pressure: the best of them
        # by those stands for all (keeps the decision cheap at many replicas)
        holders = [c for c in cands if c.matched > 0 or c.name == info.sticky]
        cold = [c for c in cands if c.matched == 0 and c.name != info.sticky]
        if cold:
            holders.append(min(cold, key=lambda c: (c.load is not None and c.load.kv_usage > 0.8, c.inflight, c.name)))
        return min(holders, key=lambda c: (self.cost(info, c, least), c.name != info.sticky, c.inflight, c.name)).name

    def priority(self, info):
        left = (info.expected_turns - info.turns_done) if info.expected_turns is not None else 1.0
        return info.arrival - min(max(left, 0.0) * self.turn_s, self.max_boost_s)

    def park(self, info):
        # a full replica frees a slot within a fraction of a turn (one of its many requests ends);
        # recomputing the context elsewhere costs its whole prefill
        new = min(info.expected_new_tokens, info.request.params.max_tokens)
        return info.prompt_len / self.prefill_tok_s > 0.25 * new * self.step_s
