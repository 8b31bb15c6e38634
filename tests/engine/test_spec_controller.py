"""Speculation controllers decide from the load signal (no model needed)."""
from __future__ import annotations

import pytest

from rollwise.engine.spec_controller import SpecController, StepTimeModel
from rollwise.types import Draft


def _draft(probs, source="group"):
    return Draft(list(range(len(probs))), [i - 1 for i in range(len(probs))], list(probs), sum(probs), 3, source)


def _fit(model: StepTimeModel, fixed: float, per_token: float) -> None:
    for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
        for _ in range(5):
            model.observe(n, fixed + per_token * n)


def test_step_time_model_interpolates_and_extrapolates():
    m = StepTimeModel()
    _fit(m, 0.01, 0.001)
    assert m.predict(48) == pytest.approx(0.01 + 0.048, rel=0.02)
    assert m.predict(2048) == pytest.approx(0.01 + 2.048, rel=0.05)


def test_adaptive_speculates_at_low_load_and_stops_at_high_load():
    c = SpecController("adaptive", max_spec_tokens=8)
    # memory-bound at small batches: flat to 64 tokens, then compute-bound (linear)
    for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048):
        for _ in range(5):
            c.observe_step(n, 0.02 if n <= 64 else 0.02 * n / 64)
    good = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2]
    low = c.plan([_draft(good)], base_tokens=1, num_decodes=1)
    assert low == [8]  # nearly free verification: take the whole draft
    high = c.plan([_draft(good)] * 256, base_tokens=256, num_decodes=256)
    assert sum(high) == 0  # every extra token costs its full share of a compute-bound step
    mid = c.plan([_draft(good)] * 40, base_tokens=40, num_decodes=40)
    assert 0 < sum(mid) < 40 * 8 and max(mid) <= 8
    assert all(a >= b for a, b in zip(mid, mid[1:])) or len(set(mid)) <= 2  # likeliest tokens first


def test_measured_acceptance_calibrates_the_plan():
    c = SpecController("adaptive", max_spec_tokens=8)
    for n in (1, 8, 16, 32, 64):
        c.observe_step(n, 0.01 + 0.0004 * n)
    d = [_draft([0.9] * 8, source="global")] * 8
    before = sum(c.plan(d, 8, 8))
    for _ in range(200):
        c.observe_acceptance("global", predicted=7.2, accepted=0)  # its drafts never get accepted
    assert sum(c.plan(d, 8, 8)) < before


@pytest.mark.parametrize("mode,running,expect", [("off", 1, 0), ("always", 200, 5), ("threshold", 4, 5),
                                                 ("threshold", 40, 0)])
def test_fixed_modes(mode, running, expect):
    c = SpecController(mode, max_spec_tokens=5, threshold=16)
    d = [_draft([0.9] * 7)]
    got = c.plan(d, 1, 1)[0] if c.wants_drafts(running) else 0
    assert got == expect


def test_unknown_mode_names_the_valid_ones():
    with pytest.raises(ValueError, match="adaptive"):
        SpecController("sometimes")


def test_adaptive_is_offered_longer_drafts_than_the_fixed_rules():
    """The adaptive controller prunes what does not pay, so the suffix trees offer it 2x the matched
    length; the fixed rules verify everything offered and keep SuffixDecoding's 1x; an explicit
    alpha wins. Checked on what the trees then propose for a short match."""
    from rollwise.engine.spec_controller import draft_alpha
    from rollwise.sim.cost import LinearCost
    from rollwise.sim.replica import SimReplica
    assert draft_alpha("adaptive") == 2.0 and draft_alpha("threshold") == 1.0 and draft_alpha("always") == 1.0
    assert draft_alpha("adaptive", 1.5) == 1.5
    lens = {}
    for mode in ("adaptive", "threshold"):
        rep = SimReplica(mode, LinearCost({"base_s": 1e-3}), num_kv_blocks=64, spec=mode)
        seen = list(range(100, 140))  # a response seen once: every continuation has probability 1
        rep.cache.start_request("old", [1, 2, 3])
        rep.cache.append_batch({"old": seen})
        rep.cache.stop_request("old")
        rep.cache.start_request("new", [7, 8, 9] + seen[:3])  # matches 3 tokens of it (and their suffixes)
        lens[mode] = len(rep.cache.speculate("new"))
    assert lens == {"adaptive": 6, "threshold": 3}
