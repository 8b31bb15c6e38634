"""A failed engine step fails the request that caused it; the others finish with the tokens they
would have had (rollwise/engine/isolation.py)."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from rollwise import LLM, SamplingParams
from rollwise.engine.async_engine import AsyncEngine
from rollwise.engine.isolation import StepFailed
from rollwise.engine.sequence import Status

PROMPTS = [[5 + i, 9, 14 + 3 * i, 2, 7] * (1 + i % 3) for i in range(6)]
PARAMS = [SamplingParams(temperature=0, max_tokens=20 + 3 * i, ignore_eos=True) if i % 2 else
          SamplingParams(temperature=1.0, seed=100 + i, max_tokens=16 + 2 * i, ignore_eos=True, logprobs=1)
          for i in range(6)]
CULPRIT = SamplingParams(temperature=1.0, seed=13, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(model_dir):
    return [o.token_ids for o in LLM(model_dir, max_num_seqs=8).generate(PROMPTS, PARAMS)]


def _culprit_in(rows) -> bool:  # seed 13 fails at once, seed 15 at its third token
    return any(r.params.seed == 13 or r.params.seed == 15 and r.position >= 2 for r in rows)


def _faults(eng: AsyncEngine, where: str, failed: list) -> None:
    """Make the engine's steps raise: `sampler` whenever the culprit's row is sampled; `postprocess`
    when its token is checked for a stop, after the tokens of the requests before it in the batch
    were appended (a step half done); `big_batch` once, on the first step of more than 4 rows
    (memory running out, say: no request is to blame). `failed` gets each failed step's size."""
    inner = eng.engine
    if where == "postprocess":
        check = inner._check_stop

        def bad_check(seq, tok):
            if seq.params.seed == 13:
                failed.append(len(inner.isolation.batch))
                raise IndexError("boom in postprocess")
            return check(seq, tok)
        inner._check_stop = bad_check
        return
    real = inner.sampler

    class Faulty:
        def __getattr__(self, name):
            return getattr(real, name)

        def __call__(self, logits, rows):
            if where == "sampler" and _culprit_in(rows) or where == "big_batch" and len(rows) > 4 and not failed:
                failed.append(len(inner.isolation.batch))
                raise (IndexError("boom in the sampler") if where == "sampler" else
                       MemoryError("out of memory on a big batch"))
            return real(logits, rows)
    inner.sampler = Faulty()


@pytest.mark.parametrize("where,spec", [("sampler", None), ("postprocess", None), ("big_batch", None),
                                        ("sampler", "suffix")])
def test_a_failed_step_fails_only_its_culprit(model_dir, reference, where, spec):
    eng = AsyncEngine(model_dir, max_num_seqs=8, **({} if spec is None else {"speculative": spec,
                                                                              "spec_controller": "always"}))
    failed: list = []
    _faults(eng, where, failed)

    def frozen_while_running() -> bool:  # (on the engine thread, between steps)
        seqs = list(eng.engine.seqs.values())
        if len(seqs) == len(PROMPTS) and all(s.num_output_tokens >= 1 for s in seqs):
            eng.paused = True
        return eng.paused

    async def go():
        runs = [asyncio.ensure_future(eng.generate(p, sp)) for p, sp in zip(PROMPTS, PARAMS)]
        culprit = None
        if where != "big_batch":  # the others are running when the culprit comes, however late this
            while not await eng.call(frozen_while_running):  # thread wakes: the engine waits for it
                await asyncio.sleep(0.001)
            culprit = asyncio.ensure_future(eng.generate([3, 4, 5, 6], CULPRIT))
            runs.append(culprit)
            while not await eng.call(lambda: len(eng.engine.seqs) > len(PROMPTS)):
                await asyncio.sleep(0.001)
            await eng.resume()
        outs = await asyncio.gather(*runs, return_exceptions=True)
        after = await eng.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        return outs, culprit, after
    try:
        outs, culprit, after = asyncio.run(asyncio.wait_for(go(), 120))
        m = eng.metrics()
        eng.engine.scheduler.check_integrity()
        assert not eng.engine.seqs and not eng.engine.isolation.suspects
    finally:
        eng.shutdown()
    # the first failure was a step shared with others that were running; a culprit then fails alone
    assert m["num_failed_steps"] == len(failed) and failed[0] > 1, failed
    if culprit is not None:
        assert failed[-1] == 1
        err = outs[-1]
        assert isinstance(err, RuntimeError) and "failed the engine step" in str(err), err
        assert isinstance(err.__cause__, IndexError)
        outs = outs[:-1]
    assert [o.token_ids for o in outs] == reference  # nobody else lost or changed a token
    assert all(o.finish_reason == "length" for o in outs)
    assert len(after.token_ids) == 4  # and the engine keeps serving


def test_a_step_that_fails_alone_fails_its_request(model_dir):
    """A lone request whose every step fails gets the error; nothing is left behind in the engine."""
    eng = AsyncEngine(model_dir)
    _faults(eng, "sampler", [])
    try:
        with pytest.raises(RuntimeError, match="failed the engine step"):
            asyncio.run(asyncio.wait_for(eng.generate([3, 4, 5, 6], CULPRIT), 60))
        assert not eng.engine.seqs and not eng.engine.isolation.suspects
        eng.engine.scheduler.check_integrity()
    finally:
        eng.shutdown()


def test_the_server_answers_a_failed_request_with_a_json_500_and_keeps_serving(model_dir):
    from fastapi.testclient import TestClient

    from rollwise.config import ServerConfig
    from rollwise.serve.server import build_app
    eng = AsyncEngine(model_dir)
    _faults(eng, "sampler", [])
    try:
        client = TestClient(build_app(eng, ServerConfig(), "m"), raise_server_exceptions=False)
        bad = client.post("/generate", json={"input_ids": [3, 4, 5], "sampling_params": {
            "temperature": 1.0, "seed": 13, "max_tokens": 4}})
        assert bad.status_code == 500 and "failed the engine step" in bad.json()["error"]["message"]
        def streamed(seed):
            r = client.post("/generate", json={"input_ids": [3, 4, 5], "stream": True, "sampling_params": {
                "temperature": 1.0, "seed": seed, "max_tokens": 4, "ignore_eos": True}})
            return r, [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
        r, _ = streamed(13)  # before its first token: a plain 500 (a stream sends its headers with it)
        assert r.status_code == 500 and r.json()["error"]["type"] == "request_failed"
        r, events = streamed(15)  # after its first tokens: the stream's last event says so
        assert r.status_code == 200 and events[-1]["error"]["type"] == "request_failed"
        assert events[0]["token_ids"] and r.text.endswith("data: [DONE]\n\n")
        good = client.post("/generate", json={"input_ids": [3, 4, 5], "sampling_params": {
            "temperature": 1.0, "seed": 14, "max_tokens": 4, "ignore_eos": True}})
        assert good.status_code == 200 and len(good.json()["token_ids"]) == 4
        assert "rollwise:failed_engine_steps_total{model_name=\"m\"} 3.0" in client.get("/metrics").text
    finally:
        eng.shutdown()


def test_when_taking_a_step_apart_fails_every_request_fails_and_the_engine_serves_on(model_dir):
    eng = AsyncEngine(model_dir)
    _faults(eng, "big_batch", [])

    def broken():
        raise KeyError("isolation bug")
    eng.engine.isolation.failed = broken

    async def go():
        runs = [eng.generate(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
        outs = await asyncio.gather(*runs, return_exceptions=True)
        return outs, await eng.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    try:
        outs, after = asyncio.run(asyncio.wait_for(go(), 60))
        assert all(isinstance(o, KeyError) for o in outs) and len(after.token_ids) == 4 and eng.is_running
    finally:
        eng.shutdown()


def test_a_dead_engine_thread_fails_its_callers_instead_of_hanging_them(model_dir):
    """A bug that kills the engine loop itself (here SystemExit, which the step's guard does not
    catch): requests in flight and calls queued get an error, later calls one at once, the server's
    /health a 503."""
    from fastapi.testclient import TestClient

    from rollwise.config import ServerConfig
    from rollwise.serve.server import build_app
    eng = AsyncEngine(model_dir)
    step = eng.engine.step

    def dying():
        if len(eng.engine.seqs) > 1:
            raise SystemExit("loop bug")
        return step()
    eng.engine.step = dying
    client = TestClient(build_app(eng, ServerConfig(), "m"), raise_server_exceptions=False)
    assert client.get("/health").status_code == 200

    async def go():
        runs = [eng.generate(p, sp) for p, sp in zip(PROMPTS[:3], PARAMS[:3])]
        return await asyncio.gather(*runs, return_exceptions=True)
    try:
        outs = asyncio.run(asyncio.wait_for(go(), 60))
        assert all(isinstance(o, RuntimeError) and "engine thread died" in str(o) for o in outs), outs
        assert not eng.is_running
        with pytest.raises(RuntimeError, match="engine thread died"):
            asyncio.run(asyncio.wait_for(eng.generate([1, 2], SamplingParams(max_tokens=2)), 10))
        r = client.get("/health")
        assert r.status_code == 503 and r.json()["error"]["type"] == "unavailable"
    finally:
        eng.shutdown()


@pytest.mark.parametrize("spec", [None, "suffix"])
def test_chaos_every_request_ends_and_seeded_ones_keep_their_tokens(model_dir, spec):
    """Requests (streamed or not, priorities, seeds, stop strings, top-k/top-p) under random aborts,
    cancels, pauses (abort, keep, drain and retract), weight updates (partial rollout or not), cache flushes and a
    culprit that fails its steps: every request ends (its output, or StepFailed for the culprit
    alone), the engine is empty and consistent after, and with batch invariance each seeded request
    that finished has the tokens it has alone. (Timing decides the interleaving; these hold for all.)"""
    import random

    from rollwise.engine.models.loader import load_state_dict
    rng = random.Random(0)
    eng = AsyncEngine(model_dir, max_num_seqs=16, num_kv_blocks=64, max_num_batched_tokens=256,
                      batch_invariant=True, scheduling_policy="priority", keep_weight_versions=2,
                      **({} if spec is None else {"speculative": spec, "spec_controller": "always"}))
    _faults(eng, "sampler", [])
    weights = load_state_dict(model_dir)
    ended, seeded, wrong = [], [], []

    async def one(i):
        prompt = [rng.randrange(3, 1000) for _ in range(rng.randint(1, 80))]
        sp = SamplingParams(temperature=rng.choice([0, 1.0]), seed=rng.choice([None, 1, 2, 13]),
                            max_tokens=rng.randint(1, 40), ignore_eos=rng.random() < 0.7, stop=rng.choice([[], ["a"]]),
                            top_k=rng.choice([0, 5]), top_p=rng.choice([1.0, 0.9]))
        try:
            if rng.random() < 0.4:
                stream = eng.stream(prompt, sp, priority=rng.randint(-2, 2))
                async for out in stream:
                    if rng.random() < 0.03:
                        await stream.aclose()
                        return ended.append("cancelled")
            else:
                out = await eng.generate(prompt, sp, priority=rng.randint(-2, 2), group_id=rng.choice([None, "g"]))
            if not (out.finished and out.finish_reason in ("stop", "length", "abort")):
                wrong.append(out)
            ended.append(out.finish_reason)
            if out.finish_reason != "abort" and sp.seed in (1, 2):
                seeded.append((prompt, sp, list(out.token_ids)))
        except StepFailed:
            ended.append("failed") if sp.seed == 13 else wrong.append(("a bystander failed", sp))

    async def steps(n):  # n engine steps (or 2 s without one): the pace is the engine's, however loaded
        start, t0 = eng.engine.stats["num_steps"], time.monotonic()
        while eng.engine.stats["num_steps"] < start + n and time.monotonic() < t0 + 2:
            await asyncio.sleep(0.005)

    async def control():
        first = True  # (an abort of all in flight first, so that a fast run still sees one)
        while True:
            await steps(rng.randint(6, 24))
            op, first = 1 if first else rng.randrange(10), False
            if op == 0 and (ids := await eng.call(lambda: list(eng.engine.seqs))):
                await eng.abort(rng.choice(ids))
            elif op in (1, 2, 3):
                await eng.pause(abort=op == 1)
                await asyncio.sleep(0.02)
                await eng.resume()
            elif op == 8:  # drain: those that arrive meanwhile are held back
                await eng.pause(wait=True)
                await eng.resume()
            elif op == 9:  # retract: the KV in flight dropped, and the update moves them onto the new weights
                await eng.pause(retract=True)
                await eng.update_weights(weights)
                await eng.resume()
            elif op in (4, 5):
                await eng.update_weights(weights, partial_rollout=op == 5)
            else:
                await eng.call(eng.engine.blocks.evict_cached)

    slots = asyncio.Semaphore(24)

    async def limited(i):
        async with slots:
            await one(i)

    async def go():
        ctl = asyncio.ensure_future(control())
        await asyncio.gather(*(limited(i) for i in range(160)))
        ctl.cancel()
        await eng.resume()
        # (a suspect aborted after the last step stays listed, ended, until a step passes it over)
        state = await eng.call(lambda: (eng.engine.scheduler.check_integrity(), len(eng.engine.seqs),
                                        sum(s.status is not Status.FINISHED for s in eng.engine.isolation.suspects)))
        again = [await eng.generate(p, sp) for p, sp, _ in seeded[:40]]
        return state, again
    try:
        state, again = asyncio.run(asyncio.wait_for(go(), 240))
    finally:
        eng.shutdown()
    assert not wrong and len(ended) == 160 and state[1:] == (0, 0), (wrong[:3], state)
    assert {"failed", "abort"} <= set(ended) and len(seeded) >= 10
    assert [list(a.token_ids) for a in again] == [toks for _, _, toks in seeded[:40]]
