"""vLLM 0.32's sampling options that an RL rollout or a scorer sets: repetition_detection (a looping
reply ends), thinking_token_budget, trace_decode_token_ids (trace replay), logprob_token_ids,
detokenize=False (token ids only), skip_reading_prefix_cache, extra_args; and the decoded tokens of
vLLM's Logprobs."""
from __future__ import annotations

import asyncio
import dataclasses
import random

import numpy as np
import pytest

from rollwise import LLM, RepetitionDetectionParams, RequestOutputKind, SamplingParams

LOOP = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir)


def _repeats(ids: list[int], r: RepetitionDetectionParams, start: int = 0) -> bool:
    """The definition, spelled differently: the output's last L x min_count tokens are its last L, min_count times."""
    out = ids[start:]
    return any(len(out) >= size * r.min_count and out[-size * r.min_count:] == out[-size:] * r.min_count
               for size in range(max(r.min_pattern_size, 1), r.max_pattern_size + 1))


def test_repetition_detection_finds_exactly_the_repeated_tails():
    rng = random.Random(0)
    rules = [RepetitionDetectionParams(max_pattern_size=m, min_pattern_size=lo, min_count=c)
             for m, lo, c in ((1, 0, 2), (4, 0, 3), (6, 3, 2), (8, 8, 2), (5, 2, 4))]
    for _ in range(3000):
        unit = [rng.randrange(3) for _ in range(rng.randint(1, 6))]
        ids = [rng.randrange(3) for _ in range(rng.randint(0, 12))] + unit * rng.randint(1, 4)
        ids += [rng.randrange(3) for _ in range(rng.randint(0, 1))]
        start = rng.randint(0, len(ids))
        for r in rules:
            assert r.found(ids, start) == _repeats(ids, r, start), (ids, start, r)
    assert not RepetitionDetectionParams().found([7] * 50)  # (off)
    for bad, why in (({"max_pattern_size": 2, "min_count": 1}, "min_count must be >= 2"),
                     ({"max_pattern_size": 2, "min_pattern_size": 3, "min_count": 2}, "min_pattern_size must be <="),
                     ({"max_pattern_size": -1}, "max_pattern_size must be >= 0"),
                     ({"max_pattern_size": 2.0, "min_count": 2}, "must be an integer")):
        with pytest.raises(ValueError, match=why):
            SamplingParams(repetition_detection=bad)
    with pytest.raises(ValueError, match="takes .*max_pattern_size"):
        SamplingParams(repetition_detection={"max_pattern": 4})
    with pytest.raises(ValueError, match="RepetitionDetectionParams or a dict"):
        SamplingParams(repetition_detection=[4, 0, 2])


def test_a_looping_reply_ends_where_the_pattern_first_repeats(llm, model_dir):
    """Greedy decoding of the tiny model loops; with repetition_detection the reply is the same
    tokens cut at the first one that completes min_count repeats (not before min_tokens), finish
    reason "repetition" as vLLM's; speculation (which accepts several tokens a step) cuts at the same
    token; a rule the reply never meets leaves it to max_tokens."""
    full = llm.generate(["hello world"], LOOP)[0].token_ids
    for rule, min_tokens in (({"max_pattern_size": 8, "min_count": 3}, 0),
                             ({"max_pattern_size": 8, "min_count": 3}, 40),
                             ({"max_pattern_size": 2, "min_pattern_size": 2, "min_count": 5}, 0)):
        r = RepetitionDetectionParams(**rule)
        cut = next(i for i in range(max(min_tokens, 1), len(full) + 1) if _repeats(full[:i], r))  # (it loops)
        params = dataclasses.replace(LOOP, repetition_detection=rule, min_tokens=min_tokens)
        out = llm.generate(["hello world"], params)[0]
        assert out.token_ids == full[:cut] and cut < len(full), rule
        assert (out.finish_reason, out.stop_reason) == ("repetition", "repetition_detected")
        assert out.text == llm.tokenizer.decode(full[:cut], skip_special_tokens=True)
    assert llm.generate(["hello world"], params)[0].outputs[0].finish_reason == "repetition"
    spec = LLM(model_dir, speculative="suffix", spec_controller="always")
    spec.generate(["hello world"], LOOP)  # (its trees now know the loop: it drafts it)
    params = dataclasses.replace(LOOP, repetition_detection={"max_pattern_size": 8, "min_count": 3})
    assert spec.generate(["hello world"], params)[0].token_ids == llm.generate(["hello world"], params)[0].token_ids
    assert spec.engine.metrics()["spec_accepted_tokens"] > 0
    never = llm.generate(["hello world"], dataclasses.replace(LOOP, repetition_detection={
        "max_pattern_size": 1, "min_count": 200}))[0]
    assert never.token_ids == full and never.finish_reason == "length"


def test_detokenize_false_gives_token_ids_only(llm):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with_text = llm.generate(["a b c"], params)[0]
    ids_only = llm.generate(["a b c"], dataclasses.replace(params, detokenize=False))[0]
    assert with_text.text and ids_only.text == "" and ids_only.token_ids == with_text.token_ids
    assert ids_only.outputs[0].text == "" and ids_only.outputs[0].token_ids == with_text.token_ids
    t = with_text.token_ids[0]  # vLLM decodes no logprob's token either then
    assert with_text.outputs[0].logprobs[0][t].decoded_token == llm.tokenizer.decode([t], skip_special_tokens=False)
    assert ids_only.outputs[0].logprobs[0][t].decoded_token is None

    async def streamed():
        from rollwise import AsyncLLM
        engine = AsyncLLM(llm.engine.config.model)
        try:
            sp = dataclasses.replace(params, detokenize=False, output_kind=RequestOutputKind.DELTA)
            return [(o.token_ids, o.text) async for o in engine.generate("a b c", sp, "r")]
        finally:
            engine.shutdown()
    pieces = asyncio.run(streamed())
    assert [t for ids, _ in pieces for t in ids] == with_text.token_ids and {s for _, s in pieces} == {""}
    with pytest.raises(ValueError, match="stop strings need detokenize=True"):
        SamplingParams(stop=["x"], detokenize=False)
    with pytest.raises(ValueError, match="detokenize must be true or false"):
        SamplingParams(detokenize="no")


def test_skip_reading_prefix_cache_computes_the_prompt_again(llm):
    """The same prompt again hits the prefix cache; with skip_reading_prefix_cache it is computed
    (the same greedy tokens); vLLM's default skips for prompt logprobs only."""
    prompt = list(range(10, 90))
    params = SamplingParams(temperature=0, max_tokens=4)
    first = llm.generate([prompt], params)[0]
    assert llm.generate([prompt], params)[0].num_cached_tokens > 0
    fresh = llm.generate([prompt], dataclasses.replace(params, skip_reading_prefix_cache=True))[0]
    assert fresh.num_cached_tokens == 0 and fresh.token_ids == first.token_ids
    assert llm.generate([prompt], params)[0].num_cached_tokens > 0  # (what it computed is cached for others)
    assert SamplingParams(prompt_logprobs=0).skip_reading_prefix_cache is True
    assert SamplingParams().skip_reading_prefix_cache is False
    with pytest.raises(ValueError, match="skip_reading_prefix_cache must be true or false"):
        SamplingParams(skip_reading_prefix_cache=1)
    assert SamplingParams(extra_args={"mine": 1}).extra_args == {"mine": 1}
    with pytest.raises(ValueError, match="extra_args must be a dict"):
        SamplingParams(extra_args=[1])


def test_decoded_tokens_spell_the_prompt_as_vllm_corrects_them(llm):
    """Logprob.decoded_token, vLLM 0.32's way: a byte-level piece that ends inside a multi-byte
    character is "" until the token that completes it, which carries the character; so the prompt
    tokens' decoded pieces add up to the prompt's text."""
    text = "x naïve 世界 🙂 ok, Ünïcödé — done"
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    assert any(llm.tokenizer.decode([t]).endswith("\ufffd") for t in ids)  # (the tokenizer splits characters)
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    pieces = [pos[t].decoded_token for t, pos in zip(ids[1:], out.prompt_logprobs[1:])]
    assert "".join(pieces) == llm.tokenizer.decode(ids[1:]) and "\ufffd" not in "".join(pieces)
    assert dataclasses.replace(out, tokenizer=None).prompt_logprobs[1][ids[1]].decoded_token is None


def test_thinking_budget_bookkeeping_opens_closes_and_forces():
    """Sequence.thought / forced_next on token lists: a block opened in the prompt counts the prompt's
    tokens after the start string; a block opened or closed in the output; the end string forced
    token by token once the block holds the budget, after which a new block may open."""
    from rollwise.engine.sequence import Sequence
    S, E = [1, 2], [3, 4]  # (multi-token strings, as on a tokenizer without special think tokens)

    def seq(prompt, budget):
        s = Sequence("r", prompt, SamplingParams(thinking_token_budget=budget))
        s.thought(S, E, prompt=True)
        return s

    def emit(s, toks):
        forced = []
        for t in toks:
            f = s.forced_next(E)
            forced.append(f)
            s.token_ids.append(t if f is None else f)
            s.thought(S, E)
        return forced

    s = seq([9, 1, 2, 7, 7], 3)  # opened in the prompt, 2 tokens in: 1 more, then 3 and 4 forced
    assert s.think_count == 2 and s.think_room() == 1
    assert emit(s, [8, 8, 8, 8, 8]) == [None, 3, 4, None, None] and s.token_ids[5:] == [8, 3, 4, 8, 8]
    assert s.think_count is None and s.think_room() == 3
    assert emit(s, [1, 2, 5, 3, 4, 6]) == [None] * 6 and s.think_count is None  # opened and closed in time
    s = seq([9, 1, 2, 3, 4], 0)  # closed in the prompt: nothing forced, even at budget 0
    assert s.think_count is None and emit(s, [1, 2, 5]) == [None, None, 3]  # a new block: at once
    assert seq([1, 2, 6, 6, 6], 2).forced_next(E) == 3  # over the budget in the prompt: forced at once
    none = Sequence("r", [1, 2], SamplingParams())
    none.thought(S, E, prompt=True)
    assert none.think_count is None and none.forced_next(E) is None and none.think_room() > 10**6
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None
    for bad in (-2, 1.5, "8"):
        with pytest.raises(ValueError, match="thinking_token_budget"):
            SamplingParams(thinking_token_budget=bad)


def test_a_thinking_budget_closes_the_block_with_the_end_string(llm, model_dir):
    """Greedy from a prompt that opens a think block: with thinking_token_budget B the output is the
    free output's first B - k tokens (k written in the prompt already), then the end string's tokens,
    then what the model writes after them (the same as from that prefix); no budget, a closed block
    or -1 change nothing; speculation gives the same tokens; an engine's own strings (vLLM's
    reasoning_config) are taken."""
    tok = llm.tokenizer
    start, end = (tok.encode(s, add_special_tokens=False) for s in ("<think>", "</think>"))
    prompt = tok.encode("question <think>", add_special_tokens=False) + tok.encode(" x y", add_special_tokens=False)
    inside = len(prompt) - len(start) - len(tok.encode("question ", add_special_tokens=False))
    free = llm.generate([prompt], LOOP)[0].token_ids
    budget = inside + 6
    params = dataclasses.replace(LOOP, max_tokens=40, thinking_token_budget=budget)
    out = llm.generate([prompt], params)[0]
    k = budget - inside
    assert out.token_ids[:k] == free[:k] and out.token_ids[k:k + len(end)] == end and end != free[k:k + len(end)]
    after = prompt + out.token_ids[:k + len(end)]
    rest = llm.generate([after], dataclasses.replace(LOOP, max_tokens=40 - k - len(end)))[0].token_ids
    assert out.token_ids[k + len(end):] == rest
    assert tok.decode(out.token_ids).count("</think>") == 1
    for same in (dataclasses.replace(LOOP, thinking_token_budget=-1), LOOP):
        assert llm.generate([prompt], same)[0].token_ids == free
    closed = prompt + end
    unbounded = dataclasses.replace(params, thinking_token_budget=None)
    assert llm.generate([closed], params)[0].token_ids == llm.generate([closed], unbounded)[0].token_ids
    spec = LLM(model_dir, speculative="suffix", spec_controller="always")
    spec.generate([prompt], dataclasses.replace(params, thinking_token_budget=None))  # (its trees learn the free run)
    assert spec.generate([prompt], params)[0].token_ids == out.token_ids
    own = LLM(model_dir, reasoning_config={"reasoning_parser": "qwen3", "reasoning_start_str": "question",
                                           "reasoning_end_str": "!!"})
    q, qa = (tok.encode(s, add_special_tokens=False) for s in ("question", "question a"))
    got = own.generate([qa], dataclasses.replace(params, thinking_token_budget=3))[0].token_ids
    bang, k = tok.encode("!!", add_special_tokens=False), 3 - (len(qa) - len(q))
    assert qa[:len(q)] == q and got[k:k + len(bang)] == bang
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        LLM(model_dir, reasoning_parser="nope")
    with pytest.raises(ValueError, match="reasoning_config takes"):
        LLM(model_dir, reasoning_config={"think": "<t>"})


def test_trace_decode_token_ids_replays_a_trace_with_the_models_logprobs(llm, model_dir):
    """vLLM's trace replay: the given tokens are the output (up to max_tokens), whatever is sampled, and
    their logprobs are the model's (those of the same tokens as a prompt); speculation keeps them."""
    prompt, trace = [5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46, 47]
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=6, trace_decode_token_ids=trace,
                            stop_token_ids=[42])  # (a stop token in the trace does not end it)
    out = llm.generate([prompt], params)[0]
    assert out.token_ids == trace[:6] and out.finish_reason == "length"
    scored = llm.generate([prompt + trace[:6]], SamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=0))[0]
    assert out.logprobs == pytest.approx(scored.prompt_token_logprobs[len(prompt):], abs=1e-4)
    spec = LLM(model_dir, speculative="suffix", spec_controller="always")
    spec.generate([prompt], dataclasses.replace(params, max_tokens=8))  # (its trees know the trace)
    assert spec.generate([prompt], params)[0].token_ids == trace[:6]
    assert llm.generate([prompt], dataclasses.replace(params, max_tokens=50))[0].token_ids == trace
    with pytest.raises(ValueError, match="trace_decode_token_ids must be a non-empty list"):
        SamplingParams(trace_decode_token_ids=[])
    with pytest.raises(ValueError, match="token ids must be non-negative"):
        SamplingParams(trace_decode_token_ids=[-1])
    with pytest.raises(ValueError, match="not both"):
        llm.engine.add_request(prompt, params, forced_output=[1])
    assert LLM(model_dir, enable_trace_replay=True).generate([prompt], params)[0].token_ids == trace[:6]


def test_logprob_token_ids_give_those_tokens_logprobs_at_every_position(llm, model_dir):
    """vLLM's logprob_token_ids: at each output position the logprobs of exactly those tokens, in their
    order (vLLM's Logprob ranks 1..n by that order), under the same distribution as the sampled
    token's (equal where the sampled token is one of them, and to the top-k's values where one is
    among the most likely); speculation gives the same."""
    free = llm.generate([[5, 6, 7, 8]], dataclasses.replace(LOOP, max_tokens=12, logprobs=20))[0]
    ids = list(dict.fromkeys(free.token_ids))[:3] + [1, 2]
    params = dataclasses.replace(LOOP, max_tokens=12, logprob_token_ids=ids)
    out = llm.generate([[5, 6, 7, 8]], params)[0]
    assert out.token_ids == free.token_ids and all(list(top) == ids for top in out.top_logprobs)
    for t, lp, top, top20 in zip(out.token_ids, out.logprobs, out.top_logprobs, free.top_logprobs):
        assert t not in top or top[t] == pytest.approx(lp, abs=1e-5)
        assert all(top[k] == pytest.approx(v, abs=1e-5) for k, v in top20.items() if k in top)
    assert sum(t in ids for t in out.token_ids) >= 3
    pos = out.outputs[0].logprobs[0]
    assert list(pos) == [out.token_ids[0], *[k for k in ids if k != out.token_ids[0]]]
    assert [pos[k].rank for k in ids] == [1, 2, 3, 4, 5]  # (as vLLM ranks them)
    spec = LLM(model_dir, speculative="suffix", spec_controller="always")
    spec.generate([[5, 6, 7, 8]], params)
    again = spec.generate([[5, 6, 7, 8]], params)[0]
    assert again.token_ids == out.token_ids and spec.engine.metrics()["spec_accepted_tokens"] > 0
    assert [list(t) for t in again.top_logprobs] == [ids] * 12
    assert [v for t in again.top_logprobs for v in t.values()] == pytest.approx(
        [v for t in out.top_logprobs for v in t.values()], abs=1e-4)
    assert SamplingParams(logprob_token_ids=[3, 4], logprobs=2).logprobs == 2
    for bad, why in (({"logprob_token_ids": []}, "1 to 128 token ids"),
                     ({"logprob_token_ids": [3, 4], "logprobs": 1}, "logprobs must be 0 or their number"),
                     ({"logprob_token_ids": [-3]}, "non-negative")):
        with pytest.raises(ValueError, match=why):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="logprob_token_ids take token ids"):
        llm.generate([[5, 6]], SamplingParams(logprob_token_ids=[10**6]))


def test_an_incomplete_last_character_is_held_back(llm):
    """A reply that ends inside a multi-byte character: its text stops before it (vLLM's detokenizer
    holds such a tail back and gives a one-token reply of one byte as ""); the streamed pieces add up
    to the same text."""
    full = llm.tokenizer.encode("ab 世界", add_special_tokens=False)
    pieces = [llm.tokenizer.decode([t]) for t in full]
    assert pieces[-1].endswith("\ufffd") and llm.tokenizer.decode(full).endswith("界")  # (a character in pieces)
    texts = []
    for n in range(1, len(full) + 1):
        params = SamplingParams(max_tokens=n, trace_decode_token_ids=full[:n])
        texts.append(llm.generate([[5, 6]], params)[0].text)
        assert "\ufffd" not in texts[-1] and llm.tokenizer.decode(full[:n]).startswith(texts[-1])
    assert texts[-1] == "ab 世界" and "ab 世" in texts and texts[2] == "ab "

    async def streamed():
        from rollwise import AsyncLLM
        engine = AsyncLLM(llm.engine.config.model)
        try:
            sp = SamplingParams(max_tokens=len(full) - 1, trace_decode_token_ids=full[:-1],
                                output_kind=RequestOutputKind.DELTA)
            return [o.text async for o in engine.generate([5, 6], sp, "r")]
        finally:
            engine.shutdown()
    assert "".join(asyncio.run(streamed())) == texts[-2] == "ab 世"


def test_prompt_logprob_token_ids_score_given_tokens_at_each_prompt_row(model_dir):
    """vLLM 0.32's teacher scoring: row i scores its ids as prompt token start + i + 1, the same
    logprobs as the prompt's own top logprobs there; -1 pads a row (-inf); a prompt computed in
    chunks (a small step budget) scores the same; a wrong row count or id is a ValueError."""
    llm = LLM(model_dir, max_num_batched_tokens=4)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]
    ref = LLM(model_dir).generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=5))[0]
    tops, own = ref.prompt_top_logprobs, ref.prompt_token_logprobs
    for start in (0, 3):
        rows = [list(tops[p + 1])[:3] + [prompt[p + 1]] for p in range(start, len(prompt) - 1)]
        rows[1] = rows[1][:1]  # a shorter row: padded with -1
        out = llm.generate([prompt], SamplingParams(max_tokens=2, prompt_logprob_token_ids=rows,
                                                    prompt_logprob_start=start or None))[0]
        got = out.prompt_token_id_logprobs
        assert got.shape == (len(prompt) - 1 - start, 4) and got.dtype == np.float32
        for i, p in enumerate(range(start, len(prompt) - 1)):
            ids = rows[i]
            want = [tops[p + 1][t] for t in ids[:3]] + ([own[p + 1]] if len(ids) == 4 else [])
            assert got[i, :len(want)] == pytest.approx(want, abs=1e-5)
            assert np.isneginf(got[i, len(want):]).all()
        assert out.prompt_token_logprobs is None  # (prompt_logprobs itself was not asked for)
    bad = dict(max_tokens=1, prompt_logprob_token_ids=[[1]] * 3)
    with pytest.raises(ValueError, match="has 3 rows, but the prompt has 10 scored rows"):
        llm.generate([prompt], SamplingParams(**bad))
    with pytest.raises(ValueError, match=r"token ids in \[0, 1024\)"):
        llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprob_token_ids=[[5000]] * 10))
    for kw, match in [({"prompt_logprob_token_ids": [[1, -2]]}, ">= 0"),
                      ({"prompt_logprob_token_ids": []}, "non-empty"),
                      ({"prompt_logprob_start": 2}, "needs prompt_logprob_token_ids"),
                      ({"prompt_logprob_token_ids": [[1] * 21]}, "at most 20")]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(**kw)


def test_flat_logprobs_read_as_the_lists_they_stand_for(llm):
    """vLLM's flat_logprobs: the vLLM views' logprobs (output and prompt) as FlatLogprobs, whose flat
    lists hold every entry and which read, by position and by slice, as the list of dicts does."""
    from rollwise.types import FlatLogprobs
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    prompt = [5, 6, 7, 8]
    plain = llm.generate([prompt], params)[0]
    flat = llm.generate([prompt], dataclasses.replace(params, flat_logprobs=True))[0]
    a, b = plain.outputs[0].logprobs, flat.outputs[0].logprobs
    assert isinstance(b, FlatLogprobs) and isinstance(a, list)
    assert list(b) == a and len(b) == 6 and b[2] == a[2] and list(b[1:4]) == a[1:4] and list(b[::-1]) == a[::-1]
    assert b.token_ids == [t for pos in a for t in pos] and b.logprobs == [p.logprob for pos in a for p in pos.values()]
    assert b.ranks == [p.rank for pos in a for p in pos.values()]
    pa, pb = plain.prompt_logprobs, flat.prompt_logprobs
    assert isinstance(pb, FlatLogprobs) and pb[0] == {} and pa[0] is None and list(pb)[1:] == pa[1:]
    with pytest.raises(ValueError, match="flat_logprobs must be true or false"):
        SamplingParams(flat_logprobs="yes")
