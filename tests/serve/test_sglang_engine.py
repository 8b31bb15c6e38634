"""SGLang's offline engine (`sglang.Engine`) on rollwise: its arguments, reply dicts, batch, n, stream,
weight updates and memory calls, against what rollwise's own engine gives for the same requests."""
from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from rollwise import LLM, SamplingParams, SGLangEngine
from tests.conftest import FAMILIES

GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
PROMPTS = [[5, 6, 7, 8, 9, 10], [30, 31, 32]]


@pytest.fixture(scope="module")
def engine(model_dir):
    with SGLangEngine(model_path=model_dir, tp_size=1, mem_fraction_static=0.5, random_seed=0, dtype="auto",
                      log_level="error", attention_backend="fa3") as eng:
        yield eng


@pytest.fixture(scope="module")
def want(model_dir):
    return LLM(model_dir).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2))


def test_one_prompt_and_a_batch_reply_as_sglang(engine, want):
    out = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, return_logprob=True, top_logprobs_num=2)
    assert out["output_ids"] == want[0].token_ids and out["text"] == want[0].text
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 12} and meta["prompt_tokens"] == 6
    assert [lp for lp, _, _ in meta["output_token_logprobs"]] == pytest.approx(want[0].logprobs)
    assert [t for _, t, _ in meta["output_token_logprobs"]] == want[0].token_ids
    assert [[t for _, t, _ in top] for top in meta["output_top_logprobs"]] == [list(t) for t in want[0].top_logprobs]
    outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, rid=["a", "b"])
    assert [o["output_ids"] for o in outs] == [w.token_ids for w in want]
    assert [o["meta_info"]["id"] for o in outs] == ["a", "b"]
    # SGLang's per-prompt lists: each prompt of the batch gets its own logprob options
    outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=[False, True],
                           top_logprobs_num=[0, 2], logprob_start_len=[-1, 1])
    assert "output_token_logprobs" not in outs[0]["meta_info"]
    meta = outs[1]["meta_info"]
    assert [t for _, t, _ in meta["output_token_logprobs"]] == want[1].token_ids
    assert len(meta["output_top_logprobs"][0]) == 2 and len(meta["input_token_logprobs"]) == len(PROMPTS[1]) - 1
    for kw in (dict(input_ids=PROMPTS, return_logprob=[True]), dict(input_ids=PROMPTS[0], return_logprob=[True]),
               dict(input_ids=PROMPTS, lora_path=["x", None, None])):
        with pytest.raises(ValueError, match="one per prompt|one or 2 of each"):
            engine.generate(sampling_params=GREEDY, **kw)


def test_text_n_samples_and_streams(engine, model_dir):
    sp = SamplingParams(temperature=1.0, seed=2, max_tokens=8, n=3)
    want = LLM(model_dir).generate(["hello there"], sp)[0]
    outs = engine.generate(prompt="hello there", sampling_params={"max_new_tokens": 8, "seed": 2, "n": 3})
    assert [o["output_ids"] for o in outs] == [c.token_ids for c in want.outputs]
    chunks = list(engine.generate(input_ids=PROMPTS[1], sampling_params=GREEDY, stream=True))
    ids = [c["output_ids"] for c in chunks]
    assert len(chunks) > 1 and all(b[:len(a)] == a and len(b) > len(a) for a, b in zip(ids, ids[1:]))
    assert [c["meta_info"]["finish_reason"] is None for c in chunks] == [True] * (len(chunks) - 1) + [False]
    assert chunks[-1]["output_ids"] == engine.generate(input_ids=PROMPTS[1], sampling_params=GREEDY)["output_ids"]
    assert all(chunks[-1]["text"].startswith(c["text"]) for c in chunks)

    async def stream_async():  # async_generate(stream=True) gives an async iterator, as SGLang's
        got = [c async for c in await engine.async_generate(input_ids=PROMPTS[1], sampling_params=GREEDY, stream=True)]
        return got[-1]["output_ids"]
    assert asyncio.run(stream_async()) == chunks[-1]["output_ids"]


def test_a_stream_left_unread_aborts_its_request(engine):
    chunks = engine.generate(input_ids=PROMPTS[0], sampling_params={**GREEDY, "max_new_tokens": 5000}, stream=True)
    assert len(next(chunks)["output_ids"]) < 5000
    chunks.close()
    assert not engine.engine.engine.has_unfinished


def test_weights_from_tensor_in_buckets_and_memory(engine, model_dir, tmp_path):
    """Two buckets of another model's tensors make this engine that model; released and resumed memory
    serves the same tokens; a bad update is (False, why) and changes nothing."""
    from safetensors.torch import load_file

    from rollwise.make_model import make_model
    other = make_model(tmp_path / "other", **{**FAMILIES["qwen3"], "seed": 11})
    tensors = load_file(str(sorted(Path(other).glob("*.safetensors"))[0]))
    names = sorted(tensors)
    want = LLM(str(other)).generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    before = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["output_ids"]
    assert before != want.token_ids
    bad = engine.update_weights_from_tensor([("model.nope.weight", tensors[names[0]])])
    assert bad[0] is False and "nope" in bad[1]
    assert engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["output_ids"] == before
    half = len(names) // 2
    for bucket in (names[:half], names[half:]):
        ok, message, _ = engine.update_weights_from_tensor([(n, tensors[n]) for n in bucket], flush_cache=False)
        assert ok, message
    assert engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["output_ids"] == want.token_ids
    engine.release_memory_occupation(["kv_cache"])
    assert engine.get_server_info()["internal_states"][0]["sleeping"] == ["kv_cache"]
    engine.resume_memory_occupation(["kv_cache"])
    assert engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["output_ids"] == want.token_ids
    assert engine.update_weights_from_disk(model_dir)[0]
    assert engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["output_ids"] == before
    assert engine.flush_cache()


def test_bad_arguments_are_value_errors(engine, model_dir):
    from rollwise.serve.sglang_engine import Engine
    for kw, match in [(dict(model_path=model_dir, tp_size=2), "tp_size"),
                      (dict(model_path=model_dir, foo=1), "unknown"),
                      (dict(model_path=model_dir, random_seed=1, seed=2), "twice"), (dict(tp_size=1), "model_path"),
                      (dict(model_path=model_dir, lora_paths=[3]), "lora_paths")]:
        with pytest.raises(ValueError, match=match):
            Engine(**kw)
    for kw, match in [(dict(input_ids=[1], image_data="x.png"), "image_data is not taken"),
                      (dict(input_ids=[1], prompt="a"), "exactly one"), (dict(input_ids=[1], bogus=1), "unknown"),
                      (dict(input_ids=[1], sampling_params={"max_new_tokens": -1}), "max_tokens"),
                      (dict(input_ids=[1], return_logprob="yes"), "bad generate arguments")]:
        with pytest.raises(ValueError, match=match):
            engine.generate(**kw)
    with pytest.raises(ValueError, match="mode must be one of"):
        engine.pause_generation("later")
    assert not engine.engine.engine.has_unfinished


def test_pause_and_abort(engine):
    """pause_generation("abort") ends what is in flight; continue_generation serves again; abort_request
    by rid ends that request."""
    async def go():
        task = asyncio.ensure_future(engine.async_generate(input_ids=PROMPTS[0], rid="long",
                                                           sampling_params={**GREEDY, "max_new_tokens": 5000}))
        while not engine.engine.engine.has_unfinished:
            await asyncio.sleep(0.01)
        assert await engine.engine.pause(abort=True) == ["long"]
        out = await task
        await engine.engine.resume()
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
    asyncio.run(go())
    assert engine.pause_generation("in_place") == [] and engine.continue_generation() is None
    assert engine.abort_request(rid="nothing") == []
    out = engine.generate(input_ids=PROMPTS[1], sampling_params=GREEDY)
    assert out["meta_info"]["finish_reason"]["type"] == "length"


def test_an_sglang_offline_script_runs_as_written(model_dir):
    """examples/sglang_offline.py, written against `sglang.Engine`, runs on rollwise by its import alone."""
    got = subprocess.run([sys.executable, "examples/sglang_offline.py", model_dir], capture_output=True, text=True,
                         timeout=300)
    assert got.returncode == 0, got.stderr[-2000:]
    lines = got.stdout.splitlines()
    assert sum(x.startswith("rollout ") for x in lines) == 4 and lines[-1] == "same tokens after the update: True"
