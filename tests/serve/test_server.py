"""The HTTP server over real HTTP on 127.0.0.1 (a `rollwise serve` subprocess)."""
from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import pytest

from rollwise import LLM, SamplingParams
from rollwise.serve.process import ServerProcess


@pytest.fixture(scope="module")
def server(model_dir):
    with ServerProcess(model_dir, "--max-num-seqs", "16", "--max-model-len", "512") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _alive(client):
    assert client.get("/health").json()["status"] == "ok"


def test_generate_is_token_in_token_out_and_matches_offline(client, model_dir):
    ids = [5, 17, 300, 42, 9]
    r = client.post("/generate", json={"input_ids": ids, "sampling_params": {"temperature": 0, "max_tokens": 8,
                                                                              "ignore_eos": True}})
    assert r.status_code == 200, r.text
    body = r.json()
    ref = LLM(model_dir).generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert body["token_ids"] == ref.token_ids and body["finish_reason"] == "length"
    assert body["logprobs"] == pytest.approx(ref.logprobs, abs=1e-4)
    assert body["prompt_len"] == 5 and body["policy_version"] == 0
    pinned = client.post("/generate", json={"input_ids": ids, "policy_version": 0, "sampling_params": {
        "temperature": 0, "max_tokens": 8, "ignore_eos": True}}).json()
    assert pinned["token_ids"] == ref.token_ids
    again = client.post("/generate", json={"input_ids": ids * 8, "sampling_params": {"max_tokens": 2}}).json()
    again2 = client.post("/generate", json={"input_ids": ids * 8 + [1], "sampling_params": {"max_tokens": 2}}).json()
    assert again["num_cached_tokens"] == 0 and again2["num_cached_tokens"] == 32


def test_generate_stream(client):
    with client.stream("POST", "/generate", json={"input_ids": [1, 2, 3], "stream": True, "policy_version": 0,
                                                  "sampling_params": {"temperature": 0, "max_tokens": 6, "ignore_eos": True}}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    assert sum(len(c["token_ids"]) for c in chunks) == 6
    # SGLang's name for the length limit (what sglang-router forwards) means the same
    sgl = client.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}})
    assert len(sgl.json()["token_ids"]) == 5
    assert chunks[-1]["finished"] and chunks[-1]["finish_reason"] == "length"
    # a streamed trace replay emits the trace, as a plain one does
    trace = [7, 8, 9, 7, 8]
    with client.stream("POST", "/generate", json={"input_ids": [1, 2, 3], "stream": True, "forced_output": trace,
                                                  "trajectory_id": "t1", "sampling_params": {"max_tokens": 5}}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    assert [t for c in chunks for t in c["token_ids"]] == trace


def test_generate_speaks_sglang(client, model_dir):
    """An SGLang client's /generate (AReaL, slime, verl's SGLang rollout): its names in the request
    (text, rid, max_new_tokens, min_new_tokens, no_stop_trim, return_logprob, top_logprobs_num,
    logprob_start_len) and `output_ids` + `meta_info` in the reply, equal to the engine's."""
    ids = [5, 17, 300, 42, 9]
    ref = LLM(model_dir).generate([ids], SamplingParams(temperature=0, max_tokens=6, min_tokens=6, logprobs=2,
                                                        prompt_logprobs=2))[0]
    body = {"input_ids": ids, "rid": "sgl-1", "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 1,
            "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": 6, "min_new_tokens": 6, "temperature": 0, "no_stop_trim": True,
                                "spaces_between_special_tokens": False}}
    got = client.post("/generate", json=body).json()
    meta = got["meta_info"]
    assert got["output_ids"] == ref.token_ids and meta["id"] == "sgl-1"
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (5, 6)
    lp, tok, text = map(list, zip(*meta["output_token_logprobs"]))
    assert tok == ref.token_ids and lp == pytest.approx(ref.logprobs, abs=1e-4) and all(isinstance(t, str) for t in text)
    assert [[t for _, t, _ in top] for top in meta["output_top_logprobs"]] == [list(t) for t in ref.top_logprobs]
    assert [t for _, t, _ in meta["input_token_logprobs"]] == ids[1:]
    assert [x for x, _, _ in meta["input_token_logprobs"]] == pytest.approx(ref.prompt_logprobs[1:], abs=1e-4)
    assert len(meta["input_top_logprobs"]) == 4
    plain = client.post("/generate", json={"text": "The agent", "sampling_params": {"max_new_tokens": 3}}).json()
    assert len(plain["output_ids"]) == 3 and "output_token_logprobs" not in plain["meta_info"]
    bad = client.post("/generate", json={"input_ids": ids, "sampling_params": {"min_new_tokens": 2, "min_tokens": 3}})
    assert bad.status_code == 400


def test_completions(client):
    r = client.post("/v1/completions", json={"model": "x", "prompt": "The agent", "max_tokens": 5, "temperature": 0,
                                             "logprobs": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    ch = body["choices"][0]
    assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] == len(ch["logprobs"]["tokens"])
    assert all(lp <= 0 for lp in ch["logprobs"]["token_logprobs"])
    multi = client.post("/v1/completions", json={"prompt": ["a", "b c"], "max_tokens": 3}).json()
    assert [c["index"] for c in multi["choices"]] == [0, 1]
    with client.stream("POST", "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4, "stream": True,
                                                        "temperature": 0, "ignore_eos": True}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_chat_completions(client):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 6, "logprobs": True, "seed": 3})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    assert ch["message"]["role"] == "assistant" and len(ch["logprobs"]["content"]) == r.json()["usage"]["completion_tokens"]
    r2 = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 6, "logprobs": True, "seed": 3})
    assert r2.json()["choices"][0]["message"] == ch["message"]  # seeded: reproducible
    with client.stream("POST", "/v1/chat/completions", json={"messages": msgs, "max_tokens": 5, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_top_logprobs_in_every_format(client, model_dir):
    """completions `logprobs: k`, chat `top_logprobs: k`, /generate `sampling_params.logprobs`,
    streamed and not: the same k most likely tokens per position as the engine's."""
    ids = [5, 17, 300, 42, 9]
    ref = LLM(model_dir).generate([ids], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3))[0]
    gen = client.post("/generate", json={"input_ids": ids, "sampling_params": {
        "temperature": 0, "max_tokens": 4, "ignore_eos": True, "logprobs": 3}}).json()
    assert [[t for t, _ in top] for top in gen["top_logprobs"]] == [list(t) for t in ref.top_logprobs]
    body = {"prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 3,
            "return_tokens_as_token_ids": True}
    lp = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert [list(t) for t in lp["top_logprobs"]] == [[f"token_id:{i}" for i in t] for t in ref.top_logprobs]
    assert [list(t.values()) for t in lp["top_logprobs"]] == [pytest.approx(list(t.values()), abs=1e-4)
                                                               for t in ref.top_logprobs]
    with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
    streamed = [t for c in chunks for t in (c["choices"][0]["logprobs"]["top_logprobs"] or [])]
    assert [list(t) for t in streamed] == [list(t) for t in lp["top_logprobs"]]
    assert client.post("/v1/completions", json=body | {"logprobs": 0}).json()["choices"][0]["logprobs"]["top_logprobs"] is None
    msgs = [{"role": "user", "content": "hi"}]
    chat = {"messages": msgs, "max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    content = client.post("/v1/chat/completions", json=chat).json()["choices"][0]["logprobs"]["content"]
    assert all(len(c["top_logprobs"]) == 2 and c["top_logprobs"][0]["token_id"] == c["token_id"]
               and c["top_logprobs"][0]["logprob"] == pytest.approx(c["logprob"], abs=1e-6) for c in content)
    with client.stream("POST", "/v1/chat/completions", json=chat | {"stream": True}) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
    streamed = [c for ch in chunks for c in (ch["choices"][0]["logprobs"] or {}).get("content", [])]
    assert [[t["token_id"] for t in c["top_logprobs"]] for c in streamed] == \
        [[t["token_id"] for t in c["top_logprobs"]] for c in content]


def test_penalties_in_every_api(client, model_dir):
    """presence / frequency / repetition penalties reach the engine from /generate, completions and
    chat: the same tokens as the engine's with them, other tokens than without them."""
    ids = [5, 17, 300, 42, 9]
    pen = {"presence_penalty": 0.5, "frequency_penalty": 0.8, "repetition_penalty": 1.3}
    llm = LLM(model_dir)
    ref = llm.generate([ids], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, **pen))[0]
    assert ref.token_ids != llm.generate([ids], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].token_ids
    gen = client.post("/generate", json={"input_ids": ids, "sampling_params": {
        "temperature": 0, "max_tokens": 16, "ignore_eos": True, **pen}}).json()
    assert gen["token_ids"] == ref.token_ids
    assert gen["logprobs"] == pytest.approx(ref.logprobs, abs=1e-4)
    body = {"prompt": ids, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "return_tokens_as_token_ids": True, **pen}
    lp = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in ref.token_ids]
    msgs = [{"role": "user", "content": "hi"}]
    chat = llm.engine.tokenizer.encode_chat(msgs)
    want = llm.generate([chat], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, **pen))[0]
    got = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 8, "temperature": 0,
                                                    "ignore_eos": True, "logprobs": True, **pen}).json()
    assert [c["token_id"] for c in got["choices"][0]["logprobs"]["content"]] == want.token_ids


def _metric(client, name: str) -> float:
    line = [x for x in client.get("/metrics").text.splitlines() if x.startswith(name + "{")]
    return float(line[0].split()[-1])


def test_logit_bias_and_allowed_token_ids_in_every_api(client):
    """OpenAI's logit_bias (string keys) and vLLM's allowed_token_ids reach the engine."""
    body = {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0, "logprobs": 0, "logit_bias": {"11": 100}}
    assert client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["token_ids"] == [11] * 6
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "logprobs": True,
            "allowed_token_ids": [20, 21, 22]}
    got = client.post("/v1/chat/completions", json=chat).json()["choices"][0]["logprobs"]["content"]
    assert {t["token_id"] for t in got} <= {20, 21, 22}
    gen = client.post("/generate", json={"input_ids": [5, 6], "sampling_params": {
        "temperature": 0, "max_tokens": 4, "logit_bias": {"12": 100}}}).json()
    assert gen["token_ids"] == [12] * 4


def test_sglang_control_endpoints(model_dir):
    """SGLang's /abort_request: by rid, or every request in flight; each caller gets its tokens so
    far with finish reason "abort" (meta_info's type "abort"). Then /get_model_info, /flush_cache
    and /update_weights_from_disk."""
    long = {"sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
    with ServerProcess(model_dir, "--max-model-len", "4096") as s, httpx.Client(base_url=s.url, timeout=60) as c:
        def running(n):
            for _ in range(200):
                if _metric(c, "vllm:num_requests_running") >= n:
                    return
                time.sleep(0.02)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            one = pool.submit(httpx.post, s.url + "/generate", json=long | {"input_ids": [5, 6], "rid": "a-1"}, timeout=60)
            running(1)
            assert c.post("/abort_request", json={"rid": "a-1"}).json() == {"aborted": ["a-1"]}
            got = one.result().json()
            assert got["finish_reason"] == "abort" and got["meta_info"]["finish_reason"]["type"] == "abort"
            assert 0 < len(got["token_ids"]) < 4000 and got["output_ids"] == got["token_ids"]
            two = [pool.submit(httpx.post, s.url + "/generate", json=long | {"input_ids": [5, i]}, timeout=60)
                   for i in (7, 8)]
            running(2)
            assert len(c.post("/abort_request", json={"abort_all": True}).json()["aborted"]) == 2
            assert [f.result().json()["finish_reason"] for f in two] == ["abort", "abort"]
        assert c.post("/abort_request", json={"rid": "gone"}).json() == {"aborted": []}
        assert c.post("/abort_request", json={}).status_code == 400
        # pause and continue (around a weight update): in place, the request waits with its KV; by
        # default (SGLang's "abort") it ends with what it has, and new ones wait for continue
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            one = pool.submit(httpx.post, s.url + "/generate", json=long | {"input_ids": [5, 6], "rid": "p-1"}, timeout=60)
            running(1)
            assert c.post("/pause_generation", json={"mode": "in_place"}).json()["aborted"] == []
            before = _metric(c, "vllm:generation_tokens_total")
            time.sleep(0.3)
            assert _metric(c, "vllm:generation_tokens_total") == before and c.get("/health").json()["paused"]
            c.post("/continue_generation")
            for _ in range(100):
                if _metric(c, "vllm:generation_tokens_total") > before:
                    break
                time.sleep(0.02)
            assert _metric(c, "vllm:generation_tokens_total") > before
            assert c.post("/pause_generation").json()["aborted"] == ["p-1"]
            assert one.result().json()["finish_reason"] == "abort"
            late = pool.submit(httpx.post, s.url + "/generate", timeout=60,
                               json={"input_ids": [5, 9], "sampling_params": {"max_new_tokens": 3}})
            time.sleep(0.3)
            assert not late.done()
            c.post("/continue_generation")
            assert len(late.result().json()["token_ids"]) == 3 and not c.get("/health").json()["paused"]
        # SGLang's other control endpoints: model info, flushing the prefix cache, weights from disk
        assert c.get("/get_model_info").json()["is_generation"] is True
        again = {"input_ids": list(range(10, 60)), "sampling_params": {"max_new_tokens": 2}}
        c.post("/generate", json=again)
        assert c.post("/generate", json=again).json()["num_cached_tokens"] == 48
        assert c.post("/flush_cache").json()["evicted_blocks"] > 0
        assert c.post("/generate", json=again).json()["num_cached_tokens"] == 0
        got = c.post("/update_weights_from_disk", json={"model_path": model_dir, "load_format": "auto"}).json()
        assert got["success"] is True and got["weight_version"] == "1" and c.get("/health").json()["policy_version"] == 1
        bad = c.post("/update_weights_from_disk", json={"model_path": "/nonexistent"})
        assert bad.status_code == 400 and bad.json()["success"] is False
        _alive(c)


def test_a_client_that_disconnects_aborts_its_requests(model_dir):
    """A non-streaming request whose client goes away (an episode's deadline, a router's timeout)
    is aborted, all its samples, instead of generating to its end for nobody; the server keeps
    serving."""
    msgs = [{"role": "user", "content": "hi"}]
    cases = (("/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_tokens": 4000, "ignore_eos": True}}, 1),
             ("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 4000, "ignore_eos": True, "n": 2}, 2),
             ("/v1/chat/completions", {"messages": msgs, "max_tokens": 4000, "ignore_eos": True}, 1))
    with ServerProcess(model_dir, "--max-model-len", "4096") as s, httpx.Client(base_url=s.url, timeout=30) as c:
        for path, body, n in cases:
            before = _metric(c, "vllm:generation_tokens_total")
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(s.url + path, json=body, timeout=httpx.Timeout(10, read=0.3))
            for _ in range(100):
                if _metric(c, "vllm:num_requests_running") == 0:
                    break
                time.sleep(0.05)
            assert _metric(c, "vllm:num_requests_running") == 0, path
            # about 0.3 s of tokens each (the whole 4000 each if it ran on)
            assert 0 < _metric(c, "vllm:generation_tokens_total") - before < 2000 * n, path
        _alive(c)
        assert len(c.post("/generate", json={"input_ids": [5], "sampling_params": {"max_tokens": 3}}).json()["token_ids"]) == 3


def _prefill(client) -> float:
    return _metric(client, "rollwise:prefill_tokens_computed_total")


def test_a_failed_choice_aborts_its_siblings(client):
    """One prompt of a request is bad: HTTP 400, and the good one's generation is aborted rather
    than run to its end for nobody."""
    before = _metric(client, "vllm:generation_tokens_total")
    r = client.post("/v1/completions", json={"prompt": ["x", "x " * 700], "max_tokens": 400, "ignore_eos": True})
    assert r.status_code == 400
    for _ in range(200):
        if _metric(client, "vllm:num_requests_running") == 0:
            break
        time.sleep(0.05)
    assert _metric(client, "vllm:generation_tokens_total") - before < 400
    _alive(client)


def test_streams_end_with_usage_when_asked(client):
    """`stream_options: {"include_usage": true}`: a last chunk with no choices and the request's
    usage, the same as unstreamed (the prompt counted once for n samples); none without it."""
    for path, body in (("/v1/completions", {"prompt": [5, 6, 7, 8], "max_tokens": 5, "n": 2, "seed": 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                                                 "seed": 1})):
        whole = client.post(path, json=body).json()["usage"]
        with client.stream("POST", path, json=body | {"stream": True, "stream_options": {"include_usage": True}}) as r:
            chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole, path
        assert all(c["choices"] for c in chunks[:-1]) and all("usage" not in c for c in chunks[:-1])
        with client.stream("POST", path, json=body | {"stream": True}) as r:
            chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
        assert all(c["choices"] for c in chunks)


def test_return_token_ids(client, model_dir):
    """vLLM's `return_token_ids`: the prompt's and each choice's token ids, so an OpenAI-API agent
    keeps an exact token-in-token-out trajectory; streamed, the new ids per chunk and the prompt's first."""
    msgs = [{"role": "user", "content": "Find the agent"}]
    ids = LLM(model_dir).engine.tokenizer.encode_chat(msgs)
    chat = {"messages": msgs, "temperature": 0, "max_tokens": 8, "logprobs": True, "return_token_ids": True}
    got = client.post("/v1/chat/completions", json=chat).json()
    assert got["prompt_token_ids"] == ids
    assert got["choices"][0]["token_ids"] == [t["token_id"] for t in got["choices"][0]["logprobs"]["content"]]
    with client.stream("POST", "/v1/chat/completions", json=chat | {"stream": True}) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
    assert chunks[0]["prompt_token_ids"] == ids and all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == got["choices"][0]["token_ids"]
    cmpl = {"prompt": "The agent", "temperature": 0, "max_tokens": 6, "return_token_ids": True}
    whole = client.post("/v1/completions", json=cmpl).json()["choices"][0]
    assert whole["prompt_token_ids"] == LLM(model_dir).engine.tokenizer.encode("The agent") and len(whole["token_ids"]) == 6
    with client.stream("POST", "/v1/completions", json=cmpl | {"stream": True}) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == whole["token_ids"]
    plain = client.post("/v1/chat/completions", json=chat | {"return_token_ids": False}).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


def test_echo_and_prompt_logprobs(client, model_dir):
    """completions `echo` + `logprobs` (lm-eval's loglikelihood request): the prompt, then the
    completion, with the prompt tokens' logprobs first (the first None); /generate's
    `prompt_logprobs`. Both equal the engine's."""
    text = "The agent looked up the order"
    ids = LLM(model_dir).engine.tokenizer.encode(text)
    ref = LLM(model_dir).generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    body = {"prompt": text, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}
    ch = client.post("/v1/completions", json=body).json()["choices"][0]
    lp = ch["logprobs"]
    assert ch["text"].startswith(text) and len(ch["text"]) > len(text)
    assert lp["token_ids"] == ids + ref.token_ids and len(lp["tokens"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:len(ids)] == pytest.approx(ref.prompt_logprobs[1:], abs=1e-4)
    assert lp["token_logprobs"][-1] == pytest.approx(ref.logprobs[0], abs=1e-4)
    assert [len(t) for t in lp["top_logprobs"][1:]] == [1] * len(ids)
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
    plain = client.post("/v1/completions", json=body | {"logprobs": None, "prompt": ids}).json()["choices"][0]
    assert plain["logprobs"] is None and plain["text"].startswith(text)
    gen = client.post("/generate", json={"input_ids": ids, "sampling_params": {
        "temperature": 0, "max_tokens": 1, "prompt_logprobs": 2}}).json()
    assert gen["prompt_logprobs"][0] is None and gen["prompt_logprobs"][1:] == pytest.approx(ref.prompt_logprobs[1:], abs=1e-4)
    assert gen["prompt_top_logprobs"][0] is None and all(len(t) == 2 for t in gen["prompt_top_logprobs"][1:])
    assert client.post("/v1/completions", json=body | {"stream": True}).status_code == 400


def test_chat_tool_calls_are_parsed_from_the_reply():
    """With tools offered, a reply's Hermes <tool_call> blocks become OpenAI tool_calls (the unit;
    the test model does not write tool calls)."""
    from rollwise.serve.protocol import ChatCompletionRequest
    from rollwise.serve.responses import chat_choices
    from rollwise.types import RequestOutput
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]

    def choice(text, **body):
        req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **body})
        out = RequestOutput(request_id="r", prompt_token_ids=[1], text=text, finished=True, finish_reason="stop")
        return chat_choices(None, req, [out])[0]
    two = ('Let me check.\n<tool_call>{"name": "lookup", "arguments": {"name": "Ada"}}</tool_call>\n'
           '<tool_call>{"name": "lookup", "arguments": "{\\"name\\": \\"Bo\\"}"}</tool_call>')
    ch = choice(two, tools=tools)
    assert ch["finish_reason"] == "tool_calls" and ch["message"]["content"] == "Let me check."
    calls = ch["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["lookup"] * 2 and calls[0]["id"] != calls[1]["id"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"name": "Ada"}, {"name": "Bo"}]
    only = choice('<tool_call>{"name": "lookup", "arguments": {}}</tool_call>', tools=tools)
    assert only["message"]["content"] is None and len(only["message"]["tool_calls"]) == 1
    for text, body in ((two, {}), (two, {"tools": tools, "tool_choice": "none"}),
                       ('<tool_call>{"name": "lookup", "arguments": {</tool_call>', {"tools": tools})):
        ch = choice(text, **body)  # no tools offered, tools refused, or a malformed call: the text as it is
        assert ch["message"] == {"role": "assistant", "content": text} and ch["finish_reason"] == "stop"


def test_streamed_chat_sends_tool_calls_as_a_delta():
    """Streamed with tools: the content stops before the first <tool_call>, and the calls come in
    the last delta, as unstreamed; without tools, or with a malformed call, the text as it is.
    (A fake engine that streams a given reply a few characters at a time.)"""
    import asyncio
    from rollwise.serve.responses import stream_chat, tool_calls
    from rollwise.types import RequestOutput

    class Chars:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(map(chr, ids))

    class Engine:
        tokenizer = Chars()

        def __init__(self, text):
            self.text = text

        async def stream(self, prompt, params, rid, **options):
            ids = [ord(c) for c in self.text]
            for n in range(3, len(ids) + 3, 3):
                done = n >= len(ids)
                yield RequestOutput(request_id=rid, prompt_token_ids=prompt, token_ids=ids[:n], logprobs=[0.0] * len(ids[:n]),
                                    text=self.text if done else "", finished=done, finish_reason="stop" if done else None)

    def run(text, tools):
        async def go():
            return [c["choices"][0] async for c in stream_chat(Engine(text), [1], SamplingParams(), "r", 0, "m", False,
                                                                None, tools)]
        return asyncio.run(go())
    reply = ('Let me check.\n<tool_call>{"name": "lookup", "arguments": {"name": "Ada"}}</tool_call>\n'
             '<tool_call>{"name": "lookup", "arguments": {"name": "Bo"}}</tool_call>')
    chunks = run(reply, True)
    content = "".join(c["delta"].get("content") or "" for c in chunks)
    assert content == "Let me check.\n" and chunks[-1]["finish_reason"] == "tool_calls"
    calls = chunks[-1]["delta"]["tool_calls"]
    assert [(c["index"], c["function"]) for c in calls] == [(i, c["function"]) for i, c in enumerate(tool_calls(reply)[1])]
    assert chunks[0]["delta"]["role"] == "assistant" and all("tool_calls" not in c["delta"] for c in chunks[:-1])
    broken = 'Hi <tool_call>{"name": "lookup", "arguments": {</tool_call>'
    for text, tools in ((reply, False), (broken, True)):
        chunks = run(text, tools)
        assert "".join(c["delta"]["content"] for c in chunks) == text and chunks[-1]["finish_reason"] == "stop"


def test_chat_takes_back_its_tool_calls_and_tool_results(client):
    """The OpenAI round trip: the assistant's tool_calls (arguments as a JSON string) and the tool's
    result go back in the next request, rendered by the chat template."""
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "Find Ada"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "lookup", "arguments": "{\"name\": \"Ada\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Ada: room 12"}]
    r = client.post("/v1/chat/completions", json={"messages": msgs, "tools": tools, "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > client.post("/v1/chat/completions", json={
        "messages": msgs[:1], "tools": tools, "max_tokens": 4}).json()["usage"]["prompt_tokens"] + 10


def test_streamed_text_never_passes_a_stop_string(client):
    """A stop string that spans tokens: the streamed text holds back what may begin it, so the
    pieces add up to the unstreamed (cut) text, in chat and completions."""
    msgs = [{"role": "user", "content": "Find the agent"}]
    reply = client.post("/v1/chat/completions", json={"messages": msgs, "temperature": 0, "max_tokens": 16}).json()
    text = reply["choices"][0]["message"]["content"]
    for stop in (text[3:5], text[6:9], "never there"):
        chat = {"messages": msgs, "temperature": 0, "max_tokens": 16, "stop": [stop]}
        whole = client.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]
        with client.stream("POST", "/v1/chat/completions", json=chat | {"stream": True}) as r:
            chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == whole, stop
        assert (stop in text) == (whole != text)
        cmpl = {"prompt": [5, 6, 7], "temperature": 0, "max_tokens": 16, "stop": [stop]}
        whole = client.post("/v1/completions", json=cmpl).json()["choices"][0]["text"]
        with client.stream("POST", "/v1/completions", json=cmpl | {"stream": True}) as r:
            chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
        assert "".join(c["choices"][0]["text"] for c in chunks) == whole, stop


def test_n_samples_per_prompt(client):
    """OpenAI's n: choice i * n + j is prompt i's sample j, seeded seed + j (the same tokens as a
    request of its own with that seed); each prompt is computed once and counted once in usage."""
    prompt = [11 + i for i in range(70)]  # 4 full blocks of 16 + 6
    body = {"prompt": prompt, "max_tokens": 5, "temperature": 1.0, "seed": 40, "ignore_eos": True, "logprobs": 0}
    before = _prefill(client)
    r = client.post("/v1/completions", json=body | {"n": 4})
    assert r.status_code == 200, r.text
    out = r.json()
    assert _prefill(client) - before == 70 + 3 * 6  # the siblings waited for the first one's blocks
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert out["usage"]["prompt_tokens"] == 70 and out["usage"]["completion_tokens"] == 20
    got = [c["logprobs"]["token_ids"] for c in out["choices"]]
    for j in range(4):
        alone = client.post("/v1/completions", json=body | {"seed": 40 + j}).json()
        assert alone["choices"][0]["logprobs"]["token_ids"] == got[j]
    assert len({tuple(g) for g in got}) > 1  # not one sample four times
    two = client.post("/v1/completions", json={"prompt": ["a b", "c"], "n": 2, "max_tokens": 2}).json()
    assert [c["index"] for c in two["choices"]] == [0, 1, 2, 3]
    with client.stream("POST", "/v1/completions", json=body | {"n": 3, "stream": True}) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
    by_index: dict = {}
    for c in chunks:
        ch = c["choices"][0]
        by_index.setdefault(ch["index"], []).extend(ch["logprobs"]["token_ids"])
    assert by_index == {0: got[0], 1: got[1], 2: got[2]}
    msgs = [{"role": "user", "content": "hi"}]
    chat = client.post("/v1/chat/completions", json={"messages": msgs, "n": 2, "max_tokens": 4, "seed": 8}).json()
    assert [c["index"] for c in chat["choices"]] == [0, 1]
    second = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4, "seed": 9}).json()
    assert chat["choices"][1]["message"] == second["choices"][0]["message"]
    with client.stream("POST", "/v1/chat/completions", json={"messages": msgs, "n": 2, "max_tokens": 4,
                                                             "seed": 8, "stream": True}) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
    text: dict = {}
    for c in chunks:
        ch = c["choices"][0]
        text[ch["index"]] = text.get(ch["index"], "") + ch["delta"]["content"]
    assert text == {k: c["message"]["content"] for k, c in enumerate(chat["choices"])}
    _alive(client)


def test_models_and_metrics(client):
    assert client.get("/v1/models").json()["data"][0]["max_model_len"] == 512
    text = client.get("/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:generation_tokens_total"):
        assert name in text
    gen = [line for line in text.splitlines() if line.startswith("vllm:generation_tokens_total")]
    assert float(gen[0].split()[-1]) > 0


@pytest.mark.parametrize("path,body", [
    ("/generate", {"input_ids": "abc"}),  # wrong type
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_tokens": -3}}),  # negative max_tokens
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"bogus": 1}}),  # unknown sampling field
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_tokens": 3, "max_new_tokens": 4}}),  # disagree
    ("/generate", {"input_ids": [1, 2], "colour": "red"}),  # unknown field
    ("/generate", {"input_ids": [1] * 600}),  # oversized prompt (max_model_len 512)
    ("/generate", {"input_ids": [10**9]}),  # token id out of vocabulary
    ("/generate", {"input_ids": []}),
    ("/generate", {"input_ids": [1, 2], "policy_version": 99}),  # weights this server does not hold
    ("/generate", {"input_ids": [1, 2], "policy_version": 99, "stream": True}),
    ("/generate", {}),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4, "temperature": -2}),
    ("/v1/completions", {"prompt": "x", "n": 0}),
    ("/v1/completions", {"prompt": "x", "n": 129}),  # more than MAX_N samples in one request
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2.5}),
    ("/v1/completions", {"prompt": "x", "top_p": 0}),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}),  # more top logprobs than MAX_LOGPROBS
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}),  # logprobs off
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"logprobs": -1}}),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"repetition_penalty": 0}}),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 200}}),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"999999": 1}}),  # out of vocabulary
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "allowed_token_ids": []}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "frequency_penalty": -3}),
    ("/v1/completions", {"prompt": "x " * 700}),
    ("/v1/completions", {"prompt": "x", "stream": True, "max_tokens": 0}),
    ("/v1/completions", {"prompt": "x", "unknown_field": True}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}),
    ("/v1/chat/completions", {"messages": "hello"}),
    ("/update_weights", {"model_dir": "/nonexistent"}),
])
def test_bad_input_gets_400_and_server_keeps_serving(client, path, body):
    r = client.post(path, json=body)
    assert r.status_code == 400, (r.status_code, r.text)
    assert "message" in r.json()["error"]
    _alive(client)


@pytest.mark.parametrize("content,ctype,query", [
    (b"not safetensors", "application/octet-stream", ""),
    (b"", "application/octet-stream", ""),
    ("norm", "application/octet-stream", ""),  # a valid file with a misshapen weight
    ("norm", "application/octet-stream", "?policy_version=abc"),
    ("norm", "application/octet-stream", "?partial_rollout=maybe"),
    ("norm", "application/octet-stream", "?version=3"),
    (b"model_dir=/x", "text/plain", ""),
])
def test_bad_streamed_weights_get_400(client, content, ctype, query):
    if content == "norm":
        import torch
        from safetensors.torch import save
        content = save({"model.norm.weight": torch.ones(3)})
    r = client.post("/update_weights" + query, content=content, headers={"content-type": ctype})
    assert r.status_code == 400, (r.status_code, r.text)
    assert "message" in r.json()["error"]
    assert client.get("/health").json()["policy_version"] == 0  # nothing changed
    _alive(client)


def test_unheld_weights_get_a_typed_400(client):
    r = client.post("/generate", json={"input_ids": [1, 2], "policy_version": 99})
    assert r.status_code == 400 and r.json()["error"]["type"] == "weights_not_held"
    _alive(client)


def test_malformed_json_is_400(client):
    r = client.post("/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    _alive(client)


def test_concurrent_requests(client, server):
    import asyncio

    async def go():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            rs = await asyncio.gather(*(c.post("/generate", json={"input_ids": [i + 1, 7, 8], "sampling_params": {
                "temperature": 0, "max_tokens": 5, "ignore_eos": True}}) for i in range(24)))
        return [r.json()["token_ids"] for r in rs]
    outs = asyncio.run(go())
    assert all(len(o) == 5 for o in outs)
    assert outs[3] == client.post("/generate", json={"input_ids": [4, 7, 8], "sampling_params": {
        "temperature": 0, "max_tokens": 5, "ignore_eos": True}}).json()["token_ids"]


def test_api_key_and_update_weights(model_dir):
    import asyncio

    import torch

    from rollwise.engine.models.loader import load_model
    from rollwise.router.replica import HttpReplica
    model = load_model(model_dir)
    with torch.no_grad():
        model.model.norm.weight.mul_(-1)
    flipped = {k: v.detach().clone() for k, v in model.hf_tensors().items()}
    with ServerProcess(model_dir, "--api-key", "sekret") as s:
        assert httpx.post(s.url + "/generate", json={"input_ids": [1]}).status_code == 401
        assert httpx.get(s.url + "/health").status_code == 200
        h = {"Authorization": "Bearer sekret"}
        req = {"input_ids": [3, 4, 5], "sampling_params": {"temperature": 0, "max_tokens": 6, "ignore_eos": True}}
        before = httpx.post(s.url + "/generate", json=req, headers=h).json()
        # the tensors streamed in the request body (no shared file system needed)
        assert asyncio.run(HttpReplica(s.url, api_key="sekret", weights_via="stream").update_weights(flipped, 1)) == 1
        after = httpx.post(s.url + "/generate", json=req, headers=h).json()
        assert after["policy_version"] == 1 and after["token_ids"] != before["token_ids"]
        # partial rollout: a request in flight continues under the new weights, its tokens labelled
        long = {"input_ids": [3, 4, 5], "sampling_params": {"temperature": 0, "max_tokens": 400, "ignore_eos": True}}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(lambda: httpx.post(s.url + "/generate", json=long, headers=h, timeout=60).json())
            base = _generated(s.url, h)
            while _generated(s.url, h) == base:
                time.sleep(0.005)
            r = httpx.post(s.url + "/update_weights", json={"model_dir": model_dir, "policy_version": 7,
                                                            "partial_rollout": True}, headers=h)
            assert r.status_code == 200 and r.json()["policy_version"] == 7
            out = fut.result()
        (first, v1), (at, v2) = out["version_segments"]
        assert (first, v1, v2) == (0, 1, 7) and 0 < at < 400 and out["policy_version"] == 1
        # tensors through a temporary directory (a shared file system), back to the flipped weights
        assert asyncio.run(HttpReplica(s.url, api_key="sekret", weights_via="file").update_weights(flipped, 8)) == 8
        assert httpx.post(s.url + "/generate", json=req, headers=h).json()["token_ids"] == after["token_ids"]
    with pytest.raises(ValueError, match="weights_via must be one of"):
        HttpReplica("http://127.0.0.1:1", weights_via="nfs")
    assert HttpReplica("http://127.0.0.1:1").weights_via == "file"
    assert HttpReplica("http://10.1.2.3:8000").weights_via == "stream"


def _generated(url: str, headers: dict) -> float:
    text = httpx.get(url + "/metrics", headers=headers).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:generation_tokens_total"))


def test_weight_updates_off_loopback_need_an_api_key(model_dir):
    """A server bound off loopback without --api-key refuses /update_weights (in-process app)."""
    from fastapi.testclient import TestClient

    from rollwise.config import ServerConfig
    from rollwise.engine.async_engine import AsyncEngine
    from rollwise.serve.server import build_app
    engine = AsyncEngine(model_dir)
    try:
        open_app = TestClient(build_app(engine, ServerConfig(host="0.0.0.0"), "m"))
        r = open_app.post("/update_weights", json={"model_dir": model_dir})
        assert r.status_code == 403 and "api-key" in r.json()["error"]["message"]
        keyed = TestClient(build_app(engine, ServerConfig(host="0.0.0.0", api_key="k"), "m"))
        r = keyed.post("/update_weights", json={"model_dir": model_dir}, headers={"Authorization": "Bearer k"})
        assert r.status_code == 200 and r.json()["policy_version"] == 1
    finally:
        engine.shutdown()


def test_speculative_server_is_lossless_and_reports_acceptance(model_dir):
    ids = [9, 8, 7, 6, 5, 4, 3]
    req = {"input_ids": ids, "group_id": "g1", "sampling_params": {"temperature": 0, "max_tokens": 30, "ignore_eos": True}}
    ref = LLM(model_dir).generate([ids], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    with ServerProcess(model_dir, "--speculative", "suffix", "--spec-controller", "always") as s:
        outs = [httpx.post(s.url + "/generate", json=req, timeout=60).json() for _ in range(3)]
        assert all(o["token_ids"] == ref.token_ids for o in outs)
        metrics = httpx.get(s.url + "/metrics").text
    accepted = [line for line in metrics.splitlines() if line.startswith("vllm:spec_decode_num_accepted_tokens_total")]
    assert float(accepted[0].split()[-1]) > 0  # siblings 2 and 3 drafted from sibling 1


def test_safetensors_stream_is_a_safetensors_file():
    import asyncio

    import torch
    from safetensors.torch import load

    from rollwise.router.replica import safetensors_stream
    tensors = {"b.w": torch.randn(3, 5), "a.h": torch.randn(7).to(torch.bfloat16), "c.i": torch.arange(6).view(2, 3),
               "d.t": torch.randn(4, 4).t(), "e.big": torch.randn(300_000)}  # non-contiguous; > 1 MiB

    async def collect():
        size, body = safetensors_stream(tensors)
        return size, b"".join([p async for p in body])
    size, data = asyncio.run(collect())
    back = load(data)
    assert size == len(data) and set(back) == set(tensors)
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t)
