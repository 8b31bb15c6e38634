"""rollwise/mkl.py: MKL's vector math set up on one thread before torch's threads share it."""
from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from rollwise.omp import passive_env

BUILD = {  # (each ends having computed its rotary embedding's cos)
    "policy": "from rollwise.trainer.policy import PolicyModel\n"
              "PolicyModel(sys.argv[1], threads=2).model(input_ids=torch.tensor([[1, 2, 3] * 30]))",
    "engine": "from rollwise import LLM\nLLM(sys.argv[1], num_threads=2)",
}


@pytest.mark.parametrize("what", list(BUILD))
def test_a_policy_and_an_engine_settle_the_vector_math_before_using_it(model_dir, what):
    """The race itself is rare (one to a few process starts in a hundred: benchmarks/vml_race.py measures
    it on the trainer's first step), so this checks the order: in a fresh process, the trainer's
    policy (in its first forward) and the engine (its rotary table, at load) take their first cos
    of a tensor after the vector math is settled."""
    code = f"""
import sys, torch
from rollwise import mkl
assert not mkl._settled
seen, real = [], torch.Tensor.cos
torch.Tensor.cos = lambda self: seen.append((self.numel(), mkl._settled)) or real(self)
{BUILD[what]}
print(seen)
"""
    out = subprocess.run([sys.executable, "-c", code, model_dir], env=passive_env(), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    assert seen and all(settled for _, settled in seen), seen
    assert max(n for n, _ in seen) > 1  # (a rotary table's, not settle's own one-element calls)


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
