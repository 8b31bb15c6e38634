"""The sweep runs each simulation in its own process, one or several at once: results come back,
errors surface."""
import os

import pytest

from rollwise.sim.run import SimConfig
from rollwise.sim.sweep import isolated, sweep


def _pid_and_sum(a, b=0):
    return os.getpid(), a + b


def test_isolated_runs_in_a_child_and_returns_its_result():
    pid, total = isolated(_pid_and_sum, 2, b=3)
    assert total == 5 and pid != os.getpid()


def test_isolated_raises_the_childs_exception():
    with pytest.raises(ValueError, match="bad config"):
        isolated(_raise, ValueError("bad config"))


def test_a_child_that_dies_is_an_error_not_a_hang():
    with pytest.raises(RuntimeError, match="exit code 3"):
        isolated(os._exit, 3)


def test_simulations_run_side_by_side_give_the_same_sweep():
    cfg = SimConfig(loads=(2,), turns=(2, 4), context=(256, 512), obs_median=64, configs=("baseline", "war", "rollwise"))
    keys = ("makespan_s", "prefill_tokens", "generated_tokens", "turns", "last")
    one = sweep(cfg, log=lambda *_: None, progress=False)
    lines: list[str] = []
    two = sweep(cfg, log=lines.append, progress=False, jobs=2)
    for name in cfg.configs:
        assert {k: one["loads"]["2"][name][k] for k in keys} == {k: two["loads"]["2"][name][k] for k in keys}
    assert [ln.split()[0] for ln in lines[1:]] == list(cfg.configs)  # logged in order whatever ends first
    with pytest.raises(ValueError, match="jobs"):
        sweep(cfg, jobs=0)


def _raise(e):
    raise e
