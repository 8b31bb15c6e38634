"""Batch invariance: with `batch_invariant`, a request's tokens, logprobs and top logprobs are the same
bits alone, in a batch, with its prompt chunked, from the prefix cache and with speculation."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from rollwise import LLM, SamplingParams
from rollwise.engine.models.linear import Linear, check_invariant, pack, packed_linear

SEEDED = SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True, logprobs=2)


def _prompts(n: int = 12) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(10, 1000) for _ in range(rng.randint(3, 90))] for _ in range(n)]


def _bits(outs) -> list:
    return [(o.token_ids, o.logprobs, [sorted(t.items()) for t in o.top_logprobs]) for o in outs]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_a_request_gets_the_same_bits_whatever_shares_its_batch(model_dirs, family):
    d, prompts = model_dirs[family], _prompts()
    kw = dict(kv_cache_gb=0.05, batch_invariant=True)
    alone = LLM(d, **kw)
    ref = _bits([alone.generate([p], SEEDED)[0] for p in prompts])
    engines = {"batched": LLM(d, **kw), "chunked prefill": LLM(d, max_num_batched_tokens=40, **kw),
               "chain drafts": LLM(d, speculative="suffix", spec_controller="always", **kw),
               "tree drafts": LLM(d, speculative="suffix", spec_controller="always", spec_tree=True, **kw)}
    for name, llm in engines.items():
        for _ in range(2):  # the second round from the prefix cache (and drafting from the first)
            assert _bits(llm.generate(prompts, SEEDED)) == ref, name
    assert engines["tree drafts"].metrics()["spec_accepted_tokens"] > 0
    # the same prompts in another order, greedy and seeded mixed, a different number at a time
    mixed = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2), SEEDED]
    order = list(range(len(prompts)))[::-1]
    outs = _bits(engines["batched"].generate([prompts[i] for i in order], [mixed[i % 2] for i in order]))
    for i, o in zip(order, outs):
        assert o == (ref[i] if i % 2 else _bits(alone.generate([prompts[i]], mixed[0]))[0]), i


def test_without_it_the_batch_moves_the_last_bits(model_dirs):
    """What the mode is for: by default a linear's small-batch path rounds a row differently from
    the same row in a larger batch (on the CPUs we run on; the test shows the check above can fail)."""
    d, prompts = model_dirs["llama"], _prompts()
    alone = LLM(d, kv_cache_gb=0.05)
    ref = [alone.generate([p], SEEDED)[0].logprobs for p in prompts]
    assert [o.logprobs for o in LLM(d, kv_cache_gb=0.05).generate(prompts, SEEDED)] != ref


def test_routing_is_batch_invariant_too(model_dirs):
    d, prompts = model_dirs["qwen3_moe"], _prompts(6)
    kw = dict(kv_cache_gb=0.05, batch_invariant=True, enable_return_routed_experts=True)
    p = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, return_routed_experts=True)
    alone = LLM(d, **kw)
    ref = [alone.generate([x], p)[0].routed_experts for x in prompts]
    outs = LLM(d, max_num_batched_tokens=40, **kw).generate(prompts, p)
    assert all(torch.equal(torch.as_tensor(o.routed_experts), torch.as_tensor(r)) for o, r in zip(outs, ref))


def test_what_it_cannot_hold_in_is_refused(model_dirs):
    d = model_dirs["llama"]
    for kw, word in ((dict(dtype="bfloat16"), "float32"), (dict(native_attention=False), "native attention"),
                     (dict(speculative="suffix", spec_tree=True, spec_max_tokens=64), "spec_max_tokens")):
        with pytest.raises(ValueError, match=word):
            LLM(d, kv_cache_gb=0.05, batch_invariant=True, **kw)


def test_the_startup_check_tells_the_kernels_apart():
    lin = Linear(256, 768, bias=False)
    packed = pack(lin.weight)
    assert check_invariant(lambda x: packed_linear(x, packed), lin.weight)
    assert not check_invariant(lambda x: F.linear(x, lin.weight), lin.weight)  # MKL: rows 1-3 round otherwise
    lin.batch_invariant = True
    lin.repack()
    x = torch.randn(9, 256)
    with torch.inference_mode():
        assert torch.equal(lin(x)[:1], lin(x[:1]))  # a row alone: padded to the kernel the batch runs
        lin.batch_invariant = False
        plain = [lin(x[:m])[0] for m in (1, 2, 3, 9)]  # MKL's path below 4 rows, oneDNN's above
    assert not all(torch.equal(plain[0], y) for y in plain[1:])
