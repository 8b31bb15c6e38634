"""The sweep runs each simulation in its own process: results come back, errors surface."""
import os

import pytest

from rollwise.sim.sweep import isolated


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


def _raise(e):
    raise e
