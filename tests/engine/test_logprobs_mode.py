"""vLLM's logprobs_mode (EngineConfig.logprobs_mode, `LLM(logprobs_mode=...)`, `--logprobs-mode`): what
outputs carry as logprobs. By default the distribution sampled from before top-k / top-p; vLLM's
"raw_logprobs" / "raw_logits" are the model's own, before penalties, bias and temperature;
"processed_logprobs" / "processed_logits" those after temperature, min-p, top-k and top-p. Sampling
itself does not change, and speculation gives the same values as decoding without it."""
from __future__ import annotations

import math

import pytest
import torch

from rollwise import LLM, SamplingParams
from rollwise.config import EngineConfig

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 12, 13, 14]]
PENALIZED = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3, repetition_penalty=1.8,
                           presence_penalty=0.5)
CUT = SamplingParams(temperature=0.7, top_k=3, max_tokens=10, ignore_eos=True, logprobs=5, seed=11)


@pytest.fixture(scope="module")
def engine(model_dir):
    made: dict = {}

    def get(mode, **kw):
        key = (mode, tuple(sorted(kw.items())))
        if key not in made:
            made[key] = LLM(model_dir, logprobs_mode=mode, **kw)
        return made[key]
    return get


def _finite(top: dict) -> dict:
    return {t: v for t, v in top.items() if v > -math.inf}


def test_raw_logprobs_are_the_models_own_before_penalties(engine):
    """Greedy under penalties: the same tokens either way; raw_logprobs are those tokens' logprobs as
    the model gives them (its prompt logprobs of prompt + output at temperature 1), the default's the
    penalized distribution's, which differ."""
    ours, raw = engine(None).generate(PROMPTS, PENALIZED), engine("raw_logprobs").generate(PROMPTS, PENALIZED)
    score = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3)
    moved = 0.0
    for p, a, b in zip(PROMPTS, ours, raw):
        assert a.token_ids == b.token_ids
        scored = engine(None).generate([p + b.token_ids], score)[0]
        want = scored.prompt_token_logprobs[len(p):]
        assert torch.allclose(torch.tensor(b.logprobs), torch.tensor(want), atol=1e-5)
        for top, ref in zip(b.top_logprobs, scored.prompt_top_logprobs[len(p):]):
            assert list(top) == list(ref) and torch.allclose(torch.tensor(list(top.values())),
                                                             torch.tensor(list(ref.values())), atol=1e-5)
        moved = max(moved, max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)))
    assert moved > 1e-3  # the penalties moved the default's


def test_raw_logits_are_raw_logprobs_before_the_log_softmax(engine):
    """Per position, a logit less its logprob is one constant (the log-sum-exp) for every entry."""
    raw, logits = engine("raw_logprobs").generate(PROMPTS, PENALIZED), engine("raw_logits").generate(PROMPTS, PENALIZED)
    for a, b in zip(raw, logits):
        assert a.token_ids == b.token_ids
        for lp, lg, top_lp, top_lg in zip(a.logprobs, b.logprobs, a.top_logprobs, b.top_logprobs):
            assert list(top_lp) == list(top_lg)
            shift = [top_lg[t] - top_lp[t] for t in top_lp] + [lg - lp]
            assert max(shift) - min(shift) < 1e-4


def test_processed_logprobs_are_renormalized_over_what_top_k_keeps(engine):
    """Sampled at temperature 0.7 with top-k 3 (seeded): the same tokens in every mode; the processed
    modes' top 5 hold 3 finite entries that sum to probability 1, the default's 5 that do not; the
    processed logprob is the default's less the log of the kept mass, the processed logit the default's
    logprob plus one constant a position."""
    outs = {m: engine(m).generate(PROMPTS, CUT) for m in (None, "processed_logprobs", "processed_logits")}
    for a, b, c in zip(*outs.values()):
        assert a.token_ids == b.token_ids == c.token_ids
        for tok, lp_a, lp_b, top_a, top_b, top_c in zip(a.token_ids, a.logprobs, b.logprobs, a.top_logprobs,
                                                         b.top_logprobs, c.top_logprobs):
            kept = _finite(top_b)
            assert len(top_b) == 5 and len(kept) == 3 and len(_finite(top_a)) == 5
            assert list(kept) == list(top_a)[:3] and tok in kept
            mass = math.log(sum(math.exp(top_a[t]) for t in kept))
            assert abs(math.log(sum(math.exp(v) for v in kept.values()))) < 1e-5
            assert abs(lp_b - (lp_a - mass)) < 1e-5
            shift = [top_c[t] - top_a[t] for t in kept]
            assert max(shift) - min(shift) < 1e-4 and len(_finite(top_c)) == 3


def test_speculation_gives_the_same_values_in_every_mode(engine):
    """Drafts verified (suffix speculation, every draft token): tokens, logprobs and top logprobs as
    decoding without it, in the raw and the processed modes alike."""
    for mode, params in (("raw_logprobs", PENALIZED), ("processed_logprobs", CUT)):
        plain = engine(mode).generate(PROMPTS * 2, params)
        spec = engine(mode, speculative="suffix", spec_controller="always")
        for _ in range(2):  # the second round drafts from the first's outputs
            got = spec.generate(PROMPTS * 2, params)
            for a, b in zip(plain, got):
                assert a.token_ids == b.token_ids
                assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
                assert [list(t) for t in a.top_logprobs] == [list(t) for t in b.top_logprobs]
        assert spec.metrics()["spec_accepted_tokens"] > 0


def test_prompt_logprobs_follow_the_mode_as_vllms(engine):
    """Under a mode, prompt logprobs are the model's own at temperature 1 (vLLM's), whatever the
    request's temperature; by default at the request's temperature."""
    hot = SamplingParams(temperature=0.5, max_tokens=1, prompt_logprobs=2, seed=0)
    cold = SamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=2, seed=0)
    raw = engine("raw_logprobs").generate(PROMPTS[:1], hot)[0]
    ours, ours_hot = engine(None).generate(PROMPTS[:1], cold)[0], engine(None).generate(PROMPTS[:1], hot)[0]
    assert torch.allclose(torch.tensor(raw.prompt_token_logprobs[1:]), torch.tensor(ours.prompt_token_logprobs[1:]),
                          atol=1e-5)
    assert not torch.allclose(torch.tensor(ours_hot.prompt_token_logprobs[1:]),
                              torch.tensor(ours.prompt_token_logprobs[1:]), atol=1e-3)


def test_an_unknown_mode_names_the_valid_ones(model_dir):
    with pytest.raises(ValueError, match="logprobs_mode must be one of .*'processed_logprobs', 'raw_logprobs'"):
        EngineConfig(model=model_dir, logprobs_mode="logits")
