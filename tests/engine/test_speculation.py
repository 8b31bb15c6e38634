"""Speculative decoding is lossless: same tokens (greedy), same distribution (sampling), same logprobs."""
from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from rollwise import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 1000) for _ in range(rng.randint(3, 40))] for _ in range(n)]


@pytest.fixture(scope="module")
def baseline(model_dir):
    return LLM(model_dir, max_num_seqs=64)


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_greedy_tokens_and_logprobs_equal_without_speculation(model_dir, baseline, tree, batch):
    prompts = _prompts(batch, seed=batch)
    ref = baseline.generate(prompts, GREEDY)
    llm = LLM(model_dir, max_num_seqs=64, speculative="suffix", spec_controller="always", spec_tree=tree)
    for _ in range(2):  # the second round drafts from the first round's outputs too
        out = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in out] == [o.token_ids for o in ref]
        for a, b in zip(out, ref):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    m = llm.metrics()
    assert m["spec_accepted_tokens"] > 0 and 0 < m["spec_steps"] <= m["num_steps"]
    assert m["num_steps"] < 2 * baseline.metrics()["num_steps"]  # fewer steps than two plain rounds
    llm.engine.scheduler.check_integrity()
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks
    if tree and batch == 64:
        assert m["spec_kv_moves"] > 0  # accepted side branches were moved into place


@pytest.mark.parametrize("tree", [False, True])
def test_top_logprobs_equal_without_speculation(model_dir, baseline, tree):
    """Each emitted token's top logprobs come from its own verification row: the same as decoding
    one token a step, greedy and seeded."""
    prompts = _prompts(8, seed=11)
    llm = LLM(model_dir, max_num_seqs=64, speculative="suffix", spec_controller="always", spec_tree=tree)
    for params in (SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=3),
                   SamplingParams(temperature=0.8, seed=5, max_tokens=30, ignore_eos=True, logprobs=3)):
        ref = baseline.generate(prompts, params)
        for _ in range(2):
            out = llm.generate(prompts, params)
            assert [o.token_ids for o in out] == [o.token_ids for o in ref]
            for a, b in zip(out, ref):
                assert len(a.top_logprobs) == len(a.token_ids)
                assert [list(t) for t in a.top_logprobs] == [list(t) for t in b.top_logprobs]
                assert [v for t in a.top_logprobs for v in t.values()] == pytest.approx(
                    [v for t in b.top_logprobs for v in t.values()], abs=1e-4)
    assert llm.metrics()["spec_accepted_tokens"] > 0


def test_speculation_with_preemption_chunking_and_prefix_cache(model_dir, baseline):
    prompts = [p + q for p, q in zip(_prompts(12, 1), _prompts(12, 2))]
    ref = baseline.generate(prompts, GREEDY)
    llm = LLM(model_dir, speculative="suffix", spec_controller="always", spec_tree=True,
              max_num_batched_tokens=48, num_kv_blocks=30, block_size=8, max_num_seqs=12)
    for _ in range(2):
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == [o.token_ids for o in ref]
    m = llm.metrics()
    assert m["num_preemptions"] > 0 and m["spec_accepted_tokens"] > 0 and m["prefix_hits"] > 0
    llm.engine.scheduler.check_integrity()


def test_abort_mid_speculation_frees_everything(model_dir):
    llm = LLM(model_dir, speculative="suffix", spec_controller="always")
    eng = llm.engine
    p = _prompts(1, 3)[0]
    llm.generate([p], GREEDY)
    rids = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)) for _ in range(3)]
    for _ in range(6):
        eng.step()
    for r in rids:
        assert eng.abort(r).finish_reason == "abort"
    eng.scheduler.check_integrity()
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks and not eng.spec.cache.requests


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: p = 0.001)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_inverse_cdf_draws_each_token_with_its_probability():
    import torch

    from rollwise.engine.sampler import inverse_cdf
    p = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.05, 0.0])
    n = 40_000
    u = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    got = inverse_cdf(p.expand(n, -1), u)
    counts = torch.bincount(got, minlength=6).tolist()
    assert counts[1] == counts[5] == 0  # probability 0: never
    expect = [n * float(x) for x in p]
    chi2 = sum((c - e) ** 2 / e for c, e in zip(counts, expect) if e > 0)
    assert chi2 < _chi2_critical(3), (counts, chi2)
    # the ends of [0, 1): the first token, and the last one with probability > 0 (never the zeros after it)
    edge = inverse_cdf(p.expand(2, -1), torch.tensor([0.0, 1 - 2**-53], dtype=torch.float64))
    assert edge.tolist() == [0, 4]
    # a row's draw does not depend on the batch (unnormalized rows are fine)
    rows = torch.rand(5, 1000, generator=torch.Generator().manual_seed(1)) ** 4
    us = torch.rand(5, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    assert inverse_cdf(rows, us).tolist() == [int(inverse_cdf(rows[i:i + 1], us[i:i + 1])[0]) for i in range(5)]


@pytest.mark.parametrize("tree,pen", [(False, {}), (True, {}), (True, {"repetition_penalty": 2.0, "frequency_penalty": 1.0})])
def test_sampling_distribution_is_unchanged(model_dir, tree, pen):
    """Two-sample chi-square on the joint distribution of 3 sampled tokens (top-k 3: 27 outcomes);
    with penalties, each drafted position's distribution depends on the drafts before it."""
    prompt = _prompts(1, 5)[0]
    n = 700
    params = [SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True, seed=i, **pen) for i in range(n)]
    plain = LLM(model_dir, max_num_seqs=64).generate([prompt] * n, params)
    spec_llm = LLM(model_dir, max_num_seqs=64, speculative="suffix", spec_controller="always", spec_tree=tree,
                   spec_min_token_prob=0.0, spec_alpha=4.0)
    spec = spec_llm.generate([prompt] * n, [SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True, **pen)
                                            for _ in range(n)])
    assert spec_llm.metrics()["spec_accepted_tokens"] > 100  # rejection sampling was exercised
    a, b = Counter(tuple(o.token_ids) for o in plain), Counter(tuple(o.token_ids) for o in spec)
    keys = [k for k in set(a) | set(b) if a[k] + b[k] >= 5]
    chi2 = sum((a[k] - b[k]) ** 2 / (a[k] + b[k]) for k in keys)
    assert chi2 < _chi2_critical(len(keys) - 1), (chi2, len(keys))


@pytest.mark.parametrize("tree", [False, True])
def test_seeded_sampling_gives_the_same_tokens_with_speculation(model_dir, baseline, tree):
    """A seeded request's tokens do not depend on what was drafted (or on the batch). Half the rows
    also have a top-k: verification then finds a row's nucleus among its top-k's ids, the sampler's
    mixed batch among its top 256 probabilities; both must end it at the same token."""
    prompts = _prompts(16, seed=7)
    params = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, ignore_eos=True, seed=100 + i,
                             min_p=0.05 * (i % 3), top_k=(0, 20)[i % 2]) for i in range(16)]
    ref = baseline.generate(prompts, params)
    llm = LLM(model_dir, max_num_seqs=64, speculative="suffix", spec_controller="always", spec_tree=tree,
              spec_min_token_prob=0.0)
    for _ in range(2):  # the second round drafts from the first round's outputs
        out = llm.generate(prompts, params)
        assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert llm.metrics()["spec_accepted_tokens"] > 0


@pytest.mark.parametrize("tree", [False, True])
def test_penalties_are_lossless_with_speculation(model_dir, baseline, tree):
    """Each drafted position is penalized with the drafts verified before it: greedy and seeded
    requests with penalties give the same tokens and logprobs as decoding one token a step."""
    prompts = _prompts(8, seed=12)
    pen = dict(repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2)
    llm = LLM(model_dir, max_num_seqs=64, speculative="suffix", spec_controller="always", spec_tree=tree,
              spec_min_token_prob=0.0)
    for params in (SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2, **pen),
                   SamplingParams(temperature=0.8, seed=3, max_tokens=40, ignore_eos=True, **pen)):
        ref = baseline.generate(prompts, params)
        for _ in range(2):  # the second round drafts from the first round's outputs
            out = llm.generate(prompts, params)
            assert [o.token_ids for o in out] == [o.token_ids for o in ref]
            for a, b in zip(out, ref):
                assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
                assert [list(t) for t in a.top_logprobs] == [list(t) for t in b.top_logprobs]
    assert llm.metrics()["spec_accepted_tokens"] > 0


def test_teacher_forcing_emits_the_trace_with_model_logprobs(model_dir):
    prompt = _prompts(1, 6)[0]
    trace = [7, 8, 9, 10, 11] * 6
    plain = LLM(model_dir).engine
    rid = plain.add_request(prompt, SamplingParams(temperature=0), forced_output=trace)
    out = None
    while plain.has_unfinished:
        out = next((o for o in plain.step() if o.request_id == rid), out)
    assert out.token_ids == trace and out.finish_reason == "length"
    spec = LLM(model_dir, speculative="suffix", spec_controller="always").engine
    rid = spec.add_request(prompt, SamplingParams(temperature=0), forced_output=trace)
    out2 = None
    while spec.has_unfinished:
        out2 = next((o for o in spec.step() if o.request_id == rid), out2)
    assert out2.token_ids == trace
    assert out2.logprobs == pytest.approx(out.logprobs, abs=1e-4)
    m = spec.metrics()
    assert m["spec_accepted_tokens"] >= 15 and m["num_steps"] < plain.metrics()["num_steps"]


def test_a_trajectory_session_extends_its_drafting_tree_across_turns(model_dir):
    eng = LLM(model_dir, speculative="suffix", spec_controller="always").engine
    prompt, outs = _prompts(1, 6)[0], []
    for turn in range(2):
        out = [7, 8, 9, 10] * 5
        eng.add_request(prompt, SamplingParams(temperature=0), forced_output=out, session="traj-1")
        while eng.has_unfinished:
            outs.extend(eng.step())
        prompt = prompt + out + [3, 4, 5]
    tree, tokens = eng.spec.cache._sessions["traj-1"]
    assert tokens == prompt[:-3]  # both turns' prompts and outputs, the first tree extended, not rebuilt
    assert [o.token_ids for o in outs if o.finished] == [[7, 8, 9, 10] * 5] * 2


def test_prompt_lookup_is_lossless_greedy_and_seeded(model_dir, baseline):
    """vLLM's "ngram" speculation (the request's own text only): greedy tokens and logprobs, and
    seeded tokens, as decoding one token a step; its drafts are counted under their own source."""
    prompts = _prompts(16, seed=21)
    llm = LLM(model_dir, max_num_seqs=64, speculative="ngram", spec_controller="always", spec_lookup_min=1,
              spec_lookup_max=3, spec_max_tokens=6)
    for params in (GREEDY, [SamplingParams(temperature=0.8, seed=40 + i, max_tokens=30, ignore_eos=True)
                            for i in range(16)]):
        ref = baseline.generate(prompts, params)
        out = llm.generate(prompts, params)
        assert [o.token_ids for o in out] == [o.token_ids for o in ref]
        for a, b in zip(out, ref):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    m = llm.metrics()
    assert m["spec_accepted_ngram"] == m["spec_accepted_tokens"] > 0
    assert m["spec_drafted_ngram"] == m["spec_drafted_tokens"] and "spec_drafted_global" not in m
    assert m["spec_ngram_context_tokens"] == 0  # every request's context went when it finished
    llm.engine.scheduler.check_integrity()
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_vllm_speculative_config_maps_to_the_engine_and_refuses_what_needs_a_draft_model(model_dir):
    llm = LLM(model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    cfg = llm.engine.config
    assert (cfg.speculative, cfg.spec_max_tokens, cfg.lookup_range) == ("ngram", 4, (3, 3))
    assert llm.engine.spec.cache.max_n == 3 and llm.engine.spec.cache.max_spec_tokens == 4
    cfg = LLM(model_dir, speculative_config={"method": "suffix", "suffix_decoding_max_tree_depth": 12,
                                             "suffix_decoding_max_spec_factor": 2.0}).engine.config
    assert (cfg.speculative, cfg.spec_max_depth, cfg.spec_max_tokens, cfg.spec_alpha) == ("suffix", 12, 12, 2.0)
    assert LLM(model_dir, speculative_config={"model": "[ngram]"}).engine.config.lookup_range == (5, 5)
    for bad, match in [({"method": "eagle3", "model": "x"}, r"one of \['suffix', 'ngram'\]"),
                       ({"method": "ngram", "draft_tensor_parallel_size": 1}, "unknown speculative_config keys"),
                       ({"method": "suffix", "model": "ngram"}, "disagree"),
                       ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "spec_lookup_min <="),
                       ("ngram", "must be a dict")]:
        with pytest.raises(ValueError, match=match):
            LLM(model_dir, speculative_config=bad)
    with pytest.raises(ValueError, match="disagree"):
        LLM(model_dir, speculative="suffix", speculative_config={"method": "ngram"})
