"""The native paged attention kernel for short queries (rollwise.engine._C) against the torch path
it replaces."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from rollwise.engine import attention as A
from rollwise.engine import native


@pytest.fixture
def torch_path(monkeypatch):
    """Runs `paged_attention` with the native kernel on or off."""
    assert native._C is not None, "rollwise.engine._C is not built (pip install -e . builds it)"

    def run(on: bool, *args):
        monkeypatch.setattr(native, "ENABLED", on)
        return A.paged_attention(*args)
    return run


def make_pool(num_blocks, bs, hkv, d, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks * bs, hkv, d, generator=g), torch.randn(num_blocks * bs, hkv, d, generator=g)


@pytest.mark.parametrize("heads,kv_heads,d,bs", [(8, 4, 64, 16), (4, 4, 32, 8), (12, 2, 16, 4), (2, 1, 8, 32)])
def test_decode_matches_torch_path(torch_path, heads, kv_heads, d, bs):
    """Random lengths (1 key, block edges, several of the kernel's 256-key partitions), blocks in
    random order."""
    rng = random.Random(heads * 100 + d)
    for batch in (1, 3, 17, 48):  # 48 long sequences: over kParallelPairs, the threaded path
        ctx = [rng.choice([0, bs - 1, bs, 2 * bs + 1, rng.randrange(200), rng.randrange(256, 900)])
               for _ in range(batch)]
        need = [(c + 1 + bs - 1) // bs for c in ctx]
        ids = rng.sample(range(sum(need) + 5), sum(need))
        tables = [ids[sum(need[:i]):sum(need[:i + 1])] for i in range(batch)]
        kc, vc = make_pool(sum(need) + 5, bs, kv_heads, d, batch)
        q, k, v = torch.randn(batch, heads, d), torch.randn(batch, kv_heads, d), torch.randn(batch, kv_heads, d)
        meta = A.build_metadata([1] * batch, ctx, tables, bs, torch.device("cpu"))
        ref = torch_path(False, q, k, v, kc.clone(), vc.clone(), meta)
        out = torch_path(True, q, k, v, kc, vc, meta)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        # the new keys and values were written to their slots, as the torch path writes them
        slot = meta.slot_mapping
        assert torch.equal(kc[slot], k) and torch.equal(vc[slot], v)


def test_mixed_batch_scatters_decode_rows(torch_path):
    """Decodes, a draft tree and a prefill chunk in one batch: the kernel writes the short groups'
    rows in place, the chunk still goes through SDPA, and the result is the torch path's."""
    bs, h, hkv, d = 8, 4, 2, 16
    q_lens, ctx = [1, 70, 1, 5, 1], [9, 0, 30, 12, 0]
    need = [(c + n + bs - 1) // bs for c, n in zip(ctx, q_lens)]
    ids = list(range(sum(need)))
    random.Random(1).shuffle(ids)
    tables = [ids[sum(need[:i]):sum(need[:i + 1])] for i in range(len(q_lens))]
    kc, vc = make_pool(sum(need), bs, hkv, d, 3)
    t = sum(q_lens)
    q, k, v = torch.randn(t, h, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    tree = {3: torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 0, 0, 1]],
                            dtype=torch.bool)}
    meta = A.build_metadata(q_lens, ctx, tables, bs, torch.device("cpu"), tree)
    ref = torch_path(False, q, k, v, kc.clone(), vc.clone(), meta)
    out = torch_path(True, q, k, v, kc, vc, meta)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_extreme_scores_stay_finite(torch_path):
    """Scores hundreds apart (exp underflows to 0 for all but the max) and all equal."""
    bs, h, hkv, d = 4, 2, 1, 8
    kc, vc = make_pool(4, bs, hkv, d, 0)
    kc[:5] = 0.0
    kc[2] = 50.0  # one key far ahead of the rest
    q = torch.full((2, h, d), 1.0)
    k, v = torch.zeros(2, hkv, d), torch.randn(2, hkv, d)
    meta = A.build_metadata([1, 1], [4, 2], [[0, 1], [2, 3]], bs, torch.device("cpu"))
    ref = torch_path(False, q, k, v, kc.clone(), vc.clone(), meta)
    out = torch_path(True, q, k, v, kc, vc, meta)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tree", [False, True])
def test_drafts_and_short_prompts_match_torch_path(torch_path, tree):
    """Verification queries (the last token plus a chain or a tree of drafts, up to 64 in all) on
    contexts across partitions, and short prompts with nothing cached: one query may see no key of
    a partition (its ancestors all in the one before)."""
    rng = random.Random(7 + tree)
    bs, h, hkv, d = 16, 8, 2, 32
    q_lens = [1 + rng.randrange(64) for _ in range(9)] + [64, 2, 20]
    ctx = [rng.choice([250, 255, 256, 511, rng.randrange(1, 900)]) for _ in range(9)] + [300, 1, 0]
    need = [(c + n + bs - 1) // bs for c, n in zip(ctx, q_lens)]
    ids = rng.sample(range(sum(need) + 3), sum(need))
    tables = [ids[sum(need[:i]):sum(need[:i + 1])] for i in range(len(q_lens))]
    trees = {}
    if tree:
        for i, n in enumerate(q_lens[:-1]):  # the last is a prompt: causal
            parents = [-1] + [rng.randrange(k) for k in range(1, n)]  # node k hangs under an earlier one
            trees[i] = torch.zeros(n, n, dtype=torch.bool)
            for k, p in enumerate(parents):
                trees[i][k] = trees[i][p] if p >= 0 else trees[i][k]
                trees[i][k, k] = True
    kc, vc = make_pool(sum(need) + 3, bs, hkv, d, 5)
    t = sum(q_lens)
    q, k, v = torch.randn(t, h, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    meta = A.build_metadata(q_lens, ctx, tables, bs, torch.device("cpu"), trees)
    assert all(g.short is not None for g in meta.groups)  # all on the native path
    ref = torch_path(False, q, k, v, kc.clone(), vc.clone(), meta)
    out = torch_path(True, q, k, v, kc, vc, meta)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_long_prefill_chunks_stay_on_torch_path():
    meta = A.build_metadata([65, 1], [0, 10], [[0, 1, 2, 3, 4], [5]], 16, torch.device("cpu"))
    assert [g.short is None for g in meta.groups] == [False, True]  # decode native; the chunk is not


def test_bad_input_is_a_clear_error():
    q = np.zeros((3, 4, 8), np.float32)
    cache = np.zeros((16, 2, 8), np.float32)
    i64 = lambda *x: np.array(x, np.int64)  # noqa: E731
    ok = dict(q=q, k_cache=cache, v_cache=cache, block_tables=np.array([[0, 1], [2, 3]]), lens=i64(5, 8),
              prefix=i64(4, 6), rows=i64(0, 1, 2), seqs=i64(0, 1, 1), masks=i64(1, 1, 3), out=q.copy(),
              block_size=4, scale=0.5)
    native._C.paged_attention(**ok)
    bad = {
        "block ids within the pool": dict(block_tables=np.array([[0, 1], [2, 4]])),
        "lens within": dict(lens=i64(5, 9)),
        "prefix <= lens": dict(prefix=i64(6, 6)),
        "rows within q": dict(rows=i64(0, 1, 3)),
        "non-decreasing": dict(seqs=i64(1, 0, 1)),
        "masks name keys below lens": dict(masks=i64(1, 1, 4)),
        "every query sees a key": dict(prefix=i64(0, 6), masks=i64(0, 1, 3)),
        "multiple of kv heads": dict(q=np.zeros((3, 3, 8), np.float32), out=np.zeros((3, 3, 8), np.float32)),
        "whole blocks": dict(block_size=3),
    }
    for msg, change in bad.items():
        with pytest.raises(ValueError, match=msg):
            native._C.paged_attention(**dict(ok, **change))
    with pytest.raises(TypeError):  # float64 would be a silent copy the kernel writes into: refused
        native._C.paged_attention(**dict(ok, out=np.zeros((3, 4, 8))))
    with pytest.raises(TypeError):  # so is a strided view
        native._C.paged_attention(**dict(ok, q=np.zeros((3, 4, 16), np.float32)[:, :, ::2]))


def test_engine_greedy_tokens_same_with_and_without_kernel(model_dirs, monkeypatch):
    """A whole generation (prefill, decode, continuous batching) gives the same tokens and
    logprobs either way."""
    from rollwise import LLM, SamplingParams
    llm = LLM(model_dirs["qwen3"], max_num_seqs=8)
    prompts = [[5 + i, 9, 40 + 3 * i, 7] * (i + 1) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    runs = {}
    for on in (False, True):
        monkeypatch.setattr(native, "ENABLED", on)
        runs[on] = llm.generate(prompts, params)
    for a, b in zip(runs[False], runs[True]):
        assert a.token_ids == b.token_ids
        assert np.allclose(a.logprobs, b.logprobs, atol=1e-5)
