"""Engine behaviour: batching, prefix caching, preemption and chunking never change outputs."""
from __future__ import annotations

import dataclasses
import random

import pytest

from rollwise import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _prompts(n: int, seed: int = 0, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    head = [rng.randrange(10, 1000) for _ in range(shared)]
    return [head + [rng.randrange(10, 1000) for _ in range(rng.randint(1, 70))] for _ in range(n)]


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, max_num_seqs=64)


def test_alone_equals_in_batch_of_64(llm):
    prompts = _prompts(64, shared=20)
    batch = llm.generate(prompts, GREEDY)
    for i in (0, 17, 63):
        alone = LLM(llm.engine.config.model).generate([prompts[i]], GREEDY)[0]
        assert alone.token_ids == batch[i].token_ids
        assert alone.logprobs == pytest.approx(batch[i].logprobs, abs=1e-4)


def test_prefix_caching_on_and_off_agree(model_dir):
    prompts = _prompts(24, seed=1, shared=40)
    on = LLM(model_dir, enable_prefix_caching=True)
    off = LLM(model_dir, enable_prefix_caching=False)
    # two rounds: the second one hits the cache built by the first
    for _ in range(2):
        a, b = on.generate(prompts, GREEDY), off.generate(prompts, GREEDY)
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert on.metrics()["prefix_hits"] > 0 and off.metrics()["prefix_hits"] == 0
    assert on.metrics()["prefill_tokens"] < off.metrics()["prefill_tokens"]
    assert max(o.num_cached_tokens for o in a) >= 32


def test_cached_prefix_skips_prefill_compute(model_dir):
    llm = LLM(model_dir, block_size=16)
    p = _prompts(1, seed=2, shared=64)[0]
    llm.generate([p], GREEDY)
    before = llm.metrics()["prefill_tokens"]
    out = llm.generate([p + [5, 6, 7]], GREEDY)[0]
    assert out.num_cached_tokens == (len(p) // 16) * 16
    assert llm.metrics()["prefill_tokens"] - before == len(p) + 3 - out.num_cached_tokens


@pytest.mark.parametrize("budget", [1024, 40])
def test_siblings_arriving_together_compute_their_prompt_once(model_dir, budget):
    """A group's samples queued at once (GRPO's n): the first computes the shared prompt, the others
    wait for its blocks instead of computing them in the same step; outputs are unchanged."""
    p = _prompts(1, seed=4, shared=90)[0]  # > 90 tokens: chunked over several steps at budget 40
    params = [dataclasses.replace(GREEDY, temperature=1.0, seed=s) for s in range(8)]
    llm = LLM(model_dir, block_size=16, max_num_batched_tokens=budget)
    outs = llm.generate([p] * 8, params)
    full = (len(p) // 16) * 16 if len(p) % 16 else len(p) - 16
    assert [o.num_cached_tokens for o in outs] == [0] + [full] * 7
    assert llm.metrics()["prefill_tokens"] == len(p) + 7 * (len(p) - full)
    # a second group that shares only the first 48 tokens waits for them too, then computes the rest
    q = p[:48] + [7] * 30
    outs2 = llm.generate([q] * 3 + [p], GREEDY)
    assert [o.num_cached_tokens for o in outs2] == [48, 64, 64, full]
    off = LLM(model_dir, block_size=16, max_num_batched_tokens=budget, enable_prefix_caching=False)
    assert [o.token_ids for o in off.generate([p] * 8, params)] == [o.token_ids for o in outs]
    llm.engine.scheduler.check_integrity()


def test_n_samples_per_prompt(llm):
    ps = _prompts(2, seed=5, shared=40)
    sp = dataclasses.replace(GREEDY, temperature=1.0, seed=7)
    outs = llm.generate(ps, sp, n=3)
    assert [o.prompt_token_ids for o in outs] == [ps[0]] * 3 + [ps[1]] * 3
    for j in range(3):  # sample j is seeded seed + j: the same tokens as a request of its own
        assert llm.generate([ps[1]], dataclasses.replace(sp, seed=7 + j))[0].token_ids == outs[3 + j].token_ids
    assert len({tuple(o.token_ids) for o in outs[:3]}) > 1
    assert sp.for_sample(0) is sp and dataclasses.replace(sp, seed=2**63 - 1).for_sample(1).seed == -(2**63)
    with pytest.raises(ValueError, match="n must be"):
        llm.generate(ps, sp, n=0)
    with pytest.raises(ValueError, match="group_ids"):
        llm.generate(ps, sp, group_ids=["a"])


def test_sampling_params_n_gives_vllm_outputs_per_prompt(llm):
    """SamplingParams(n=...) (vLLM's): one output per prompt, its samples in .outputs, the same tokens
    as generate's flat n; a prompt's own n may differ; the engine itself takes one sample a request."""
    ps = _prompts(2, seed=5, shared=40)
    sp = dataclasses.replace(GREEDY, temperature=1.0, seed=7)
    flat = llm.generate(ps, sp, n=3)
    outs = llm.generate(ps, sampling_params=dataclasses.replace(sp, n=3))
    assert len(outs) == 2 and [len(o.outputs) for o in outs] == [3, 3]
    assert [c.token_ids for o in outs for c in o.outputs] == [o.token_ids for o in flat]
    assert [c.index for o in outs for c in o.outputs] == [0, 1, 2, 0, 1, 2] == [o.index for o in flat]
    assert [o.prompt_token_ids for o in outs] == ps and outs[1].token_ids == outs[1].outputs[0].token_ids
    c, s = outs[0].outputs[2], outs[0].samples[2]
    assert c.text == s.text and c.finish_reason == s.finish_reason == "length"
    assert c.cumulative_logprob == pytest.approx(sum(s.logprobs))
    assert [p[t].logprob for p, t in zip(c.logprobs, c.token_ids)] == s.logprobs  # vLLM's {id: Logprob}
    mixed = llm.generate(ps, [dataclasses.replace(sp, n=2), sp])
    assert [len(o.outputs) for o in mixed] == [2, 1]
    assert [x.token_ids for x in mixed[0].outputs] == [o.token_ids for o in flat[:2]]
    assert mixed[1].outputs[0].token_ids == flat[3].token_ids
    one = llm.generate(ps[0], dataclasses.replace(sp, logprobs=3))[0]  # n = 1: vLLM's .outputs[0] is the output
    (c,) = one.outputs
    assert one.samples is None and one.prompt is None and c.token_ids == one.token_ids and c.index == 0
    for i, (t, pos) in enumerate(zip(one.token_ids, c.logprobs)):  # the sampled token first, then the top 3
        assert list(pos)[0] == t and pos[t].logprob == one.logprobs[i]
        top = list(one.top_logprobs[i])
        assert {k: (p.logprob, p.rank) for k, p in pos.items() if k in top} == {
            k: (one.top_logprobs[i][k], r) for r, k in enumerate(top, 1)}
        assert set(pos) == {t, *top}  # its rank: its place among the top 3, else its rank in the vocabulary
        assert pos[t].rank == (top.index(t) + 1 if t in top else one.top_logprobs[i].rank) and pos[t].rank >= 1
        assert (pos[t].rank > 3) == (t not in top)
        spelled = {k: llm.tokenizer.decode([k], skip_special_tokens=False) for k in pos}  # (characters' pieces:
        # test_vllm_params)
        assert all(x.decoded_token == spelled[k] for k, x in pos.items() if not spelled[k].endswith("\ufffd"))
    texts = llm.generate(["a b", "c"], dataclasses.replace(GREEDY, n=2, max_tokens=2))
    assert [o.prompt for o in texts] == ["a b", "c"] == [o.samples[1].prompt for o in texts]
    with pytest.raises(ValueError, match="not both"):
        llm.generate(ps, dataclasses.replace(sp, n=2), n=2)
    with pytest.raises(ValueError, match="n must be >= 1 and <= 128"):
        SamplingParams(n=0)
    assert SamplingParams(logprobs=None).logprobs == 0  # vLLM's default spelled out
    with pytest.raises(ValueError, match="one sample"):
        llm.engine.add_request(ps[0], dataclasses.replace(sp, n=2))
    assert not llm.engine.has_unfinished


def test_vllms_engine_arguments_are_taken_where_they_agree_with_the_engine(model_dir, llm):
    """A vLLM script's LLM(...) runs as written: the arguments with nothing to do here are checked
    and dropped, vLLM's dtype names map to ours; ones that ask for what this engine does not do, or
    that it does not know, are a ValueError naming the valid ones."""
    vllm = LLM(model_dir, dtype="auto", gpu_memory_utilization=0.5, enforce_eager=True, tensor_parallel_size=1,
               trust_remote_code=True, enable_sleep_mode=True, enable_chunked_prefill=True, max_num_seqs=64)
    assert vllm.engine.config.dtype == "float32" and vllm.engine.config.max_num_seqs == 64
    ps = _prompts(3, seed=6, shared=0)
    assert [o.token_ids for o in vllm.generate(ps, GREEDY)] == [o.token_ids for o in llm.generate(ps, GREEDY)]
    assert LLM(model_dir, dtype="half", num_kv_blocks=8).engine.config.dtype == "float16"
    # verl's and TRL's colocated engines: one per trainer process, in that process
    colocated = LLM(model_dir, distributed_executor_backend="external_launcher", model_impl="vllm",
                    load_format="safetensors", compilation_config={"cudagraph_capture_sizes": [1, 2]},
                    disable_mm_preprocessor_cache=True, logprobs_mode="processed_logprobs", num_kv_blocks=64)
    assert colocated.engine.config.logprobs_mode == "processed_logprobs"
    assert [o.token_ids for o in colocated.generate(ps, GREEDY)] == [o.token_ids for o in llm.generate(ps, GREEDY)]
    with pytest.raises(ValueError, match="does not exist"):
        LLM(model_dir + "-missing", dtype="auto")
    for kw, match in (({"tensor_parallel_size": 2}, "tensor_parallel_size must be one of"),
                      ({"distributed_executor_backend": "ray"}, r"one of \[None, 'external_launcher', 'uni', 'mp'\]"),
                      ({"model_impl": "transformers"}, r"model_impl must be one of \['auto', 'vllm'\]"),
                      ({"gpu_memory_utilization": 1.5}, r"in \(0, 1\]"),
                      ({"gpu_memory_utilization": 0.9, "device": "cuda"}, "kv_cache_gb"),
                      ({"swap_space": 4}, r"unknown LLM arguments \['swap_space'\]; valid: .*'max_num_seqs'")):
        with pytest.raises(ValueError, match=match):
            LLM(model_dir, **kw)


def test_chat_renders_each_conversation_as_vllm_does(llm):
    """LLM.chat (vLLM's): one conversation or several, the template's options passed through; the
    prompt is the rendering, the reply what generate gives for it."""
    tok, conv = llm.tokenizer, [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    one = llm.chat(conv, GREEDY)
    assert len(one) == 1 and one[0].prompt_token_ids == tok.encode_chat(conv)
    assert one[0].token_ids == llm.generate(tok.encode_chat(conv), GREEDY)[0].token_ids
    convs = [conv + [{"role": "assistant", "content": a}] for a in ("he", "well")]
    two = llm.chat(convs, GREEDY, add_generation_prompt=False, continue_final_message=True, tools=tools,
                   chat_template_kwargs={"enable_thinking": False})
    want = [tok.encode_chat(c, False, tools, True, enable_thinking=False) for c in convs]
    assert [o.prompt_token_ids for o in two] == want
    assert want[0] != tok.encode_chat(convs[0], False, None, True)  # the tools are in the prompt


def test_chunked_prefill_and_preemption_do_not_change_outputs(model_dir, llm):
    prompts = _prompts(16, seed=3, shared=30)
    ref = llm.generate(prompts, GREEDY)
    tight = LLM(model_dir, max_num_batched_tokens=24, num_kv_blocks=14, block_size=8, max_num_seqs=16)
    got = tight.generate(prompts, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    m = tight.metrics()
    assert m["num_preemptions"] > 0
    tight.engine.scheduler.check_integrity()
    assert tight.engine.blocks.num_free_blocks == tight.engine.blocks.num_blocks


def test_seeded_sampling_reproducible_across_batch_compositions(llm):
    prompts = _prompts(20, seed=4)
    params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=100 + i, max_tokens=10, ignore_eos=True)
              for i in range(20)]
    full = llm.generate(prompts, params)
    part = llm.generate(prompts[5:9], params[5:9])
    assert [o.token_ids for o in part] == [o.token_ids for o in full[5:9]]
    rev = llm.generate(prompts[::-1], params[::-1])[::-1]
    assert [o.token_ids for o in rev] == [o.token_ids for o in full]
    other_seed = llm.generate(prompts[:1], SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True))
    assert other_seed[0].token_ids != full[0].token_ids


def test_logprobs_are_at_the_request_temperature(llm):
    import torch
    p = _prompts(1, seed=5)[0]
    out = llm.generate([p], SamplingParams(temperature=0.5, seed=1, max_tokens=3, ignore_eos=True))[0]
    greedy = llm.generate([p + out.token_ids[:0]], SamplingParams(temperature=0, max_tokens=1))[0]
    # recompute: logprob at T=0.5 of the first sampled token from the raw logprobs of the distribution
    model = llm.engine.runner.model
    from rollwise.engine.attention import build_metadata
    cfg = model.config
    kv = (torch.zeros(cfg.num_layers, 128, cfg.num_kv_heads, cfg.head_dim),) * 2
    kv = (kv[0], kv[1].clone())
    with torch.no_grad():
        h = model(torch.tensor(p), torch.arange(len(p)), build_metadata([len(p)], [0], [list(range(8))], 16, "cpu"), kv)
        logits = model.logits(h[-1:])[0]
    expected = torch.log_softmax(logits / 0.5, -1)[out.token_ids[0]].item()
    assert out.logprobs[0] == pytest.approx(expected, abs=1e-4)
    assert greedy.logprobs[0] == pytest.approx(torch.log_softmax(logits, -1).max().item(), abs=1e-4)


def test_top_logprobs_are_the_most_likely_tokens_at_the_request_temperature(llm):
    """`logprobs=k`: per output token, the k most likely tokens and their logprobs under the same
    distribution as the sampled token's logprob (here recomputed with the model directly)."""
    import torch
    from rollwise.engine.attention import build_metadata
    p = _prompts(1, seed=8)[0]
    out = llm.generate([p], SamplingParams(temperature=0.7, seed=2, max_tokens=4, ignore_eos=True, logprobs=5))[0]
    assert len(out.top_logprobs) == 4 and all(len(t) == 5 for t in out.top_logprobs)
    model, cfg = llm.engine.runner.model, llm.engine.runner.model.config
    seq = p + out.token_ids
    kv = (torch.zeros(cfg.num_layers, 128, cfg.num_kv_heads, cfg.head_dim), torch.zeros(cfg.num_layers, 128, cfg.num_kv_heads, cfg.head_dim))
    with torch.no_grad():
        h = model(torch.tensor(seq), torch.arange(len(seq)), build_metadata([len(seq)], [0], [list(range(8))], 16, "cpu"), kv)
        logprobs = torch.log_softmax(model.logits(h[len(p) - 1:len(seq) - 1]) / 0.7, -1)
    for i, top in enumerate(out.top_logprobs):
        values, ids = logprobs[i].topk(5)
        assert list(top) == ids.tolist()  # best first
        assert list(top.values()) == pytest.approx(values.tolist(), abs=1e-4)
        assert out.logprobs[i] <= max(top.values()) + 1e-6
    greedy = llm.generate([p], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1))[0]
    assert [next(iter(t)) for t in greedy.top_logprobs] == greedy.token_ids
    assert [next(iter(t.values())) for t in greedy.top_logprobs] == pytest.approx(greedy.logprobs, abs=1e-6)
    assert llm.generate([p], SamplingParams(max_tokens=2))[0].top_logprobs == []  # none asked, none kept
    for bad in (-1, 21, 2.0):
        with pytest.raises(ValueError, match="logprobs"):
            SamplingParams(logprobs=bad)


def _penalized(logits, prompt: list[int], output: list[int], p: SamplingParams):
    """vLLM's penalties, written out token by token (the reference for the engine's tensor code)."""
    from collections import Counter
    out = logits.clone()
    for t in set(prompt) | set(output):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t, c in Counter(output).items():
        out[t] -= p.frequency_penalty * c + p.presence_penalty
    return out


@pytest.mark.parametrize("pen", [dict(repetition_penalty=1.3), dict(frequency_penalty=0.7, presence_penalty=0.5),
                                 dict(repetition_penalty=0.8, frequency_penalty=-0.4, presence_penalty=1.5)])
def test_penalties_act_on_the_logits_as_vllm_defines_them(llm, pen):
    """Greedy tokens are the argmax of the penalized logits, and the logprobs (sampled and top) are
    taken under them at the request's temperature: checked against a direct forward of the model."""
    import torch
    from rollwise.engine.attention import build_metadata
    p = _prompts(1, seed=9)[0]
    for temp in (0.0, 0.7):
        params = SamplingParams(temperature=temp, seed=4, max_tokens=24, ignore_eos=True, logprobs=3, **pen)
        out = llm.generate([p], params)[0]
        model, cfg = llm.engine.runner.model, llm.engine.runner.model.config
        seq = p + out.token_ids
        kv = tuple(torch.zeros(cfg.num_layers, 128, cfg.num_kv_heads, cfg.head_dim) for _ in range(2))
        with torch.no_grad():
            h = model(torch.tensor(seq), torch.arange(len(seq)), build_metadata([len(seq)], [0], [list(range(8))], 16, "cpu"), kv)
            logits = model.logits(h[len(p) - 1:len(seq) - 1])
        for i, tok in enumerate(out.token_ids):
            row = _penalized(logits[i], p, out.token_ids[:i], params)
            lp = torch.log_softmax(row / (temp or 1.0), -1)
            if temp == 0:
                assert tok == int(row.argmax())
            assert out.logprobs[i] == pytest.approx(float(lp[tok]), abs=1e-4)
            assert list(out.top_logprobs[i]) == lp.topk(3).indices.tolist()
    # the penalties change what is generated
    plain = llm.generate([p], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].token_ids
    greedy = llm.generate([p], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **pen))[0].token_ids
    assert greedy != plain


def test_prompt_logprobs_equal_a_direct_forward_and_bypass_the_prefix_cache(model_dir):
    """`prompt_logprobs=k`: each prompt token's logprob and the k most likely at its position, over a
    chunked prefill; such a request computes its prompt (cached blocks have no logits), others
    still hit the cache; speculation does not change them."""
    import torch
    from rollwise.engine.attention import build_metadata
    llm = LLM(model_dir, max_num_batched_tokens=64)
    p = [t for q in _prompts(4, seed=10) for t in q]
    assert len(p) > 64  # several prefill chunks
    params = SamplingParams(temperature=0.7, seed=1, max_tokens=3, prompt_logprobs=2)
    out = llm.generate([p], params)[0]
    model, cfg = llm.engine.runner.model, llm.engine.runner.model.config
    kv = tuple(torch.zeros(cfg.num_layers, 16 * 32, cfg.num_kv_heads, cfg.head_dim) for _ in range(2))
    with torch.no_grad():
        h = model(torch.tensor(p), torch.arange(len(p)), build_metadata([len(p)], [0], [list(range(32))], 16, "cpu"), kv)
        lp = torch.log_softmax(model.logits(h[:-1]) / 0.7, -1)
    lps = out.prompt_token_logprobs
    assert len(lps) == len(p) and lps[0] is None and out.prompt_top_logprobs[0] is None
    want = lp.gather(1, torch.tensor(p[1:])[:, None]).squeeze(1).tolist()
    assert out.prompt_token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    assert [list(t) for t in out.prompt_top_logprobs[1:]] == lp.topk(2).indices.tolist()
    order = lp.argsort(-1, descending=True)  # each prompt token's place in the vocabulary, from 1
    assert out.prompt_logprob_ranks[0] is None
    assert out.prompt_logprob_ranks[1:] == [int((order[i] == t).nonzero()) + 1 for i, t in enumerate(p[1:])]
    assert max(out.prompt_logprob_ranks[1:]) > 2  # (some below the top 2)
    view = out.prompt_logprobs  # vLLM's: {token id: Logprob}, the prompt token first, then the top 2
    assert view[0] is None and len(view) == len(p)
    for i, (t, pos) in enumerate(zip(p[1:], view[1:]), 1):
        top = list(out.prompt_top_logprobs[i])
        assert list(pos)[0] == t and set(pos) == {t, *top}
        assert pos[t].logprob == lps[i] and pos[t].rank == out.prompt_logprob_ranks[i]
        assert [pos[k].rank for k in top] == [1, 2]
        assert [pos[k].logprob for k in top] == list(out.prompt_top_logprobs[i].values())
        spelled = {k: llm.tokenizer.decode([k], skip_special_tokens=False) for k in pos}  # (characters' pieces:
        # test_vllm_params)
        assert all(x.decoded_token == spelled[k] for k, x in pos.items() if not spelled[k].endswith("\ufffd"))
    # lm-eval's loglikelihood over vLLM: the continuation's logprob, and whether greedy would write it
    ctx = len(p) - 5
    dicts = [{k: x.logprob for k, x in pos.items()} for pos in view[ctx:]]
    assert sum(d[t] for d, t in zip(dicts, p[ctx:])) == pytest.approx(sum(lps[ctx:]))
    assert all(max(d, key=d.get) == t for d, t in zip(dicts, p[ctx:])) == all(
        out.prompt_logprob_ranks[i] == 1 for i in range(ctx, len(p)))
    again = llm.generate([p], dataclasses.replace(params, prompt_logprobs=0))[0]
    assert again.num_cached_tokens == 0
    assert again.prompt_token_logprobs == pytest.approx(out.prompt_token_logprobs, abs=1e-5)
    assert again.prompt_top_logprobs[1:] == [{}] * (len(p) - 1)
    plain = llm.generate([p], SamplingParams(max_tokens=2))[0]
    assert plain.num_cached_tokens > 0 and plain.prompt_token_logprobs is None
    spec = LLM(model_dir, max_num_batched_tokens=64, speculative="suffix", spec_controller="always")
    assert spec.generate([p], params)[0].prompt_token_logprobs == pytest.approx(out.prompt_token_logprobs, abs=1e-4)
    for bad in (-1, 21, 1.5):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


def test_bad_words_are_never_written(model_dir, llm):
    """vLLM's bad_words: the token that would complete a word (as written, or after a space) is
    banned once the output ends with the word's other tokens; until then the output is the same."""
    tok, p = llm.engine.tokenizer, _prompts(1, seed=3)[0]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    out = llm.generate([p], params)[0].token_ids
    i = next(i for i in range(len(out) - 1)  # a word it writes, whose text tokenizes back to its ids
             if tok.encode(tok.decode(out[i:i + 2]), add_special_tokens=False) == out[i:i + 2])
    word = tok.decode(out[i:i + 2])
    spellings = llm.engine.tokenizer.bad_word_ids([word])
    assert out[i:i + 2] in spellings

    def completes(seq: list[int]) -> list[int]:  # where a spelling of the word ends in seq
        return [j + len(w) - 1 for w in spellings for j in range(len(seq) - len(w) + 1) if seq[j:j + len(w)] == w]
    got = llm.generate([p], dataclasses.replace(params, bad_words=[word]))[0].token_ids
    first = min(completes(out))
    assert not completes(got) and got[:first] == out[:first] and got[first] != out[first]
    spec = LLM(model_dir, speculative="suffix", spec_controller="always")  # (such a request is not drafted for)
    assert spec.generate([p], dataclasses.replace(params, bad_words=[word]))[0].token_ids == got
    for bad in ([""], ["  "], "word", [3]):
        with pytest.raises(ValueError, match="bad_words must be a list of non-empty strings"):
            llm.generate([p], dataclasses.replace(params, bad_words=bad))


def test_logit_bias_and_allowed_token_ids(model_dir, llm):
    """logit_bias shifts the logits it names (the logprobs are taken after it), allowed_token_ids
    masks the rest; both are the same at every position, so speculation gives the same tokens."""
    p = _prompts(4, seed=13)
    greedy = llm.generate(p, GREEDY)
    forced = llm.generate(p, dataclasses.replace(GREEDY, logit_bias={7: 100.0}))
    assert all(o.token_ids == [7] * 12 for o in forced) and all(lp > -1e-3 for o in forced for lp in o.logprobs)
    allowed = [3, 40, 41, 900]
    for params in (dataclasses.replace(GREEDY, allowed_token_ids=allowed, logprobs=2),
                   SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, allowed_token_ids=allowed)):
        outs = llm.generate(p, params)
        assert all(t in allowed for o in outs for t in o.token_ids)
        assert all(set(top) <= set(allowed) for o in outs for top in o.top_logprobs)
    mild = dataclasses.replace(GREEDY, max_tokens=30, logit_bias={t: 1.5 for t in range(20, 400, 7)})
    ref = llm.generate(p, mild)
    assert [o.token_ids for o in ref] != [o.token_ids for o in greedy]
    spec = LLM(model_dir, speculative="suffix", spec_controller="always", spec_tree=True)
    for _ in range(2):
        assert [o.token_ids for o in spec.generate(p, mild)] == [o.token_ids for o in ref]
    assert spec.metrics()["spec_accepted_tokens"] > 0
    for bad in ({"logit_bias": {1: 101.0}}, {"logit_bias": {-1: 1.0}}, {"logit_bias": [1]},
                {"allowed_token_ids": []}, {"allowed_token_ids": ["x"]}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    assert SamplingParams(logit_bias={"5": 2}).logit_bias == {5: 2}  # OpenAI's JSON keys are strings
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate(p[:1], SamplingParams(allowed_token_ids=[10**6]))


def test_min_p_keeps_tokens_near_the_most_likely(llm):
    """min_p = m: every sampled token has at least m times the most likely token's probability
    (hot sampling without it breaks that)."""
    import math
    p = _prompts(8, seed=14)
    for m, holds in ((0.3, True), (0.0, False)):
        outs = llm.generate(p, [SamplingParams(temperature=1.5, min_p=m, seed=i, max_tokens=16, ignore_eos=True,
                                               logprobs=1) for i in range(8)])
        ok = all(lp >= max(top.values()) + math.log(0.3) - 1e-5 for o in outs
                 for lp, top in zip(o.logprobs, o.top_logprobs))
        assert ok == holds, m
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.5)


def test_bad_penalties_are_rejected():
    for field, bad in (("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0),
                       ("repetition_penalty", -1.0), ("presence_penalty", "1")):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: bad})
    assert not SamplingParams().has_penalties and SamplingParams(repetition_penalty=1.1).has_penalties


def test_top_k_one_is_greedy(llm):
    prompts = _prompts(4, seed=6)
    g = llm.generate(prompts, GREEDY)
    k1 = llm.generate(prompts, SamplingParams(temperature=1.3, top_k=1, max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in g] == [o.token_ids for o in k1]


def test_stop_token_ids_strings_min_tokens(llm):
    p = _prompts(1, seed=7)[0]
    free = llm.generate([p], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    stop_tok = free.token_ids[3]
    first = free.token_ids.index(stop_tok)
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_tok], ignore_eos=True))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok and out.token_ids == free.token_ids[:first + 1]
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_tok],
                                           min_tokens=first + 1, ignore_eos=True))[0]
    assert len(out.token_ids) > first + 1 and stop_tok not in out.token_ids[:first + 1]
    text = llm.tokenizer.decode(free.token_ids)
    needle = text[len(text) // 2: len(text) // 2 + 2]
    if needle.strip():
        out = llm.generate([p], SamplingParams(temperature=0, max_tokens=12, stop=[needle], ignore_eos=True))[0]
        assert out.finish_reason == "stop" and out.stop_reason == needle
        assert needle not in out.text and text.startswith(out.text)
    assert free.finish_reason == "length" and len(free.token_ids) == 12


def test_stop_strings_cost_a_few_tokens_decoding_per_step(llm):
    """The check for stop strings decodes a window of the last tokens, not the whole output each step
    (quadratic in a long reasoning turn), and stops where the whole output's text says."""
    p = _prompts(1, seed=9)[0]
    decode, decoded = llm.engine.tokenizer.decode, []

    def counting(ids, *a, **kw):
        decoded.append(len(ids))
        return decode(ids, *a, **kw)
    llm.engine.tokenizer.decode = counting
    try:
        free = llm.generate([p], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True, stop=["\x00never"]))[0]
    finally:
        llm.engine.tokenizer.decode = decode
    assert len(free.token_ids) == 400 and free.finish_reason == "length"
    assert sum(decoded) < 400 * 80  # the whole output each step: 80,000 tokens and more
    text = decode(free.token_ids)
    needle = text[300:304]
    if needle.strip():  # a stop string late in the output: the same stop as a check of the whole text
        first = text.find(needle)
        out = llm.generate([p], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True, stop=[needle],
                                               include_stop_str_in_output=True))[0]
        assert out.finish_reason == "stop" and out.text == text[:first + len(needle)]
        assert decode(out.token_ids[:-1]).find(needle) < 0 <= decode(out.token_ids).find(needle)


def test_eos_stops_unless_ignored(model_dir):
    llm = LLM(model_dir)
    p = _prompts(1, seed=8)[0]
    free = llm.generate([p], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    llm.engine.eos_token_ids = {free.token_ids[2]}  # pretend the third token is EOS
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=6))[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[:free.token_ids.index(free.token_ids[2]) + 1]


def test_bad_requests_raise_value_error(llm):
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="unknown sampling fields"):
        SamplingParams.from_dict({"temprature": 1.0})
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 1024\)"):
        llm.generate([[1, 2, 5000]], GREEDY)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[1] * 5000], GREEDY)
    with pytest.raises(ValueError, match="non-empty"):
        llm.generate([[]], GREEDY)
    assert llm.generate([[1, 2, 3]], GREEDY)[0].finish_reason == "length"  # still serving


def test_reset_prefix_cache_forgets_cached_prefixes(model_dir):
    """vLLM's LLM.reset_prefix_cache: a prompt cached by the last request is computed again after it."""
    llm = LLM(model_dir)
    prompt = list(range(100, 150))
    llm.generate([prompt], GREEDY)
    assert llm.generate([prompt], GREEDY)[0].num_cached_tokens == 48
    assert llm.reset_prefix_cache() is True and llm.get_tokenizer() is llm.tokenizer
    assert llm.generate([prompt], GREEDY)[0].num_cached_tokens == 0


def test_abort_frees_blocks(model_dir):
    llm = LLM(model_dir)
    eng = llm.engine
    rid = eng.add_request(list(range(1, 40)), SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    out = eng.abort(rid)
    assert out.finish_reason == "abort" and out.finished
    eng.scheduler.check_integrity()
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks and not eng.has_unfinished


def test_update_weights_bumps_version_and_invalidates_prefixes(model_dir):
    llm = LLM(model_dir)
    p = _prompts(1, seed=9, shared=48)[0]
    before = llm.generate([p], GREEDY)[0]
    state = {k: v.clone() for k, v in llm.engine.runner.model.hf_tensors().items()}
    state["model.norm.weight"] = state["model.norm.weight"] * -1.0
    assert llm.update_weights(state) == 1
    assert not llm.engine.blocks.cached  # KV of the old weights: forgotten, its blocks free to reuse first
    used = llm.engine.blocks._fresh  # (blocks ever used: the pool holds memory for these alone)
    after = llm.generate([p], GREEDY)[0]
    assert after.num_cached_tokens == 0 and after.policy_version == 1
    assert after.token_ids != before.token_ids and llm.engine.blocks._fresh == used
    fresh = LLM(model_dir)
    fresh.update_weights(state)
    assert fresh.generate([p], GREEDY)[0].token_ids == after.token_ids
    with pytest.raises(ValueError, match="shape"):
        llm.update_weights({"model.norm.weight": state["model.norm.weight"][:3]})


def _flipped(llm) -> dict:
    state = {k: v.clone() for k, v in llm.engine.runner.model.hf_tensors().items()}
    state["model.norm.weight"] = state["model.norm.weight"] * -1.0
    return state


def _run(eng, rids: set[str]) -> dict:
    done = {}
    while rids - set(done):
        done.update({o.request_id: o for o in eng.step() if o.finished})
    return done


@pytest.mark.parametrize("spec", [None, "suffix"])  # drafts verified in steps that mix two weight versions
def test_requests_in_flight_finish_under_the_weights_they_started_with(model_dir, spec):
    """Default weight update: requests in flight finish under their weights while new ones run
    under the new weights in the same steps; the old weights go when their last request ends.
    A request may pin a held version."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    p = _prompts(1, seed=5)[0]
    llm = LLM(model_dir, keep_weight_versions=1, speculative=spec)
    old = LLM(model_dir).generate([p], params)[0]
    state = _flipped(llm)
    fresh = LLM(model_dir)
    fresh.update_weights(state)
    new = fresh.generate([p], params)[0]
    assert new.token_ids != old.token_ids
    eng = llm.engine
    a = eng.add_request(p, params)
    for _ in range(5):
        eng.step()
    assert eng.update_weights(state, 3) == 3 and eng.policy_version == 3
    b = eng.add_request(p, params)  # the newest weights
    c = eng.add_request(p, params, policy_version=0)  # pinned: version 0 is held while `a` runs on it
    d = eng.add_request(p, params)
    assert eng.abort(d).finish_reason == "abort"
    eng.step()
    assert eng.metrics()["weight_versions"] == 2 and eng.metrics()["num_running"] == 3  # both at once
    out = _run(eng, {a, b, c})
    for r in (a, c):
        assert out[r].token_ids == old.token_ids and out[r].policy_version == 0 and out[r].version_segments == []
        assert out[r].logprobs == pytest.approx(old.logprobs, abs=1e-4)
    assert out[b].token_ids == new.token_ids and out[b].policy_version == 3 and out[b].version_segments == []
    assert eng.metrics()["weight_versions"] == 1 and eng.metrics()["num_interrupted"] == 0  # version 0 dropped
    assert spec is None or eng.metrics()["spec_drafted_tokens"] > 0
    model = eng.runner.model
    eng.update_weights(state, 4)  # nothing in flight: loaded in place, no second copy of the model
    assert eng.runner.model is model and list(eng.runner.versions) == [4]
    with pytest.raises(ValueError, match="not held"):
        eng.add_request(p, params, policy_version=0)
    eng.scheduler.check_integrity()
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    with pytest.raises(ValueError, match="shape"):  # checked first: nothing changes
        eng.update_weights({"model.norm.weight": state["model.norm.weight"][:3]})
    assert eng.policy_version == 4 and eng.metrics()["weight_versions"] == 1


def test_kept_weight_versions_serve_pinned_requests(model_dir):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    p = _prompts(1, seed=7)[0]
    llm = LLM(model_dir, keep_weight_versions=2)
    eng = llm.engine
    cached = lambda: sorted(eng.blocks.block_tag[b] for b in eng.blocks.cached.values())  # noqa: E731
    old = llm.generate([p], params)[0]
    state = _flipped(llm)
    llm.update_weights(state)
    assert eng.metrics()["weight_versions"] == 2  # version 0 kept though nothing runs on it
    assert set(cached()) == {0}  # and what it cached: a request pinned to it may come
    r = eng.add_request(p, params, policy_version=0)
    pinned = _run(eng, {r})[r]
    assert pinned.token_ids == old.token_ids and pinned.num_cached_tokens > 0
    llm.generate([p], params)
    assert set(cached()) == {0, 1} and cached().count(1) == cached().count(0)
    llm.update_weights(state)  # version 2: version 0 goes, 1 and 2 stay
    with pytest.raises(ValueError, match=r"held: \[1, 2\]"):
        eng.add_request(p, params, policy_version=0)
    assert set(cached()) == {1}  # version 0's cached blocks forgotten with it (reused first)
    eng.update_weights(state, 1)  # a version already held is overwritten in place, the others kept
    assert eng.metrics()["weight_versions"] == 2 and sorted(eng.runner.versions) == [1, 2] == sorted(eng._roots)
    assert cached() == []  # what version 1 cached was of its former weights


@pytest.mark.parametrize("spec", [None, "suffix"])
def test_partial_rollout_continues_under_the_new_weights_from_the_tokens_so_far(model_dir, spec):
    """partial_rollout=True: a running request is interrupted, its KV recomputed under the new
    weights, and it continues from its tokens (kept with their logprobs); each token's version is recorded."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    p = _prompts(1, seed=6)[0]
    llm = LLM(model_dir, speculative=spec)
    old = LLM(model_dir).generate([p], params)[0]
    state = _flipped(llm)
    eng = llm.engine
    a = eng.add_request(p, params)
    for _ in range(6):
        eng.step()
    n = len(eng.seqs[a].output_token_ids)
    assert 0 < n < 16
    prefill = eng.stats["prefill_tokens"]
    eng.update_weights(state, 1, partial_rollout=True)
    assert eng.metrics()["weight_versions"] == 1 and eng.metrics()["num_interrupted"] == 1
    out = _run(eng, {a})[a]
    assert out.policy_version == 0 and out.version_segments == [(0, 0), (n, 1)]
    assert out.token_ids[:n] == old.token_ids[:n] and out.logprobs[:n] == old.logprobs[:n]
    assert eng.stats["prefill_tokens"] - prefill >= len(p) + n - 1  # recomputed, not old KV reused
    fresh = LLM(model_dir)
    fresh.update_weights(state)
    cont = fresh.generate([p + old.token_ids[:n]], dataclasses.replace(params, max_tokens=16 - n))[0]
    assert out.token_ids[n:] == cont.token_ids
    assert out.logprobs[n:] == pytest.approx(cont.logprobs, abs=1e-4)


def test_async_engine_leaves_the_callers_thread_count(model_dir):
    """The engine's threads are its own thread's business: building one must not change the caller's."""
    import torch

    from rollwise import AsyncEngine
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    eng = AsyncEngine(model_dir, num_threads=1)
    try:
        assert torch.get_num_threads() == 3
    finally:
        eng.shutdown()
        torch.set_num_threads(before)


def test_async_engine_takes_n_as_vllm_does(model_dir, llm):
    """AsyncEngine.generate with SamplingParams.n: the n samples, each what LLM.generate gives for its
    seed, in one output's .samples and .outputs; with a session it is a ValueError, and nothing runs on."""
    import asyncio

    from rollwise import AsyncEngine
    ps = _prompts(1, seed=8, shared=0)
    sp = dataclasses.replace(GREEDY, temperature=1.0, seed=3, n=3)
    want = llm.generate(ps, sp)[0]
    eng = AsyncEngine(model_dir)
    try:
        got = asyncio.run(eng.generate(ps[0], sp, "g"))
        assert [o.token_ids for o in got.samples] == [o.token_ids for o in want.samples]
        assert [o.request_id for o in got.samples] == ["g-0", "g-1", "g-2"]
        assert [c.index for c in got.outputs] == [0, 1, 2]
        with pytest.raises(ValueError, match="no session"):
            asyncio.run(eng.generate(ps[0], sp, session="t"))
        assert not eng.engine.has_unfinished
    finally:
        eng.shutdown()


def test_async_engine_survives_a_cancelled_call(model_dir):
    """A caller that gives up on call() (e.g. a router shutting down) must not kill the engine thread."""
    import asyncio
    import contextlib
    import threading

    from rollwise import AsyncEngine
    eng = AsyncEngine(model_dir)
    ran = []

    async def go():
        gate = threading.Event()
        first = asyncio.ensure_future(eng.call(lambda: gate.wait(5)))  # holds the engine thread
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(eng.call(lambda: ran.append(1)))
        await asyncio.sleep(0.05)
        second.cancel()  # cancelled while queued
        # the cancel reaches the engine's queue through the event loop's callbacks: wait until it has
        # (else a freed engine thread may take the command first, a benign race the test must not run)
        with contextlib.suppress(asyncio.CancelledError):
            await second
        gate.set()
        await first
        # a dead engine thread would never answer: fail instead of hanging
        return await asyncio.wait_for(eng.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=4,
                                                                             ignore_eos=True)), 30)
    try:
        out = asyncio.run(go())
        assert len(out.token_ids) == 4 and eng.is_running and ran == []
    finally:
        eng.shutdown()


def test_a_draining_pause_holds_back_requests_that_arrive_during_it(model_dir):
    """pause(wait=True) (vLLM's /pause?mode=wait, before a weight update): the requests in flight finish
    under the weights they began with; one that arrives during the drain is held back (no KV, no token)
    until resume, then runs whole under the weights loaded in between; one held and aborted just ends;
    a second drain at once waits for the same requests."""
    import asyncio

    from rollwise import AsyncEngine
    eng = AsyncEngine(model_dir)
    sch = eng.engine.scheduler
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)

    async def go():
        first = asyncio.ensure_future(eng.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=300,
                                                                             ignore_eos=True)))
        while not await eng.call(lambda: len(sch.running)):
            await asyncio.sleep(0.002)
        drain = asyncio.ensure_future(eng.pause(wait=True))
        while not await eng.call(lambda: sch.holding):
            await asyncio.sleep(0.002)
        late = asyncio.ensure_future(eng.generate([8, 9, 10], sp, request_id="late"))
        gone = asyncio.ensure_future(eng.generate([11, 12], sp, request_id="gone"))
        while await eng.call(lambda: len(sch.held)) < 2:
            await asyncio.sleep(0.002)
        assert await eng.abort("gone") and (await gone).finish_reason == "abort"
        again = asyncio.ensure_future(eng.pause(wait=True))  # a second drain waits for the same ones, not the held
        seen = []
        while not drain.done():  # the late one waits the drain out without a computed token or a block
            seen.append(await eng.call(lambda: [(s.num_computed_tokens, len(s.block_table)) for s in sch.held]))
            await asyncio.sleep(0.002)
        await drain
        await asyncio.wait_for(again, 5)
        done = first.done() and await first
        version = await eng.update_weights(model_dir)  # (the same weights, from the directory)
        await asyncio.sleep(0.05)
        assert not late.done()  # paused: still held
        await eng.resume()
        return done, version, await late, seen
    try:
        first, version, late, seen = asyncio.run(asyncio.wait_for(go(), 60))
    finally:
        eng.shutdown()
    assert first and len(first.token_ids) == 300 and first.policy_version == 0
    assert len(seen) > 3 and all(s == [(0, 0)] for s in seen)
    assert len(late.token_ids) == 60 and late.policy_version == version == 1 and not late.version_segments


def test_a_retracting_pause_drops_the_kv_and_an_update_moves_the_requests_onto_the_new_weights(model_dir):
    """pause(retract=True) (SGLang's pause_generation mode "retract"): the requests in flight wait with
    their KV given back; a weight update before resume moves them onto the new weights from their
    tokens so far (a version segment at the retract), as a partial rollout does. A plain pause keeps
    its request's KV, and the request finishes under the weights it began with."""
    import asyncio

    from rollwise import AsyncEngine
    eng = AsyncEngine(model_dir)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    async def paused_at(rid: str, **how):
        task = asyncio.ensure_future(eng.generate([5, 6, 7, 8 if rid == "kept" else 9], sp, request_id=rid))
        while not task.done() and not await eng.call(
                lambda: rid in eng.engine.seqs and eng.engine.seqs[rid].num_output_tokens >= 5):
            await asyncio.sleep(0.002)
        assert not task.done(), task.result()
        await eng.pause(**how)
        seq = eng.engine.seqs[rid]
        state = await eng.call(lambda: (seq.num_output_tokens, len(seq.block_table), seq.status.name))
        version = await eng.update_weights(model_dir)
        await eng.resume()
        return state, version, await task
    try:
        retracted = asyncio.run(asyncio.wait_for(paused_at("retracted", retract=True), 60))
        kept = asyncio.run(asyncio.wait_for(paused_at("kept"), 60))
    finally:
        eng.shutdown()
    (n, blocks, status), version, out = retracted
    assert blocks == 0 and status == "WAITING" and version == 1 and not eng.retracted
    assert len(out.token_ids) == 40 and out.policy_version == 0 and out.version_segments == [(0, 0), (n, 1)]
    (n, blocks, status), version, out = kept
    assert blocks > 0 and status == "RUNNING" and version == 2
    assert len(out.token_ids) == 40 and out.policy_version == 1 and not out.version_segments


def test_async_engine_runs_the_model_with_its_own_thread_count(model_dir):
    """torch's intra-op thread count is per thread: the engine sets num_threads on the thread that
    runs the model, and leaves the caller's as it was."""
    import asyncio

    import torch

    from rollwise import AsyncEngine
    before = torch.get_num_threads()
    eng = AsyncEngine(model_dir, num_threads=1)
    try:
        torch.set_num_threads(before)  # (the runner's constructor set the caller's; a caller may set it back)
        assert asyncio.run(eng.call(torch.get_num_threads)) == 1
        assert torch.get_num_threads() == before
    finally:
        eng.shutdown()


def test_a_stream_sends_each_steps_new_tokens_and_adds_them_up(model_dir):
    """The engine's output for a streaming request holds only the tokens since its last (no copy of
    the whole output each step); AsyncEngine.stream adds them up: cumulative outputs, ids and
    logprobs aligned, whose last equals the request generated without streaming, speculation too."""
    import asyncio

    from rollwise import AsyncEngine
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True, logprobs=2)
    llm = LLM(model_dir, max_num_seqs=4)
    rid = llm.engine.add_request([5, 6, 7, 8], params, stream=True)
    pieces = [o for _ in range(40) if llm.engine.has_unfinished for o in llm.engine.step() if o.request_id == rid]
    assert all(len(p.token_ids) == len(p.logprobs) == len(p.top_logprobs) >= 1 for p in pieces[:-1])
    final, ids = pieces[-1], [t for p in pieces[:-1] for t in p.token_ids]
    assert final.finished and len(pieces) > 2 and ids == final.token_ids[:len(ids)]
    assert [x for p in pieces[:-1] for x in p.logprobs] == final.logprobs[:len(ids)]
    for spec in (None, "suffix"):
        eng = AsyncEngine(model_dir, **({} if spec is None else {"speculative": spec}))

        async def go():
            seen = []
            async for out in eng.stream([5, 6, 7, 8], params):
                assert len(out.token_ids) == len(out.logprobs) == len(out.top_logprobs)
                seen.append((list(out.token_ids), list(out.logprobs), out.finished))
            return seen, await eng.generate([5, 6, 7, 8], params)
        try:
            seen, whole = asyncio.run(go())
        finally:
            eng.shutdown()
        assert seen[-1][2] and seen[-1][0] == whole.token_ids and len(seen) > 1
        assert all(seen[i][0] == seen[-1][0][:len(seen[i][0])] and seen[i][1] == seen[-1][1][:len(seen[i][1])]
                   for i in range(len(seen))), spec


def test_priority_scheduling_serves_lower_priorities_first_with_the_same_tokens(model_dir, llm):
    """vLLM's scheduling_policy="priority": with one slot, requests run in (priority, arrival)
    order; each gets the tokens it gets alone. An FCFS engine refuses a priority but 0."""
    from rollwise.engine.llm_engine import LLMEngine
    from rollwise.config import EngineConfig
    prompts, prios = _prompts(5, seed=3), [3, 0, 3, -1, 0]
    eng = LLMEngine(EngineConfig(model=model_dir, max_num_seqs=1, scheduling_policy="priority"))
    rids = [eng.add_request(p, GREEDY, priority=q) for p, q in zip(prompts, prios)]
    done = []
    while eng.has_unfinished:
        done += [o for o in eng.step() if o.finished]
    assert [o.request_id for o in done] == [rids[i] for i in (3, 1, 4, 0, 2)]
    alone = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in sorted(done, key=lambda o: rids.index(o.request_id))] == [a.token_ids for a in alone]
    outs = LLM(model_dir, scheduling_policy="priority").generate(prompts, GREEDY, priority=prios)
    assert [o.token_ids for o in outs] == [a.token_ids for a in alone]
    with pytest.raises(ValueError, match="scheduling_policy 'priority'"):
        llm.generate(prompts[:1], GREEDY, priority=[1])
    for bad in (True, 1.5, "1"):
        with pytest.raises(ValueError, match="priority"):
            eng.add_request(prompts[0], GREEDY, priority=bad)
    with pytest.raises(ValueError, match="'fcfs', 'priority'"):
        EngineConfig(model=model_dir, scheduling_policy="sjf")


def test_request_latency_histograms_count_every_request(model_dir):
    """vLLM's per-request histograms (request_stats.py): each ended request observed once, its
    prompt and generated tokens summed exactly, the phases consistent (queue + prefill = time to
    first token; prefill + decode = inference; queue + inference = end to end), an inter-token
    latency per step after the first token, cumulative buckets."""
    llm = LLM(model_dir, max_num_seqs=2)  # (a queue forms: 6 requests, 2 at a time)
    prompts = _prompts(6, seed=5)
    params = [dataclasses.replace(GREEDY, max_tokens=1 + 3 * i) for i in range(6)]
    outs = llm.generate(prompts, params)
    snap = llm.engine.request_stats.snapshot()
    count = lambda k: snap[k][3]  # noqa: E731
    total = lambda k: snap[k][2]  # noqa: E731
    assert all(count(k) == 6 for k in ("e2e_request_latency_seconds", "time_to_first_token_seconds",
                                         "request_queue_time_seconds", "request_decode_time_seconds"))
    assert count("request_time_per_output_token_seconds") == 5  # (the 1-token request has no second token)
    assert total("request_prompt_tokens") == sum(map(len, prompts))
    assert total("request_generation_tokens") == sum(len(o.token_ids) for o in outs) == sum(1 + 3 * i for i in range(6))
    assert total("request_queue_time_seconds") + total("request_prefill_time_seconds") == \
        pytest.approx(total("time_to_first_token_seconds"))
    assert total("request_prefill_time_seconds") + total("request_decode_time_seconds") == \
        pytest.approx(total("request_inference_time_seconds"))
    assert total("request_queue_time_seconds") + total("request_inference_time_seconds") == \
        pytest.approx(total("e2e_request_latency_seconds"))
    assert total("request_queue_time_seconds") > 0  # the last four waited for a slot
    # inter-token latency: one observation per step after the first token (one token a step here)
    assert count("inter_token_latency_seconds") == sum(3 * i for i in range(6))
    assert 0 < total("inter_token_latency_seconds") <= total("request_decode_time_seconds")
    for bounds, cumulative, _, n in snap.values():
        assert list(bounds) == sorted(bounds) and cumulative == sorted(cumulative) and cumulative[-1] <= n
    bounds, cumulative, _, _ = snap["request_generation_tokens"]
    assert bounds[:4] == (1, 2, 5, 10) and cumulative[0] == 1 and cumulative[bounds.index(10)] == 4  # 1, 4, 7, 10
    rid = llm.engine.add_request(prompts[0], GREEDY)
    llm.engine.abort(rid)  # an abort ends it too: observed, no first token
    snap = llm.engine.request_stats.snapshot()
    assert snap["e2e_request_latency_seconds"][3] == 7 and snap["time_to_first_token_seconds"][3] == 6
