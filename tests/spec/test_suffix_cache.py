"""SuffixCache policy: sources, in-flight siblings, eviction, and backend equivalence."""
from __future__ import annotations

import random

import pytest

from rollwise.spec.suffix_cache import SuffixCache


@pytest.mark.parametrize("backend", ["cpp", "python"])
def test_in_flight_sibling_drafts_for_another(backend):
    c = SuffixCache(backend=backend, alpha=4.0, max_spec_tokens=8, min_token_prob=0.0)
    prompt = [1, 2, 3]
    c.start_request("a", prompt, group_id="g")
    c.start_request("b", prompt, group_id="g")
    c.append("a", [10, 11, 12, 13, 14, 15])  # a is still running
    c.append("b", [10, 11])
    d = c.speculate("b")
    assert d.token_ids[:4] == [12, 13, 14, 15] and d.source in ("group", "global")
    c.check_integrity()


@pytest.mark.parametrize("backend", ["cpp", "python"])
def test_a_scope_drafts_from_its_own_global_tree_which_goes_when_nothing_holds_it(backend):
    """A scoped request (a cache salt) drafts from its scope's requests only, and feeds them only; the
    bound on cached requests counts every scope's; a scope's tree outlives its cached sequences while
    a request of the scope is active (the native requests point at it), then goes."""
    c = SuffixCache(backend=backend, alpha=4.0, max_spec_tokens=4, min_token_prob=0.0, max_cached_requests=2)
    c.start_request("a", [5], scope="s")
    c.append("a", [6, 7, 8, 9, 10])  # (responses go into the global trees, prompts do not)
    c.stop_request("a")
    c.start_request("b", [5, 6, 7], scope="s")
    d = c.speculate("b")
    assert d.token_ids == [8, 9, 10] and d.source == "global"
    c.start_request("u", [5, 6, 7])  # unscoped: the common tree holds no "s" request
    c.start_request("t", [5, 6, 7], scope="t")  # another scope: nor does its tree
    assert c.speculate("u").token_ids == [] and c.speculate("t").token_ids == []
    assert set(c._scopes) == {"s", "t"} and list(c._cached) == [2, 3]  # a and b evicted: the bound is over all
    c.append_batch({"b": [1, 2], "u": [1, 2], "t": [1, 2]})  # b feeds no tree now but its own
    assert c.speculate("b").token_ids == [] and "s" in c._scopes  # its scope's tree, empty, kept for b
    c.check_integrity()
    c.stop_request("b")
    assert "s" not in c._scopes and "t" in c._scopes  # nothing holds "s"; "t" holds t
    c.check_integrity()


def test_group_tree_beats_diluted_global_tree():
    c = SuffixCache(alpha=4.0, max_spec_tokens=4, min_token_prob=0.0)
    for i in range(6):  # many other requests continue "7 8" differently
        c.start_request(f"o{i}", [0], group_id=f"other{i}")
        c.append(f"o{i}", [7, 8, 100 + i, 200 + i])
        c.stop_request(f"o{i}")
    c.start_request("a", [0], group_id="g")
    c.append("a", [7, 8, 9, 9])
    c.stop_request("a")
    c.start_request("b", [0], group_id="g")
    c.append("b", [7, 8])
    d = c.speculate("b")
    assert d.source == "group" and d.token_ids[:2] == [9, 9]


def test_request_tree_drafts_from_its_own_prompt():
    c = SuffixCache(alpha=2.0, max_spec_tokens=6)
    c.start_request("r", [5, 6, 7, 8, 9, 10, 1, 2])
    c.append("r", [5, 6, 7])
    d = c.speculate("r")
    assert d.source == "request" and d.token_ids[:3] == [8, 9, 10]


@pytest.mark.parametrize("eviction", ["fifo", "lru"])
def test_global_cache_is_bounded(eviction):
    c = SuffixCache(max_cached_requests=3, eviction=eviction, alpha=4.0, min_token_prob=0.0)
    for i in range(5):
        c.start_request(f"r{i}", [0], group_id="g" if i == 0 else None)
        c.append(f"r{i}", [50 + i, 60 + i, 70 + i])
        c.stop_request(f"r{i}")
        c.check_integrity()
    assert len(c._cached) == 3
    c.start_request("q", [1], group_id="zz")
    c.append("q", [50])
    assert c.speculate("q").token_ids == []  # r0's response was evicted (group "g" was not refreshed)
    c.append("q", [53])
    assert c.speculate("q").token_ids[:1] == [63]


@pytest.mark.parametrize("seed", range(4))
def test_backends_agree_on_random_workloads(seed):
    """Random starts, stops, appends and drafts (scoped ones too: a scope's tree comes and goes while
    the bound of 5 evicts) give the same drafts from the C++ core as from the Python trees."""
    rng = random.Random(seed)
    caches = [SuffixCache(backend=b, max_cached_requests=5, alpha=2.0, max_spec_tokens=6) for b in ("cpp", "python")]
    live: list[str] = []
    for step in range(300):
        op = rng.random()
        if op < 0.2 or not live:
            rid = f"r{step}"
            prompt = [rng.randrange(8) for _ in range(rng.randint(1, 6))]
            g, scope = rng.choice([None, "a", "b"]), rng.choice([None, None, "s", "t"])
            for c in caches:
                c.start_request(rid, prompt, g, scope=scope)
            live.append(rid)
        elif op < 0.25:
            toks, g, scope = [rng.randrange(8) for _ in range(rng.randint(1, 8))], rng.choice([None, "a"]), \
                rng.choice([None, "s", "u"])
            for c in caches:
                c.add_sequence(toks, g, scope=scope)
        elif op < 0.3:
            rid = live.pop(rng.randrange(len(live)))
            for c in caches:
                c.stop_request(rid)
        elif op < 0.7:
            batch = {r: [rng.randrange(8) for _ in range(rng.randint(1, 3))] for r in rng.sample(live, min(3, len(live)))}
            for c in caches:
                c.append_batch(batch)
        else:
            tree = rng.random() < 0.5
            a, b = (c.speculate_batch(live, 6, tree=tree) for c in caches)
            assert [(d.token_ids, d.parents, d.source) for d in a] == [(d.token_ids, d.parents, d.source) for d in b]
        if step % 25 == 0:
            for c in caches:
                c.check_integrity()
    for c in caches:
        c.check_integrity()


def test_bad_options_name_the_valid_ones():
    with pytest.raises(ValueError, match="fifo"):
        SuffixCache(eviction="random")
    with pytest.raises(ValueError, match="cpp"):
        SuffixCache(backend="rust")
