"""The native small ops (RMSNorm, SiLU-and-multiply) against their torch twins, and when they are used."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from rollwise.engine import native


@pytest.fixture(autouse=True)
def built():
    assert native._C is not None, "rollwise.engine._C is not built (pip install -e . builds it)"


@pytest.mark.parametrize("rows,dim", [(1, 64), (16, 512), (3, 100), (1024, 512)])  # the last: threaded
def test_rms_norm_matches_torch(rows, dim):
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, dim, generator=g) * 3, torch.randn(dim, generator=g)
    x[0] = 0.0  # a zero row: eps keeps it finite
    with torch.inference_mode():
        out = native.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(out, F.rms_norm(x, (dim,), w, 1e-6), rtol=1e-5, atol=1e-6)
    # any leading shape: normalized over the last dimension
    x3 = x.reshape(1, rows, dim)
    torch.testing.assert_close(native.rms_norm(x3, w, 1e-6), F.rms_norm(x3, (dim,), w, 1e-6), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows,inter", [(1, 32), (16, 1408), (600, 1408)])  # the last: threaded
def test_silu_and_mul_matches_torch(rows, inter):
    g = torch.Generator().manual_seed(inter)
    x = torch.randn(rows, 2 * inter, generator=g) * 4
    x[0, :6] = torch.tensor([0.0, -100.0, 100.0, -88.5, 88.5, 1e-30])  # saturated and tiny gates
    out = native.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows", [4, 600])  # one thread and both threads
def test_kernels_flush_denormals_only_while_they_run(rows):
    """The kernels flush denormals to zero (a denormal costs ~100 cycles a lane) and must restore the
    thread's floating-point mode after: a denormal result elsewhere stays a denormal."""
    tiny = np.float32(1e-38)
    assert tiny / np.float32(100) > 0  # the mode before: denormals kept
    x = torch.randn(rows, 2 * 1408) * 1e-3  # small gates: the vectorized select's other side is denormal
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(native.silu_and_mul(x), F.silu(gate) * up, rtol=1e-5, atol=1e-12)
    native.rms_norm(x, torch.ones(2 * 1408), 1e-6)
    assert tiny / np.float32(100) > 0
    assert (torch.full((4,), 1e-38) / 100).gt(0).all()  # torch's threads too


def test_bad_input_is_a_clear_error():
    x, w = np.zeros((4, 8), np.float32), np.ones(8, np.float32)
    with pytest.raises(ValueError, match="rms_norm: out like x"):
        native._C.rms_norm(x, w, 1e-6, np.zeros((4, 7), np.float32))
    with pytest.raises(ValueError, match="rms_norm: out like x, w of x's width"):
        native._C.rms_norm(x, np.ones(7, np.float32), 1e-6, x.copy())
    with pytest.raises(ValueError, match=r"silu_and_mul: out \[N, I\]"):
        native._C.silu_and_mul(x, np.zeros((4, 8), np.float32))
    with pytest.raises(ValueError, match=r"silu_and_mul: x \[N, 2I\]"):
        native._C.silu_and_mul(np.zeros((4, 7), np.float32), np.zeros((4, 3), np.float32))
    with pytest.raises(TypeError):  # float64: would be a silent copy; refused
        native._C.rms_norm(x.astype(np.float64), w, 1e-6, x.copy())


def test_takes_only_inference_fp32_cpu_contiguous(monkeypatch):
    x = torch.randn(4, 8)
    with torch.inference_mode():
        assert native.takes(x)
        assert not native.takes(x.to(torch.bfloat16))
        assert not native.takes(x.t())  # strided: the torch twin handles views
        assert not native.takes(x, x.to(torch.bfloat16))  # every tensor must qualify
        monkeypatch.setattr(native, "ENABLED", False)
        assert not native.takes(x)
    monkeypatch.setattr(native, "ENABLED", True)
    assert not native.takes(x)  # autograd on: training goes through torch


def test_model_forward_same_with_and_without_native_ops(model_dirs, monkeypatch):
    """A whole forward of each family (Qwen3's q/k norms are strided views: the torch twin takes
    them) gives the same logits either way, within float rounding."""
    from rollwise.engine.attention import build_metadata
    from rollwise.engine.models.loader import load_model
    for family in ("llama", "qwen3"):
        model = load_model(model_dirs[family])
        mc = model.config
        ids = torch.arange(3, 40) % mc.vocab_size
        logits = {}
        for on in (False, True):
            monkeypatch.setattr(native, "ENABLED", on)
            kv = [torch.zeros(mc.num_layers, 4 * 16, mc.num_kv_heads, mc.head_dim) for _ in range(2)]
            with torch.inference_mode():
                meta = build_metadata([len(ids)], [0], [[0, 1, 2]], 16, torch.device("cpu"), use_native=True)
                logits[on] = model.logits(model(ids, torch.arange(len(ids)), meta, kv))
        torch.testing.assert_close(logits[True], logits[False], rtol=1e-4, atol=1e-4)
