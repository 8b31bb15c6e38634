"""The native small ops (RMSNorm, SiLU-and-multiply, RoPE) against their torch twins, and when they are
used."""
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


@pytest.mark.parametrize("rows,heads,kv_heads,d", [(1, 8, 4, 64), (7, 4, 2, 32), (600, 8, 4, 64)])  # last: threaded
def test_rope_matches_torch_in_place(rows, heads, kv_heads, d):
    """q's and k's heads rotated in place in the fused projection's rows, v's columns untouched; at
    positions far apart (large angles) as apply_rope does them."""
    from rollwise.engine.models.llama import ModelConfig, RotaryEmbedding, apply_rope
    g = torch.Generator().manual_seed(rows)
    cfg = ModelConfig.from_hf({"model_type": "llama", "vocab_size": 64, "hidden_size": heads * d,
                               "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": heads,
                               "num_key_value_heads": kv_heads, "rope_theta": 10000.0})
    cos, sin = RotaryEmbedding(cfg, 8192).table(torch.randint(0, 8192, (rows,), generator=g), torch.float32)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=g)
    q, k, v = (x.reshape(rows, -1, d) for x in qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1))
    ref_q, ref_k = apply_rope(q, k, cos, sin)
    ref_v = v.clone()
    with torch.inference_mode():
        assert native.takes(qkv, cos, sin)
        assert native.rope_(qkv, 0, heads + kv_heads, cos, sin) is qkv
    torch.testing.assert_close(q, ref_q, rtol=1e-5, atol=1e-5)  # views of qkv: rotated in place
    torch.testing.assert_close(k, ref_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(v, ref_v)
    # from a column offset (k alone), the rest of the row untouched
    before = qkv.clone()
    native.rope_(qkv, heads * d, kv_heads, cos, sin)
    assert torch.equal(qkv[:, : heads * d], before[:, : heads * d]) and torch.equal(v, ref_v)
    torch.testing.assert_close(k, apply_rope(ref_k, ref_k, cos, sin)[0], rtol=1e-5, atol=1e-5)


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
    cs = np.ones((4, 4), np.float32)
    with pytest.raises(ValueError, match="rope_: even D, heads within x's columns"):
        native._C.rope_(x.copy(), 6, 1, cs, cs)  # columns 6..9 of 8
    with pytest.raises(ValueError, match="rope_: cos and sin"):
        native._C.rope_(x.copy(), 0, 2, cs[:3], cs[:3])


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
    them; Qwen3-MoE's experts take SiLU-and-multiply per expert) gives the same logits either way,
    within float rounding."""
    from rollwise.engine.attention import build_metadata
    from rollwise.engine.models.loader import load_model
    for family in ("llama", "qwen3", "qwen3_moe"):
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


@pytest.mark.parametrize("rows,vocab", [(1, 7), (5, 300), (4, 256), (2, 257), (64, 8192), (3, 40_000)])
def test_inverse_cdf_matches_torch_bit_for_bit(rows, vocab):
    from rollwise.engine.sampler import inverse_cdf, inverse_cdf_torch
    g = torch.Generator().manual_seed(vocab)
    for trial in range(12):
        logits = torch.randn(rows, vocab, generator=g) * (1 + 4 * (trial % 4))
        if trial % 3 == 0:
            logits[:, vocab // 2 + 1:] = float("-inf")  # zeros at the end: never drawn
        if trial % 4 == 1:
            logits[:, :vocab // 3] = float("-inf")  # zeros at the start
        probs = torch.softmax(logits, -1) * (1.0 if trial % 2 else 7.3)  # unnormalized too
        u = torch.rand(rows, dtype=torch.float64, generator=g)
        u[0] = (0.0, 1 - 2**-53, float(u[0]))[trial % 3]  # the ends of [0, 1)
        assert inverse_cdf(probs, u).tolist() == inverse_cdf_torch(probs, u).tolist(), trial
    # a probability too small to move the float64 sum is never the answer at the top end, as in torch
    p = torch.tensor([[0.0, 1.0, 1e-30, 0.0], [0.0] * 4])
    u = torch.tensor([1 - 2**-53, 0.5], dtype=torch.float64)
    assert inverse_cdf(p, u).tolist() == inverse_cdf_torch(p, u).tolist() == [1, 0]


def test_inverse_cdf_bad_input_is_a_clear_error():
    p, u, out = np.ones((2, 5), np.float32), np.zeros(2), np.zeros(2, np.int64)
    with pytest.raises(ValueError, match="inverse_cdf: u and out of probs' B rows"):
        native._C.inverse_cdf(p, np.zeros(3), out)
    with pytest.raises(ValueError, match="V > 0"):
        native._C.inverse_cdf(np.ones((2, 0), np.float32), u, out)
    with pytest.raises(TypeError):  # float32 u: would be a silent copy; refused
        native._C.inverse_cdf(p, u.astype(np.float32), out)


def test_sampler_rows_mixed_greedy_and_sampled(monkeypatch):
    """Greedy rows take their argmax, sampled rows a seeded draw that does not depend on the batch;
    every logprob is log_softmax(logits / temperature) at the token; the torch twin gives the same."""
    from rollwise.engine.sampler import Sampler, SampleRow
    from rollwise.types import SamplingParams
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 3000, generator=g) * 3
    params = [SamplingParams(temperature=t, seed=s) for t, s in
              [(0, None), (1.0, 11), (0.7, 12), (0, None), (1.0, 13), (1.3, 14)]]

    def run(rows_at):
        return Sampler(0)(logits[rows_at].clone(), [SampleRow(params[i], position=3) for i in rows_at])
    toks, lps, _ = run(list(range(6)))
    for i in range(6):
        temp = params[i].temperature or 1.0
        assert lps[i] == pytest.approx(float(torch.log_softmax(logits[i] / temp, -1)[toks[i]]), abs=1e-6)
        assert run([i])[0] == [toks[i]]  # alone: the same token
    assert toks[0] == int(logits[0].argmax()) and toks[3] == int(logits[3].argmax())
    monkeypatch.setattr(native, "ENABLED", False)
    assert run(list(range(6)))[:2] == (toks, lps)
