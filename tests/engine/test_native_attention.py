"""The native paged attention kernel (rollwise.engine._C) against the torch path it replaces. Head
sizes 32, 64 and 128 take its vector kernel (tiles of queries sharing key loads), others its loop
kernel; the tests run both."""
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
    torch.manual_seed(0)  # the tests' own inputs, whatever ran before
    return run


def exact(q, k, v, kc, vc, meta):
    """The torch path in float64, rounded to float32: the reference the kernel is held to. The
    float32 torch path is no reference at head size 128: its own rounding (SDPA's) takes up to 1.1x
    the tolerance below on random inputs, the kernel's at most 0.42x. The caches are copied."""
    on, native.ENABLED = native.ENABLED, False
    try:
        return A.paged_attention(*(x.double() for x in (q, k, v, kc, vc)), meta).float()
    finally:
        native.ENABLED = on


def make_pool(num_blocks, bs, hkv, d, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks * bs, hkv, d, generator=g), torch.randn(num_blocks * bs, hkv, d, generator=g)


def random_tables(q_lens, ctx, bs, rng, spare):
    """Block tables for sequences of ctx + q tokens, drawn in random order from a pool with `spare`
    blocks left over. Returns (tables, number of blocks in the pool)."""
    need = [(c + n + bs - 1) // bs for c, n in zip(ctx, q_lens)]
    ids = rng.sample(range(sum(need) + spare), sum(need))
    return [ids[sum(need[:i]):sum(need[:i + 1])] for i in range(len(need))], sum(need) + spare


@pytest.mark.parametrize("heads,kv_heads,d,bs", [(8, 4, 64, 16), (4, 4, 32, 8), (12, 2, 16, 4), (2, 1, 8, 32),
                                                 (6, 1, 128, 4)])
def test_decode_matches_torch_path(torch_path, heads, kv_heads, d, bs):
    """Random lengths (1 key, block edges, several of the kernel's 256-key partitions), blocks in
    random order."""
    rng = random.Random(heads * 100 + d)
    for batch in (1, 3, 17, 48):  # 48 long sequences: over parallel_pairs(), the threaded path
        ctx = [rng.choice([0, bs - 1, bs, 2 * bs + 1, rng.randrange(200), rng.randrange(256, 900)])
               for _ in range(batch)]
        tables, num_blocks = random_tables([1] * batch, ctx, bs, rng, spare=5)
        kc, vc = make_pool(num_blocks, bs, kv_heads, d, batch)
        q, k, v = torch.randn(batch, heads, d), torch.randn(batch, kv_heads, d), torch.randn(batch, kv_heads, d)
        meta = A.build_metadata([1] * batch, ctx, tables, bs, torch.device("cpu"), use_native=True)
        ref = exact(q, k, v, kc, vc, meta)
        out = torch_path(True, q, k, v, kc, vc, meta)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        # the new keys and values were written to their slots, as the torch path writes them
        slot = meta.slot_mapping
        assert torch.equal(kc[slot], k) and torch.equal(vc[slot], v)


@pytest.mark.parametrize("d", [16, 64])
def test_threads_do_not_change_the_bits(monkeypatch, d):
    """The same call on one thread and split across threads gives the same bits (each work item's
    arithmetic is fixed); the split starts where the machine's linear policy puts it."""
    from rollwise.engine.models import linear
    rng = random.Random(d)
    bs, h, hkv = 16, 8, 4
    q_lens = [1] * 20 + [7, 1, 33]  # decodes, a short chunk, a prefill chunk
    ctx = [rng.randrange(1, 700) for _ in q_lens]
    tables, num_blocks = random_tables(q_lens, ctx, bs, rng, spare=3)
    kc, vc = make_pool(num_blocks, bs, hkv, d, 7)
    q = torch.randn(sum(q_lens), h, d)
    meta = A.build_metadata(q_lens, ctx, tables, bs, torch.device("cpu"), use_native=True)
    outs = []
    for pairs in (0, 1 << 40):
        out = torch.empty_like(q)
        for g in meta.groups:
            nq = g.native
            native._C.paged_attention(q.numpy(), kc.numpy(), vc.numpy(), g.block_tables.numpy(), nq.rows, nq.seqs,
                                      nq.prefix, nq.masks, out.numpy(), bs, d ** -0.5, pairs)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and bool(outs[0].abs().sum() > 0)
    for serial, pairs in ((8.4e6, 4101), (16e6, 7812), (0.0, 2048), (1e12, 65536)):
        monkeypatch.setattr(linear, "_policy", {"onednn_from": [0, 0, 0], "serial_flops": serial})
        assert A.parallel_pairs() == pairs


@pytest.mark.parametrize("d", [16, 64])
def test_mixed_batch_scatters_decode_rows(torch_path, d):
    """Decodes, a draft tree and a prefill chunk in one batch: each group's rows land in place and
    the result is the torch path's."""
    bs, h, hkv = 8, 4, 2
    q_lens, ctx = [1, 70, 1, 5, 1], [9, 0, 30, 12, 0]
    tables, num_blocks = random_tables(q_lens, ctx, bs, random.Random(1), spare=0)
    kc, vc = make_pool(num_blocks, bs, hkv, d, 3)
    t = sum(q_lens)
    q, k, v = torch.randn(t, h, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    tree = {3: torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 0, 0, 1]],
                            dtype=torch.bool)}
    meta = A.build_metadata(q_lens, ctx, tables, bs, torch.device("cpu"), tree, use_native=True)
    ref = exact(q, k, v, kc, vc, meta)
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
    meta = A.build_metadata([1, 1], [4, 2], [[0, 1], [2, 3]], bs, torch.device("cpu"), use_native=True)
    ref = exact(q, k, v, kc, vc, meta)
    out = torch_path(True, q, k, v, kc, vc, meta)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("d", [16, 32, 64, 128])
@pytest.mark.parametrize("tree", [False, True])
def test_drafts_and_short_prompts_match_torch_path(torch_path, tree, d):
    """Verification queries (the last token plus a chain or a tree of drafts, up to 64 in all) on
    contexts across partitions, and short prompts with nothing cached: one query may see no key of
    a partition (its ancestors all in the one before)."""
    rng = random.Random(7 + tree)
    bs, h, hkv = 16, 8, 2
    q_lens = [1 + rng.randrange(64) for _ in range(9)] + [64, 2, 20]
    ctx = [rng.choice([250, 255, 256, 511, rng.randrange(1, 900)]) for _ in range(9)] + [300, 1, 0]
    tables, num_blocks = random_tables(q_lens, ctx, bs, rng, spare=3)
    trees = {}
    if tree:
        for i, n in enumerate(q_lens[:-1]):  # the last is a prompt: causal
            parents = [-1] + [rng.randrange(k) for k in range(1, n)]  # node k hangs under an earlier one
            trees[i] = torch.zeros(n, n, dtype=torch.bool)
            for k, p in enumerate(parents):
                trees[i][k] = trees[i][p] if p >= 0 else trees[i][k]
                trees[i][k, k] = True
    kc, vc = make_pool(num_blocks, bs, hkv, d, 5)
    t = sum(q_lens)
    q, k, v = torch.randn(t, h, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    meta = A.build_metadata(q_lens, ctx, tables, bs, torch.device("cpu"), trees, use_native=True)
    assert all(g.native is not None for g in meta.groups)  # all on the native path
    ref = exact(q, k, v, kc, vc, meta)
    out = torch_path(True, q, k, v, kc, vc, meta)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("d", [16, 32, 64, 128])
def test_long_chunks_native_too_and_rows_same_bits_in_any_group(torch_path, d):
    """A prefill chunk of 300 tokens goes through the kernel too, and each of its rows gives the
    same bits as that row alone (a decode step after a cached prefix) and as a row of a draft
    chain, whatever tile and group of the vector kernel it falls in: what seeded sampling with
    prefix caching relies on. A tree of more than 64 tokens stays on the torch path."""
    bs, h, hkv = 16, 8, 2
    n = 300
    kc, vc = make_pool(32, bs, hkv, d, 9)
    table = list(range(19))
    q, k, v = torch.randn(n, h, d), torch.randn(n, hkv, d), torch.randn(n, hkv, d)
    meta = A.build_metadata([n], [0], [table], bs, torch.device("cpu"), use_native=True)
    assert meta.groups[0].native is not None
    full = torch_path(True, q, k, v, kc, vc, meta)
    torch.testing.assert_close(full, exact(q, k, v, kc, vc, meta), rtol=1e-5, atol=1e-6)
    for p in (0, 255, 256, 299):  # the row alone, its keys cached
        one = A.build_metadata([1], [p], [table], bs, torch.device("cpu"), use_native=True)
        assert torch.equal(torch_path(True, q[p:p + 1], k[p:p + 1], v[p:p + 1], kc, vc, one), full[p:p + 1])
    # rows 250-260 as a draft chain, across a partition edge (in the chunk: tiles from row 240, groups
    # of 4 from 248; here tiles from 250, groups of 4, 4, 2, 1)
    chain = A.build_metadata([11], [250], [table], bs, torch.device("cpu"), use_native=True)
    assert torch.equal(torch_path(True, q[250:261], k[250:261], v[250:261], kc, vc, chain), full[250:261])
    tree = {0: torch.eye(65, dtype=torch.bool)}
    assert A.build_metadata([65], [0], [table], bs, torch.device("cpu"), tree, use_native=True).groups[0].native is None


@pytest.mark.parametrize("d,g", [(32, 1), (64, 2), (64, 3), (128, 4)])
def test_every_row_of_a_tile_gives_its_bits_alone(d, g):
    """Each query of a batch (a prefill chunk after a cached prefix, then a tree of drafts: tiles of
    16 queries, their (query, head) pairs 16 at a time in a vector's lanes, the rest in groups) gives
    the same bits as the same query in a call of its own (its pairs in groups), and the batch gives
    the same bits with every pair in groups (`lanes=False`, the benchmarks' baseline). Five draft tokens
    amid the tree have no query and no query sees them: their keys and values are NaN, and must not
    reach any query's output."""
    rng = np.random.default_rng(d + g)
    bs, hkv, ctx, chunk, tree = 16, 2, 290, 37, 64
    h, n, gone = hkv * g, ctx + chunk + tree, set(range(10, 15))
    table = rng.permutation(-(-n // bs) + 2)[:-(-n // bs)].reshape(1, -1).astype(np.int64)
    kc = rng.standard_normal((table.size * bs + 2 * bs, hkv, d), dtype=np.float32)
    vc = rng.standard_normal(kc.shape, dtype=np.float32)
    slots = [table[0, t // bs] * bs + t % bs for t in range(ctx + chunk, n)]
    kc[[slots[i] for i in gone]] = vc[[slots[i] for i in gone]] = np.nan
    # the chunk's rows: causal; the tree's: the chunk and, of its own tokens, itself and some before it
    live = [i for i in range(tree) if i not in gone]
    masks = [0] * chunk
    for i in live:
        masks.append(sum(1 << j for j in live if j < i and rng.random() < 0.3) | 1 << i)
    masks = np.array(masks, np.uint64).view(np.int64)
    prefix = np.concatenate([np.arange(ctx + 1, ctx + chunk + 1), np.full(len(live), ctx + chunk)]).astype(np.int64)
    m = len(masks)
    q = rng.standard_normal((m, h, d), dtype=np.float32)
    rows, seqs = np.arange(m, dtype=np.int64), np.zeros(m, np.int64)
    out = np.empty_like(q)
    native._C.paged_attention(q, kc, vc, table, rows, seqs, prefix, masks, out, bs, d ** -0.5, 1 << 40)
    assert np.isfinite(out).all()
    pairs = np.empty_like(q)
    native._C.paged_attention(q, kc, vc, table, rows, seqs, prefix, masks, pairs, bs, d ** -0.5, 1 << 40, lanes=False)
    assert np.array_equal(pairs, out)
    for i in range(m):
        one = np.empty_like(q)
        native._C.paged_attention(q, kc, vc, table, rows[i:i + 1], seqs[:1], prefix[i:i + 1], masks[i:i + 1], one,
                                  bs, d ** -0.5, 1 << 40)
        assert np.array_equal(one[i], out[i]), i


def test_bad_input_is_a_clear_error():
    q = np.zeros((3, 4, 8), np.float32)
    cache = np.zeros((16, 2, 8), np.float32)
    i64 = lambda *x: np.array(x, np.int64)  # noqa: E731
    ok = dict(q=q, k_cache=cache, v_cache=cache, block_tables=np.array([[0, 1], [2, 3]]), rows=i64(0, 1, 2),
              seqs=i64(0, 1, 1), prefix=i64(5, 6, 6), masks=i64(0, 1, 3), out=q.copy(), block_size=4, scale=0.5)
    native._C.paged_attention(**ok)
    bad = {
        "block ids within the pool": dict(block_tables=np.array([[0, 1], [2, 4]])),
        "keys within the block table": dict(prefix=i64(9, 6, 6)),
        "prefix >= 0": dict(prefix=i64(-1, 6, 6)),
        "rows within q": dict(rows=i64(0, 1, 3)),
        "non-decreasing": dict(seqs=i64(1, 0, 1)),
        "every query sees a key": dict(prefix=i64(0, 6, 6), masks=i64(0, 1, 3)),
        "multiple of kv heads": dict(q=np.zeros((3, 3, 8), np.float32), out=np.zeros((3, 3, 8), np.float32)),
        "whole blocks": dict(block_size=3),
    }
    for msg, change in bad.items():
        with pytest.raises(ValueError, match=msg):
            native._C.paged_attention(**dict(ok, **change))
    with pytest.raises(ValueError, match="keys within the block table"):  # a mask naming keys past the table
        native._C.paged_attention(**dict(ok, masks=i64(0, 1, 1 << 3)))
    with pytest.raises(TypeError):  # float64 would be a silent copy the kernel writes into: refused
        native._C.paged_attention(**dict(ok, out=np.zeros((3, 4, 8))))
    with pytest.raises(TypeError):  # so is a strided view
        native._C.paged_attention(**dict(ok, q=np.zeros((3, 4, 16), np.float32)[:, :, ::2]))


def test_engine_greedy_tokens_same_with_and_without_kernel(model_dirs, monkeypatch):
    """A whole generation (prefill, decode, continuous batching) gives the same tokens and
    logprobs either way."""
    from rollwise import LLM, SamplingParams
    llm = LLM(model_dirs["qwen3"], max_num_seqs=8, native_attention=True)
    prompts = [[5 + i, 9, 40 + 3 * i, 7] * (i + 1) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    runs = {}
    for on in (False, True):
        monkeypatch.setattr(native, "ENABLED", on)
        runs[on] = llm.generate(prompts, params)
    for a, b in zip(runs[False], runs[True]):
        assert a.token_ids == b.token_ids
        assert np.allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_seeded_sampling_reproducible_with_prefix_caching(model_dirs):
    """The second run finds the prompts cached and recomputes only their last tokens, alone: with
    the kernel those rows give the bits the full prefill gave, so the samples and logprobs repeat
    (the torch path has the same property; a kernel only for short groups would break it)."""
    from rollwise import LLM, SamplingParams
    llm = LLM(model_dirs["llama"], max_num_seqs=8, native_attention=True, enable_prefix_caching=True)
    prompts = [[3 + i % 50 for i in range(s, s + 90)] for s in range(4)]  # 90 tokens: a long prefill chunk
    params = [SamplingParams(temperature=1.0, max_tokens=16, seed=i) for i in range(4)]
    a, b = llm.generate(prompts, params), llm.generate(prompts, params)
    assert llm.metrics()["prefix_hit_rate"] > 0
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.logprobs for o in a] == [o.logprobs for o in b]


def test_default_takes_the_kernel_where_its_vector_path_runs(tmp_path):
    """native_attention=None (the default): the kernel for head sizes 32, 64 and 128, SDPA for
    others (its loop path is slower there at long contexts); True and False force either way."""
    from rollwise import LLM
    from rollwise.make_model import make_model
    for heads, vector in ((2, True), (4, True), (8, False)):  # hidden 128: head size 64, 32, then 16
        model = make_model(tmp_path / f"heads{heads}", layers=1, hidden=128, heads=heads, kv_heads=1, vocab=512)
        for asked, used in ((None, vector), (True, True), (False, False)):
            assert LLM(str(model), max_num_seqs=2, native_attention=asked).engine.runner.native_attention is used
