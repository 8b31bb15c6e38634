"""vLLM's async engine API (`AsyncLLM`): what a framework's vLLM rollout worker reads from it, against
what rollwise's own engine gives for the same requests."""
from __future__ import annotations

import asyncio

import pytest

from rollwise import LLM, AsyncEngineArgs, AsyncLLM, RequestOutputKind, SamplingParams, TokensPrompt

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
PROMPT = [5, 6, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model_dir, enforce_eager=True, enable_prefix_caching=True))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def want(model_dir):
    return LLM(model_dir).generate([PROMPT], GREEDY)[0]


LONG = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)


async def running(engine, rid: str):
    """A long request read by a task, once its first output has come: (the task, its outputs so far)."""
    outs = []

    async def read():
        async for out in engine.generate(PROMPT, LONG, rid):
            outs.append(out)
    task = asyncio.ensure_future(read())
    while not outs:
        await asyncio.sleep(0.01)
    return task, outs


def collect(engine, prompt, params, rid, **kw) -> list:
    async def go():
        return [out async for out in engine.generate(prompt, params, rid, **kw)]
    return asyncio.run(go())


def test_cumulative_outputs_grow_to_the_engines_output(engine, want):
    """The default kind: the output so far after every step, each a snapshot (a later one does not
    change an earlier one), the last finished and equal to LLM.generate's."""
    outs = collect(engine, TokensPrompt(prompt_token_ids=PROMPT), GREEDY, "c")
    assert len(outs) > 1 and [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    lens = [len(o.token_ids) for o in outs]
    assert lens == sorted(set(lens)) and lens[-1] == 24  # (a list of one object grown in place fails)
    for a, b in zip(outs, outs[1:]):
        assert b.token_ids[:len(a.token_ids)] == a.token_ids and b.logprobs[:len(a.logprobs)] == a.logprobs
        assert b.text.startswith(a.text)
    last = outs[-1]
    assert (last.token_ids, last.logprobs, last.text) == (want.token_ids, want.logprobs, want.text)
    c = last.outputs[0]  # what verl reads: tokens, and each one's logprob from the per-position dicts
    assert [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)] == pytest.approx(want.logprobs)
    assert all(o.request_id == "c" and o.prompt_token_ids == PROMPT for o in outs)


def test_delta_pieces_add_up_and_final_only_yields_once(engine, want):
    import dataclasses
    deltas = collect(engine, PROMPT, dataclasses.replace(GREEDY, output_kind=RequestOutputKind.DELTA), "d")
    assert len(deltas) > 1 and deltas[-1].finished
    assert sum((o.token_ids for o in deltas), []) == want.token_ids
    assert sum((o.logprobs for o in deltas), []) == want.logprobs
    assert sum((o.top_logprobs for o in deltas), []) == want.top_logprobs
    assert "".join(o.outputs[0].text for o in deltas) == want.text
    final = collect(engine, PROMPT, dataclasses.replace(GREEDY, output_kind=2), "f")
    assert len(final) == 1 and final[0].token_ids == want.token_ids and final[0].finished


def test_stream_interval_batches_the_pieces(engine, model_dir, want):
    """vLLM's stream_interval: each piece carries at least that many new tokens, but the first (at
    once) and the last; they add up to the same output. The engine's --stream-interval raises a
    request's, never lowers it."""
    import dataclasses
    delta = dataclasses.replace(GREEDY, output_kind=RequestOutputKind.DELTA)
    for params in (dataclasses.replace(delta, stream_interval=5), delta):
        pieces = collect(engine, PROMPT, params, f"si-{params.stream_interval}")
        assert sum((o.token_ids for o in pieces), []) == want.token_ids and pieces[-1].finished
        sizes = [len(o.token_ids) for o in pieces]
        step = params.stream_interval or 1
        assert sizes[0] == 1 and all(n >= step for n in sizes[1:-1]) and len(pieces) <= 2 + 23 // step
    assert len(collect(engine, PROMPT, delta, "si-1")) == 24  # (greedy, no drafts: a token a step)
    eng = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model_dir, stream_interval=4))
    try:
        for params, step in ((delta, 4), (dataclasses.replace(delta, stream_interval=2), 4),
                             (dataclasses.replace(delta, stream_interval=8), 8)):
            sizes = [len(o.token_ids) for o in collect(eng, PROMPT, params, f"e-{step}")]
            assert sum(sizes) == 24 and all(n >= step for n in sizes[1:-1]) and len(sizes) <= 2 + 23 // step
    finally:
        eng.shutdown()
    with pytest.raises(ValueError, match="stream_interval must be >= 1"):
        SamplingParams(stream_interval=0)


def test_flat_logprobs_in_every_streamed_output(engine, want):
    from rollwise.types import FlatLogprobs
    import dataclasses
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
        outs = collect(engine, PROMPT, dataclasses.replace(GREEDY, flat_logprobs=True, output_kind=kind), f"flat{kind}")
        assert len(outs) > 1 and all(isinstance(o.outputs[0].logprobs, FlatLogprobs) for o in outs)
        got = list(outs[-1].outputs[0].logprobs) if kind == RequestOutputKind.CUMULATIVE else [
            p for o in outs for p in o.outputs[0].logprobs]
        assert got == want.outputs[0].logprobs


def test_text_prompts_and_n_samples(engine, model_dir):
    """A text prompt is tokenized as the engine does and named in `.prompt`; n samples come once, all
    done, as LLM.generate gives them for their seeds, under the request's id."""
    sp = SamplingParams(temperature=1.0, seed=4, max_tokens=10, n=3)
    want = LLM(model_dir).generate(["hello there"], sp)[0]
    outs = collect(engine, {"prompt": "hello there"}, sp, "s")
    assert len(outs) == 1 and outs[0].request_id == "s" and outs[0].prompt == "hello there"
    assert [c.token_ids for c in outs[0].outputs] == [c.token_ids for c in want.outputs]
    assert [c.index for c in outs[0].outputs] == [0, 1, 2]
    assert outs[0].prompt_token_ids == engine.tokenizer.encode("hello there")


def test_closing_early_or_abort_ends_the_request(engine):
    async def go():
        async for out in engine.generate(PROMPT, LONG, "early"):  # a caller that stops reading
            if len(out.token_ids) >= 3:
                break
        for _ in range(200):  # the generator is closed as it goes away: its request is aborted
            if not engine.engine.engine.has_unfinished:
                break
            await asyncio.sleep(0.01)
        assert not engine.engine.engine.has_unfinished
        task, outs = await running(engine, "aborted")
        await engine.abort("aborted")
        await task
        assert outs[-1].finished and outs[-1].finish_reason == "abort" and len(outs[-1].token_ids) < 2000
    asyncio.run(go())


def test_bad_arguments_are_value_errors(engine, model_dir):
    with pytest.raises(ValueError, match="output_kind must be one of"):
        SamplingParams(output_kind=3)
    with pytest.raises(ValueError, match="unknown LLM arguments"):
        AsyncEngineArgs(model=model_dir, tensor_paralel_size=1)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        AsyncEngineArgs(model=model_dir, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="start_engine_loop"):
        AsyncLLM.from_engine_args(AsyncEngineArgs(model=model_dir), start_engine_loop=False)
    for prompt, params, rid, match in [
            (PROMPT, GREEDY, None, "request_id"), (PROMPT, {"max_tokens": 3}, "x", "rollwise"),
            ({"prompt_token_ids": PROMPT, "multi_modal_data": {}}, GREEDY, "x", "prompt dict"),
            ([], GREEDY, "x", "non-empty")]:
        with pytest.raises(ValueError, match=match):
            collect(engine, prompt, params, rid)
    assert not engine.engine.engine.has_unfinished and asyncio.run(engine.check_health()) is None


def test_pause_sleep_and_the_prefix_cache(engine, want):
    """pause_generation aborts what is in flight (or waits for it), resume_generation goes on; a reset
    prefix cache serves the same prompt from scratch; sleep / wake_up give back and restore the KV pool."""
    async def go():
        task, outs = await running(engine, "paused")
        await engine.pause_generation()
        await task
        assert outs[-1].finish_reason == "abort" and await engine.is_paused()
        await engine.resume_generation()
        assert not await engine.is_paused()
        ids = list(range(100, 148))  # three blocks
        first = [o async for o in engine.generate(ids, GREEDY, "a")][-1]
        again = [o async for o in engine.generate(ids, GREEDY, "b")][-1]
        assert await engine.reset_prefix_cache()
        fresh = [o async for o in engine.generate(ids, GREEDY, "c")][-1]
        assert again.num_cached_tokens > 0 and first.num_cached_tokens == fresh.num_cached_tokens == 0
        assert first.token_ids == again.token_ids == fresh.token_ids
        await engine.sleep(1)
        assert await engine.is_sleeping()
        await engine.wake_up()
        assert not await engine.is_sleeping()
        assert [o async for o in engine.generate(PROMPT, GREEDY, "d")][-1].token_ids == want.token_ids
    asyncio.run(go())


def test_vllm_032_pause_sleep_and_reset_modes(engine, want):
    """vLLM 0.32's modes: a "keep" pause holds requests with their KV and they go on to the same tokens;
    a "wait" pause and a "wait" sleep let them finish; an "abort" sleep ends them; resetting the prefix
    cache with reset_running_requests recomputes a running request's KV, its tokens unchanged."""
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    async def finish(task, outs):
        await task
        return outs[-1]

    async def last_of(rid):
        return [o async for o in engine.generate(PROMPT, greedy, rid)][-1]

    async def go():
        assert engine.get_tokenizer() is engine.tokenizer  # (not awaited, as in vLLM 0.32)
        for mode, kw in (("keep", {}), ("wait", {}), ("abort", {"wait_for_inflight_requests": False})):
            task, outs = await running(engine, f"p-{mode}")
            await engine.pause_generation(mode=mode, **kw)
            if mode == "wait":
                assert outs[-1].finished and outs[-1].finish_reason == "length"
            await engine.resume_generation()
            last = await finish(task, outs)
            assert last.finish_reason == ("abort" if mode == "abort" else "length"), mode
        for mode in ("wait", "abort"):
            task, outs = await running(engine, f"s-{mode}")
            await engine.sleep(1, mode=mode)
            assert await engine.is_sleeping() and outs[-1].finished
            assert outs[-1].finish_reason == ("length" if mode == "wait" else "abort")
            assert await engine.wake_up() is True
            await task
        with pytest.raises(ValueError, match="sleeps idle"):
            await engine.sleep(1, mode="keep")
        for level in (0, 1):  # a request that comes while it sleeps waits for wake_up, then runs (vLLM queues it)
            await engine.sleep(level)
            late = asyncio.ensure_future(last_of(f"late-{level}"))
            await asyncio.sleep(0.05)
            assert not late.done() and await engine.is_sleeping()
            assert await engine.wake_up(tags=["weights"]) is (level == 0)  # (the KV pool still given back)
            assert await engine.wake_up() is True and not await engine.is_sleeping()
            assert (await late).token_ids == want.token_ids
        with pytest.raises(ValueError, match="sleep level must be"):
            await engine.sleep(3)
        outs = []

        async def read():
            async for out in engine.generate(PROMPT, greedy, "reset"):
                outs.append(out)
        task = asyncio.ensure_future(read())
        while not outs:
            await asyncio.sleep(0.001)
        assert await engine.reset_prefix_cache(reset_running_requests=True)
        await task
        assert outs[-1].token_ids == want.token_ids
    asyncio.run(go())
    assert not engine.engine.engine.has_unfinished


def test_vllms_other_generate_options(engine):
    outs = collect(engine, PROMPT, GREEDY, "t", prompt_text="some text", data_parallel_rank=0)
    assert outs[-1].prompt == "some text"
    for kw, match in [({"session_id": "s"}, "session_id is not taken"), ({"data_parallel_rank": 1}, "one replica"),
                      ({"tokenization_kwargs": {"truncation": True}}, "tokenization_kwargs")]:
        with pytest.raises(ValueError, match=match):
            collect(engine, PROMPT, GREEDY, "t", **kw)


def test_llm_takes_vllm_032s_arguments(model_dir):
    llm = LLM(model_dir)
    conv = [{"role": "user", "content": "hi"}]
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    got = llm.chat(conv, GREEDY, chat_template=template, priority=0)[0]
    assert got.prompt_token_ids == llm.tokenizer.encode("<user>hi<assistant>")
    assert llm.chat(conv, GREEDY)[0].prompt_token_ids == llm.tokenizer.encode_chat(conv)  # (its own template kept)
    assert [o.token_ids for o in llm.generate([PROMPT, PROMPT[:3]], GREEDY, priority=0)] == \
        [o.token_ids for o in llm.generate([PROMPT, PROMPT[:3]], GREEDY)]
    for call, match in [(lambda: llm.sleep(1, mode="later"), "mode must be one of"),
                        (lambda: llm.generate(PROMPT, GREEDY, mm_processor_kwargs={}), "mm_processor_kwargs"),
                        (lambda: llm.chat(conv, GREEDY, chat_template_content_format="openai"), "only 'auto'")]:
        with pytest.raises(ValueError, match=match):
            call()
    llm.sleep(1, mode="wait")
    assert llm.wake_up() is True and llm.reset_prefix_cache(reset_running_requests=True)
