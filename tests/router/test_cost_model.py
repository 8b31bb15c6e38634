"""The router's cost model recovers what replica time goes to from its counters."""
from __future__ import annotations

import random

from rollwise.router.cost_model import CostModel
from rollwise.router.replica import LoadSnapshot


def test_fit_recovers_costs_from_counter_deltas():
    rng = random.Random(0)
    cm = CostModel()
    a, b, c = 1e-4, 3e-4, 5e-3
    for name in ("r0", "r1"):
        busy = pre = dec = steps = 0.0
        for _ in range(40):
            dp, dd, ds = rng.randint(0, 4000), rng.randint(0, 600), rng.randint(5, 60)
            pre, dec, steps = pre + dp, dec + dd, steps + ds
            busy += a * dp + b * dd + c * ds
            cm.observe(name, LoadSnapshot(busy_s=busy, prefill_tokens=pre, decode_tokens=dec, steps=steps))
    fa, fb, fc = cm.fit()
    assert abs(fa - a) < 1e-6 and abs(fb - b) < 1e-6 and abs(fc - c) < 1e-5


def test_prior_until_enough_samples_and_replicas_without_counters_are_ignored():
    cm = CostModel(prior=(1.0, 2.0, 3.0))
    cm.observe("x", LoadSnapshot())  # no busy_s: another server's metrics
    cm.observe("x", None)
    assert cm.fit() == (1.0, 2.0, 3.0) and not cm.samples


def test_token_time_recovers_the_per_sequence_cost_of_a_bigger_batch():
    alpha, beta = 4e-3, 6e-4  # s per token of one sequence: alone, and per co-runner
    cm = CostModel()
    for i in range(15):
        n = 1 + i % 12
        cm.observe("r0", LoadSnapshot(running=n, tokens_per_s=n / (alpha + beta * n)))
    cm.observe("r0", LoadSnapshot(running=0, tokens_per_s=0.0))  # idle: says nothing about batches
    assert cm.token_time() is None  # 15 samples: not enough yet
    cm.observe("r1", LoadSnapshot(running=30, tokens_per_s=30 / (alpha + beta * 30)))  # no busy_s needed
    fa, fb = cm.token_time()
    assert abs(fa - alpha) < 1e-9 and abs(fb - beta) < 1e-9
