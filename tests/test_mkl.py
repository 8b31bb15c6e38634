"""rollwise/mkl.py: MKL's vector math set up on one thread before torch's threads share it."""
from __future__ import annotations

import subprocess
import sys

import pytest

from rollwise.omp import passive_env

BUILD = {
    "policy": "from rollwise.trainer.policy import PolicyModel; PolicyModel(sys.argv[1], threads=2)",
    "engine": "from rollwise import LLM; LLM(sys.argv[1], num_threads=2)",
}


@pytest.mark.parametrize("what", list(BUILD))
def test_a_policy_and_an_engine_settle_the_vector_math_before_using_it(model_dir, what):
    """The race itself is rare (about one process start in 60 on 4 threads: benchmarks/vml_race.py
    measures it), so this checks where the settling happens: in a fresh process, building the
    trainer's policy or an engine settles it."""
    code = f"""
import sys, torch
from rollwise import mkl
assert not mkl._settled
{BUILD[what]}
print(mkl._settled)
"""
    out = subprocess.run([sys.executable, "-c", code, model_dir], env=passive_env(), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "True"


def test_settle_runs_each_op_once_per_process(monkeypatch):
    import torch

    from rollwise import mkl
    calls = []
    monkeypatch.setattr(mkl, "_settled", False)
    for op in mkl.VML_OPS:
        real = getattr(torch, op)
        monkeypatch.setattr(torch, op, lambda x, real=real, op=op: calls.append((op, x.dtype, x.numel())) or real(x))
    mkl.settle()
    mkl.settle()
    assert len(calls) == 2 * len(mkl.VML_OPS) and {n for *_, n in calls} == {1}  # (one element: this thread)
    assert {d for _, d, _ in calls} == {torch.float32, torch.float64}
    assert mkl._settled
