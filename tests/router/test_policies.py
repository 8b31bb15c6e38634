"""Placement rules of every policy, on synthetic candidates."""
from __future__ import annotations

import pytest

from rollwise.router.policies import POLICIES, Candidate, RouteInfo, make_policy
from rollwise.router.replica import LoadSnapshot
from rollwise.types import GenerateRequest, SamplingParams


def info(prompt_len=100, sticky=None, turns_done=0, expected=None, arrival=0.0):
    req = GenerateRequest(prompt_token_ids=[1] * prompt_len, params=SamplingParams(max_tokens=50))
    return RouteInfo(request=req, prompt_len=prompt_len, arrival=arrival, sticky=sticky, turns_done=turns_done,
                     expected_turns=expected)


def cand(name, inflight=0, tokens=0, matched=0, assigned=0, tps=0.0, kv=0.0, homed=0):
    return Candidate(name, inflight, tokens, matched, LoadSnapshot(tokens_per_s=tps, kv_usage=kv), assigned, homed)


def test_round_robin_cycles():
    p = make_policy("round_robin")
    cs = [cand("a"), cand("b"), cand("c")]
    assert [p.choose(info(), cs) for _ in range(4)] == ["a", "b", "c", "a"]


def test_least_load_and_sticky_variants():
    cs = [cand("a", inflight=5), cand("b", inflight=2)]
    assert make_policy("least_load").choose(info(sticky="a"), cs) == "b"
    assert make_policy("sticky_least_load").choose(info(sticky="a"), cs) == "a"
    assert make_policy("sticky_least_load").choose(info(), cs) == "b"
    verl = make_policy("verl")
    assert verl.choose(info(sticky="a"), cs) == "a"
    assert verl.choose(info(), [cand("a", inflight=0, assigned=9), cand("b", inflight=50, assigned=3)]) == "b"


def test_sglang_cache_aware_rules():
    p = make_policy("sglang_cache_aware")
    assert p.choose(info(), [cand("a", inflight=100, matched=100), cand("b", inflight=10)]) == "b"  # imbalanced
    assert p.choose(info(), [cand("a", inflight=5, matched=40), cand("b", inflight=1)]) == "a"  # 40% match
    assert p.choose(info(), [cand("a", inflight=5, matched=20), cand("b", inflight=1)]) == "b"  # 20%: least load


def test_dynamo_counts_uncached_prefill_and_active_blocks():
    p = make_policy("dynamo")
    assert p.choose(info(prompt_len=320), [cand("a", matched=320, tokens=160), cand("b", tokens=0)]) == "a"
    assert p.choose(info(prompt_len=320), [cand("a", matched=320, tokens=800), cand("b", tokens=0)]) == "b"


def test_rollwise_moves_only_when_waiting_costs_more_than_recomputing():
    p = make_policy("rollwise", prefill_tok_s=1000.0, step_s=0.01, per_seq_s=0.001)
    # 2000 cached tokens at home save 2 s of prefill; 50 decode steps there are slower by 0.001 s per extra sequence
    last = dict(prompt_len=2000, sticky="a", turns_done=4, expected=5)  # its last turn
    assert p.choose(info(**last), [cand("a", inflight=20, matched=2000), cand("b")]) == "a"
    assert p.choose(info(**last), [cand("a", inflight=60, matched=2000), cand("b")]) == "b"
    # with many turns still to come, crowding weighs more: the same 20-sequence excess now moves it
    assert p.choose(info(prompt_len=2000, sticky="a", turns_done=0, expected=10),
                    [cand("a", inflight=20, matched=2000), cand("b")]) == "b"
    # a nearly full KV cache costs extra
    assert p.choose(info(prompt_len=100), [cand("a", kv=0.99), cand("b", inflight=2)]) == "b"
    # queue order: more expected work left goes first, but waiting long enough wins
    assert p.priority(info(turns_done=1, expected=10, arrival=5.0)) < p.priority(info(turns_done=9, expected=10, arrival=5.0))
    assert p.priority(info(turns_done=9, expected=10, arrival=0.0)) < p.priority(info(turns_done=0, expected=50, arrival=100.0))


def test_rollwise_rebalances_a_crowded_home_by_measured_per_token_time():
    p = make_policy("rollwise", prefill_tok_s=10_000.0)
    # 20k tokens of context at home: 2 s to recompute elsewhere; 50 tokens a turn, 40 turns left
    turn = dict(prompt_len=20_000, sticky="a", turns_done=10, expected=50)
    crowded = [cand("a", inflight=3, matched=20_000, homed=8), cand("b", homed=1), cand("c", homed=3)]
    assert p.choose(info(**turn), crowded) == "a"  # per-token time not measured yet: stays
    p.calibrate(1e-4, 1e-4, 0.01, token_time=(0.005, 0.001))
    # 7 others live at home, 1 on b: 2 * 2000 tokens * 1 ms * (7 - 1 - 1) = 20 s saved > 2 s * (1 + 1)
    assert p.choose(info(**turn), crowded) == "b"
    # in a tool call or not, trajectories living on a replica count: b now hosts 5 (only 1 in flight)
    assert p.choose(info(**turn), [cand("a", inflight=3, matched=20_000, homed=8), cand("b", inflight=1, homed=5)]) == "a"
    # a busy destination makes its runners wait out the prefill: 2 s * (1 + 6) > 2 * 2000 * 1 ms * (7 - 6 - 1)
    assert p.choose(info(**turn), [cand("a", inflight=7, matched=20_000, homed=8), cand("b", inflight=6)]) == "a"
    # one turn left (and not past its siblings' mean): 2 * 50 * 1 ms * 5 = 0.5 s < 4 s
    assert p.choose(info(prompt_len=20_000, sticky="a", turns_done=2, expected=3), crowded) == "a"
    # past its siblings' mean it is expected to go on for a quarter of its turns so far: 60 turns -> 15
    assert p.choose(info(prompt_len=20_000, sticky="a", turns_done=60, expected=50), crowded) == "b"
    # a first turn has no home: the cost places it, by the prompt a holds (siblings co-locate)
    assert p.choose(info(prompt_len=20_000), crowded) == "a"


def test_war_switches_rules_with_load():
    p = make_policy("war", capacity=10, load_threshold=0.5)
    low = [cand("a", inflight=1), cand("b", inflight=0, matched=100)]
    assert p.choose(info(sticky="a"), low) == "a"  # low load: sticky
    high = [cand("a", inflight=9), cand("b", inflight=8, matched=100)]
    assert p.choose(info(sticky="a"), high) == "b"  # high load: best cache hit


def test_war_measures_load_against_what_its_router_sends_a_replica():
    from rollwise.router.router import Router

    class _R:
        def __init__(self, name):
            self.name = name
    p = Router([_R("a"), _R("b")], "war", max_inflight_per_replica=8).policy
    assert p.capacity == 8  # not a fixed default: 2 replicas x 8 slots, high load above 8 in flight
    mid = [cand("a", inflight=5), cand("b", inflight=4, matched=100)]
    assert p.choose(info(sticky="a"), mid) == "b"  # 9 > 0.5 x 8 x 2: high load
    assert Router([_R("a")], make_policy("war", capacity=100), max_inflight_per_replica=8).policy.capacity == 100


def test_every_policy_is_registered_and_bad_names_fail():
    assert set(POLICIES) == {"round_robin", "least_load", "verl", "sticky_least_load", "sglang_cache_aware", "dynamo",
                             "war", "rollwise"}
    with pytest.raises(ValueError, match="rollwise"):
        make_policy("random")
