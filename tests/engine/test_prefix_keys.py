"""What keys the prefix cache: vLLM's `cache_salt` (a request's KV is shared only with requests of
the same salt, and it drafts only from them) and its hash algorithm; outputs never change."""
from __future__ import annotations

import random

import pytest

from rollwise import LLM, SamplingParams
from rollwise.config import EngineConfig
from rollwise.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _prompt(seed: int, n: int = 70) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


def _salted(p: list[int], salt: str | None) -> dict:
    return {"prompt_token_ids": p} | ({} if salt is None else {"cache_salt": salt})


def test_kv_is_shared_only_within_a_salt_and_outputs_do_not_change(model_dir):
    llm = LLM(model_dir, block_size=16)
    p = _prompt(0)
    full = len(p) // 16 * 16
    ref = llm.generate([p], GREEDY)[0]
    cached = {}
    for salt in ("a", "a", "b", None, "a"):  # "a" first computes its own copy of the prompt
        out = llm.generate(_salted(p, salt), GREEDY)[0]
        assert out.token_ids == ref.token_ids and out.logprobs == pytest.approx(ref.logprobs, abs=1e-5)
        cached.setdefault(salt, []).append(out.num_cached_tokens)
    assert cached == {"a": [0, full, full], "b": [0], None: [full]}
    # a salted turn's next turn (prompt + output + more) finds its whole context under the same salt only
    turn2 = p + ref.token_ids + _prompt(1, 20)
    assert llm.generate(_salted(turn2, "a"), GREEDY)[0].num_cached_tokens == (len(p) + len(ref.token_ids)) // 16 * 16
    assert llm.generate(_salted(turn2, "c"), GREEDY)[0].num_cached_tokens == 0
    # the engine's API too, and the siblings of a salted group share their prompt
    eng = llm.engine
    outs = llm.generate(_salted(_prompt(2), "d"), GREEDY, n=4)
    assert sorted(o.num_cached_tokens for o in outs) == [0] + [full] * 3
    rid = eng.add_request(p, GREEDY, cache_salt="a")
    while not (done := [o for o in eng.step() if o.finished]):
        pass
    assert done[0].request_id == rid and done[0].num_cached_tokens == full
    eng.scheduler.check_integrity()


def test_bad_salts_and_prompt_dicts_are_refused_and_nothing_is_queued(model_dir):
    llm = LLM(model_dir)
    for bad in ("", 5, b"x"):
        with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
            llm.generate([_prompt(0, 10), {"prompt_token_ids": _prompt(1, 10), "cache_salt": bad}], GREEDY)
    for bad in ({"prompt": "hi", "prompt_token_ids": [5]}, {}, {"prompt_token_ids": [5], "salt": "x"}):
        with pytest.raises(ValueError, match="'prompt' and 'prompt_token_ids'"):
            llm.generate([bad], GREEDY)
    assert not llm.engine.seqs and not llm.engine.scheduler.waiting
    text = llm.generate({"prompt": "hello there", "cache_salt": "t"}, GREEDY)[0]
    assert text.token_ids == llm.generate(["hello there"], GREEDY)[0].token_ids


def test_a_salted_request_drafts_only_from_its_salt(model_dir):
    """The common global tree (every request's tokens) is shared by unsalted requests only; each salt
    has a global tree of its own, and a group or a session is named within its salt, so another salt
    with the same group id drafts nothing from it."""
    eng = LLMEngine(EngineConfig(model=model_dir, speculative="suffix", spec_controller="always"))
    cache = eng.spec.cache

    def run(p, salt=None, group=None) -> dict[str, float]:
        before = eng.metrics()
        eng.add_request(p, GREEDY, group_id=group, cache_salt=salt)
        while eng.has_unfinished:
            eng.step()
        return {k: eng.metrics()[k] - before[k] for k in ("spec_drafted_global", "spec_drafted_group")}

    ps = [_prompt(s, 30) for s in range(3)]
    for p in ps:
        run(p)
    common = cache.global_tree.num_nodes
    fresh = [run(p, salt=f"a{i}") for i, p in enumerate(ps)]  # a new salt's tree holds the request alone
    assert cache.global_tree.num_nodes == common  # the salted outputs did not join the common tree
    assert [run(p, salt=f"b{i}") for i, p in enumerate(ps)] == fresh  # nothing from the unsalted, nor from "a"s
    assert run(ps[0])["spec_drafted_global"] > fresh[0]["spec_drafted_global"]  # the unsalted runs draft it
    assert run(ps[1], salt="a1")["spec_drafted_global"] > fresh[1]["spec_drafted_global"]  # its salt's earlier run
    cache.check_integrity()
    q = _prompt(9, 30)
    fresh = run(q, salt="a", group="g")  # (a group's tree holds its own output too: drafts from itself)
    assert run(q, salt="b", group="g") == fresh  # nothing from "a"'s member
    assert run(q, salt="a", group="g")["spec_drafted_group"] > fresh["spec_drafted_group"]
    assert "g" not in cache.groups


def test_drafting_material_from_another_replica_reaches_its_salt_only(model_dir):
    """What the router sends from a salted turn served elsewhere (`Speculator.add_sequence` with its
    salt) is drafted from by that salt's requests, and by no other salt's."""
    eng = LLMEngine(EngineConfig(model=model_dir, speculative="suffix", spec_controller="always"))
    p = _prompt(11, 30)

    def run(salt: str) -> tuple[list[int], float]:
        before = eng.metrics()["spec_drafted_global"]
        rid = eng.add_request(p, GREEDY, cache_salt=salt)
        outs = {}
        while eng.has_unfinished:
            outs.update({o.request_id: o for o in eng.step()})
        return outs[rid].token_ids, eng.metrics()["spec_drafted_global"] - before

    tokens, alone = run("elsewhere")  # (the turn another replica would have served)
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        eng.spec.add_sequence(tokens, None, "")
    eng.spec.add_sequence(tokens, None, "s")
    assert run("t") == (tokens, alone)  # another salt: its own tokens alone, as before
    salted = run("s")
    assert salted[0] == tokens and salted[1] > alone
    eng.spec.cache.check_integrity()


def test_both_hash_algorithms_cache_the_same_blocks_and_give_the_same_tokens(model_dir):
    """vLLM's prefix_caching_hash_algo: SHA-256 by default, Python's hash on request; the keys differ,
    what they find does not."""
    runs = {}
    for algo in ("sha256", "builtin"):
        llm = LLM(model_dir, block_size=16, prefix_caching_hash_algo=algo)
        p = _prompt(4)
        outs = llm.generate([p, p + _prompt(5, 10), _salted(p, "s"), p[:40]], GREEDY)
        runs[algo] = [(o.token_ids, o.num_cached_tokens) for o in outs]
        assert llm.engine.blocks.chain.__name__ == {"sha256": "sha256_chain_hashes", "builtin": "chain_hashes"}[algo]
    assert runs["sha256"] == runs["builtin"] and [c for _, c in runs["sha256"]][1:] == [64, 0, 32]
    assert LLM(model_dir).engine.config.prefix_caching_hash_algo == "sha256"
    with pytest.raises(ValueError, match="prefix_caching_hash_algo must be one of"):
        EngineConfig(model=model_dir, prefix_caching_hash_algo="md5")
