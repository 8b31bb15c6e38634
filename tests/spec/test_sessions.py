import random

import pytest

from rollwise.spec.suffix_cache import SuffixCache


@pytest.mark.parametrize("backend", ["cpp", "python"])
def test_a_session_extends_its_tree_and_drafts_as_a_fresh_one_would(backend):
    rng = random.Random(0)
    words = [rng.randrange(30) for _ in range(40)]
    with_s = SuffixCache(backend=backend, max_cached_requests=0)
    fresh = SuffixCache(backend=backend, max_cached_requests=0)
    ctx = list(words)
    for turn in range(6):
        with_s.start_request(f"a{turn}", ctx, "g", session="traj")
        fresh.start_request(f"b{turn}", ctx, "g")
        out = [words[(turn * 7 + i) % len(words)] for i in range(12)]
        for i in range(0, len(out), 3):
            da, db = with_s.speculate(f"a{turn}"), fresh.speculate(f"b{turn}")
            assert (da.token_ids, da.probs) == (db.token_ids, db.probs)
            with_s.append(f"a{turn}", out[i:i + 3])
            fresh.append(f"b{turn}", out[i:i + 3])
        with_s.stop_request(f"a{turn}")
        fresh.stop_request(f"b{turn}")
        ctx = ctx + out + [rng.randrange(30) for _ in range(5)]  # the observation
        with_s.check_integrity()
    assert with_s._session_tokens == len(ctx) - 5


def test_a_session_whose_prompt_does_not_extend_the_last_is_rebuilt_and_tokens_stay_bounded():
    c = SuffixCache(max_cached_requests=0, max_session_tokens=50)
    c.start_request("r1", [1, 2, 3, 4, 5] * 4, session="s")
    c.stop_request("r1")
    c.start_request("r2", [9, 9, 9] + [1, 2, 3, 4, 5] * 4, session="s")  # rewritten history: a fresh tree
    assert c.speculate("r2").token_ids[:1] == [1]  # ...built from this prompt only ([5] is followed by 1)
    c.stop_request("r2")
    for i in range(5):
        c.start_request(f"x{i}", [i] * 20, session=f"t{i}")
        c.stop_request(f"x{i}")
        c.check_integrity()
    assert len(c._sessions) == 2
