"""Which kernel takes a linear's rows (rollwise/engine/models/linear.py): measured once per machine, kept
in a file every process reads, or fixed by ROLLWISE_LINEAR_POLICY."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from rollwise.engine.models import linear
from rollwise.engine.models.linear import FIXED, INF, Linear, packed_linear


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """No policy known in this process, and the cache file under tmp_path."""
    monkeypatch.setattr(linear, "_policy", None)
    monkeypatch.setenv("ROLLWISE_CACHE", str(tmp_path))
    monkeypatch.delenv("ROLLWISE_LINEAR_POLICY", raising=False)
    return tmp_path / "linear-policy.json"


def test_the_measured_policy_is_kept_in_a_file_that_later_processes_read(fresh, monkeypatch):
    got = linear.policy()
    sizes = [n * n for n in (128, 256, 512, 1024, 2048)]
    assert len(got["onednn_from"]) == 3 and all(t in sizes or t == INF for t in got["onednn_from"])
    assert got["serial_flops"] in [8.0 * n for n in sizes] + [INF]
    (key, saved), = json.loads(fresh.read_text()).items()
    assert saved == got and torch.__version__ in key
    monkeypatch.setattr(linear, "_policy", None)  # another process: it reads the file, measures nothing

    def no(*a, **k):
        raise AssertionError("measured again")
    monkeypatch.setattr(linear, "measure", no)
    assert linear.policy() == got


def test_a_cache_file_that_does_not_parse_is_measured_again_and_rewritten(fresh):
    fresh.parent.mkdir(parents=True, exist_ok=True)
    fresh.write_text("{not json")
    got = linear.policy()
    assert list(json.loads(fresh.read_text()).values()) == [got]


def test_a_fixed_policy_by_name_and_a_bad_name_refused(fresh, monkeypatch):
    for name in FIXED:
        monkeypatch.setattr(linear, "_policy", None)
        monkeypatch.setenv("ROLLWISE_LINEAR_POLICY", name)
        assert linear.policy() == FIXED[name]
    assert not fresh.exists()
    monkeypatch.setattr(linear, "_policy", None)
    monkeypatch.setenv("ROLLWISE_LINEAR_POLICY", "fastest")
    with pytest.raises(ValueError, match=r"one of \['measured', 'onednn', 'mkl'\]"):
        linear.policy()


@pytest.mark.parametrize("rows", [1, 2, 3, 5])
def test_a_layer_takes_the_kernel_its_policy_names(monkeypatch, rows):
    lin = Linear(256, 512, bias=False)
    lin.repack()
    x = torch.randn(rows, 256)
    for name in FIXED:
        monkeypatch.setattr(linear, "_policy", {**FIXED[name], "onednn_from": (
            [0, 0, 0] if name == "onednn" else [INF] * 3)})
        with torch.inference_mode():
            want = packed_linear(x, lin.packed) if name == "onednn" or rows >= 4 else F.linear(x, lin.weight)
            assert torch.equal(lin(x), want), name  # (from 4 rows every policy takes oneDNN)
