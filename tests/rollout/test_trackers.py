"""Experiment trackers: TensorBoard for real (its event files read back), W&B against a stand-in
module (its package is not installed here), and the config's checks."""
from __future__ import annotations

import sys
import types

import pytest

from rollwise.rollout.trackers import Trackers, check_trackers, scalars

METRICS = [{"reward": 0.25, "loss": 1.5, "group_versions": [0, 1], "note": "x", "nan": float("nan"), "ok": True},
           {"reward": 0.5, "loss": 1.25}, {"reward": 0.75, "loss": 1.0, "eval_success": 0.4}]


def test_only_finite_numbers_are_sent():
    assert scalars(METRICS[0]) == {"reward": 0.25, "loss": 1.5, "ok": 1.0}


def test_unknown_or_missing_trackers_are_named_before_the_run(monkeypatch):
    with pytest.raises(ValueError, match="unknown loggers \\['tb'\\]; valid: \\['tensorboard', 'wandb'\\]"):
        check_trackers(["tb"])
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a))
    with pytest.raises(ValueError, match="pip install wandb"):
        check_trackers(["tensorboard", "wandb"])
    from rollwise.rl_config import TrainConfig
    with pytest.raises(ValueError, match="unknown loggers"):
        TrainConfig.from_dict({"model": "m", "loggers": ["console", "tensorboard"]})


def test_tensorboard_gets_every_step(tmp_path):
    t = Trackers(["tensorboard"], tmp_path, {"lr": 1e-4, "env": "phonebook"})
    for step, m in enumerate(METRICS, 1):
        t.log(m, step)
    t.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward")] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert [e.step for e in acc.Scalars("eval_success")] == [3] and "group_versions" not in acc.Tags()["scalars"]


def test_wandb_run_is_resumed_by_its_id(tmp_path, monkeypatch):
    calls = []

    class Run:
        def log(self, m, step):
            calls.append(("log", m, step))

        def finish(self):
            calls.append(("finish",))

    fake = types.SimpleNamespace(init=lambda **kw: calls.append(("init", kw)) or Run())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "wandb" else real(n, *a))
    for _ in range(2):  # a run, then the same run resumed
        t = Trackers(["wandb"], tmp_path / "run", {"lr": 1e-4}, project="proj")
        t.log(METRICS[1], 2)
        t.close()
    inits = [c[1] for c in calls if c[0] == "init"]
    assert inits[0]["id"] == inits[1]["id"] and inits[0]["resume"] == "allow" and inits[0]["project"] == "proj"
    assert inits[0]["config"] == {"lr": 1e-4} and inits[0]["name"] == "run"
    assert ("log", {"reward": 0.5, "loss": 1.25}, 2) in calls and calls[-1] == ("finish",)
