"""What clients of other servers send and read, over real HTTP (a `rollwise serve` subprocess):
vLLM's sampling options and token ids, OpenAI's echo, usage chunks and tool calls, SGLang's
/generate names and control endpoints."""
from __future__ import annotations

import concurrent.futures
import json
import threading
import time

import httpx
import pytest

from rollwise import LLM, SamplingParams
from rollwise.serve.process import ServerProcess


def _alive(client):
    assert client.get("/health").json()["status"] == "ok"


def _metric(client, name: str) -> float:
    line = [x for x in client.get("/metrics").text.splitlines() if x.startswith(name + "{")]
    return float(line[0].split()[-1])


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
    assert [x for x, _, _ in meta["input_token_logprobs"]] == pytest.approx(ref.prompt_token_logprobs[1:], abs=1e-4)
    assert len(meta["input_top_logprobs"]) == 4
    plain = client.post("/generate", json={"text": "The agent", "sampling_params": {"max_new_tokens": 3}}).json()
    assert len(plain["output_ids"]) == 3 and "output_token_logprobs" not in plain["meta_info"]
    bad = client.post("/generate", json={"input_ids": ids, "sampling_params": {"min_new_tokens": 2, "min_tokens": 3}})
    assert bad.status_code == 400


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
    # vLLM's bad_words: token 11's text as a bad word bans it, however likely
    piece = client.post("/detokenize", json={"tokens": [11]}).json()["prompt"]
    got = client.post("/v1/completions", json={**body, "bad_words": [piece]}).json()["choices"][0]["logprobs"]
    assert len(got["token_ids"]) == 6 and 11 not in got["token_ids"]


def test_a_vllm_launch_line_serves_as_written(model_dir):
    """`rollwise serve` takes `vllm serve`'s flags where they agree with this engine: the served name,
    dtype auto, the no-op flags; a flag asking what this engine does not do exits 2 with why."""
    import subprocess
    import sys
    line = ("--dtype", "auto", "--gpu-memory-utilization", "0.9", "--enforce-eager", "--trust-remote-code",
            "--tensor-parallel-size", "1", "--served-model-name", "my-policy", "--enable-auto-tool-choice",
            "--tool-call-parser", "hermes", "--disable-log-requests", "--max-model-len", "512")
    with ServerProcess(model_dir, *line) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["my-policy"]
        assert c.get("/get_server_info").json()["dtype"] == "float32"  # the checkpoint's
        r = c.post("/v1/chat/completions", json={"model": "my-policy", "messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 3})
        assert r.status_code == 200 and r.json()["model"] == "my-policy"
    for bad, why in ((("--tensor-parallel-size", "2"), "tensor_parallel_size must be one of [1]"),
                     (("--dtype", "auto", "--trust-remote-code", "--enforce-eager", "--pipeline-parallel-size", "4"),
                      "pipeline_parallel_size must be one of [1]"),
                     (("--served-model-name", "a", "b"), "one name")):
        got = subprocess.run([sys.executable, "-m", "rollwise.cli", "serve", model_dir, *bad], capture_output=True,
                             text=True, timeout=120)
        assert got.returncode == 2 and why in got.stderr, (bad, got.stderr[-500:])


def test_an_sglang_launch_line_serves_as_written(model_dir, tmp_path):
    """`rollwise serve` takes `python -m sglang.launch_server`'s flags where they agree with this engine:
    the model by --model-path, SGLang's names for our settings (they reach the engine), its parser names,
    the no-op flags; one asking what this engine does not do, or disagreeing with ours, exits 2 with why."""
    import subprocess
    import sys
    line = ("--model-path", model_dir, "--tp-size", "1", "--mem-fraction-static", "0.8", "--random-seed", "7",
            "--context-length", "512", "--max-running-requests", "5", "--chunked-prefill-size", "256",
            "--disable-radix-cache", "--enable-memory-saver", "--log-level", "warning", "--attention-backend", "fa3",
            "--trust-remote-code", "--tool-call-parser", "qwen25", "--served-model-name", "policy")
    with ServerProcess(None, *line) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        info = c.get("/get_server_info").json()
        assert (info["seed"], info["max_model_len"], info["max_num_seqs"], info["max_num_batched_tokens"]) == \
            (7, 512, 5, 256)
        assert info["enable_prefix_caching"] is False
        got = c.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3}}).json()
        assert len(got["output_ids"]) == 3 and [m["id"] for m in c.get("/v1/models").json()["data"]] == ["policy"]
    for bad, why in ((("--model-path", model_dir, "--tp-size", "2"), "tp_size must be one of [1]"),
                     ((model_dir, "--model-path", str(tmp_path)), "give the model once"),
                     ((model_dir, "--seed", "3", "--random-seed", "4"), "--seed and its SGLang name disagree"),
                     (("--load-format", "dummy"), "give the model directory"),
                     ((model_dir, "--load-format", "gguf"), "invalid choice: 'gguf'")):
        got = subprocess.run([sys.executable, "-m", "rollwise.cli", "serve", *bad], capture_output=True, text=True,
                             timeout=120)
        assert got.returncode == 2 and why in got.stderr, (bad, got.stderr[-500:])


def test_sglang_control_endpoints(model_dir):
    """SGLang's /abort_request: by rid, or every request in flight; each caller gets its tokens so
    far with finish reason "abort" (meta_info's type "abort"). Then /get_model_info, /get_server_info,
    /health_generate, /flush_cache (and vLLM's /reset_prefix_cache) and /update_weights_from_disk."""
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
            assert c.get("/health_generate").json() == {"status": "ok", "generated": False, "paused": True,
                                                        "sleeping": [], "weights_missing": 0}  # held: healthy
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
        info = c.get("/get_server_info").json()
        assert info["model"] == model_dir and info["max_model_len"] == 4096 and info["weight_version"] == "0"
        assert info["internal_states"][0]["prefill_tokens"] > 0 and info["internal_states"][0]["paused"] is False
        before = _metric(c, "vllm:generation_tokens_total")
        assert c.post("/health_generate").json() == {"status": "ok", "generated": True}
        assert _metric(c, "vllm:generation_tokens_total") == before + 1
        again = {"input_ids": list(range(10, 60)), "sampling_params": {"max_new_tokens": 2}}
        c.post("/generate", json=again)
        assert c.post("/generate", json=again).json()["num_cached_tokens"] == 48
        assert c.post("/flush_cache").json()["evicted_blocks"] > 0
        assert c.post("/generate", json=again).json()["num_cached_tokens"] == 0
        assert c.post("/generate", json=again).json()["num_cached_tokens"] == 48
        r = c.post("/reset_prefix_cache")  # vLLM's name for it
        assert r.status_code == 200 and not r.content
        assert c.post("/generate", json=again).json()["num_cached_tokens"] == 0
        got = c.post("/update_weights_from_disk", json={"model_path": model_dir, "load_format": "auto"}).json()
        assert got["success"] is True and got["weight_version"] == "1" and c.get("/health").json()["policy_version"] == 1
        bad = c.post("/update_weights_from_disk", json={"model_path": "/nonexistent"})
        assert bad.status_code == 400 and bad.json()["success"] is False
        # retract (slime's mode around an update): the KV in flight is given back while paused, and the
        # update moves the request onto the new weights from its tokens so far
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            one = pool.submit(httpx.post, s.url + "/generate", timeout=60, json={
                "input_ids": [5, 6], "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}})
            running(1)
            assert c.post("/pause_generation", json={"mode": "retract"}).json()["aborted"] == []
            assert _metric(c, "vllm:kv_cache_usage_perc") == 0 and _metric(c, "vllm:num_requests_running") == 0
            got = c.post("/update_weights_from_disk", json={"model_path": model_dir}).json()
            c.post("/continue_generation")
            out = one.result().json()
        assert got["weight_version"] == "2" and len(out["token_ids"]) == 300
        assert [v for _, v in out["version_segments"]] == [1, 2] and 0 < out["version_segments"][1][0] < 300
        _alive(c)


def test_vllm_pause_resume_around_a_weight_update(model_dir):
    """vLLM's RLHF endpoints: /pause?mode=keep freezes the requests in flight (no token while paused,
    all of them after /resume); mode=abort (the default) ends them now with what they have; mode=wait
    returns once they have finished, and one that comes meanwhile waits for /resume; /is_paused says
    which; an abort or a wait clears the prefix cache unless clear_cache=false."""
    long = {"input_ids": [5, 6, 7], "sampling_params": {"max_tokens": 300, "ignore_eos": True}}
    with ServerProcess(model_dir, "--max-model-len", "1024") as s, httpx.Client(base_url=s.url, timeout=60) as c, \
            concurrent.futures.ThreadPoolExecutor(2) as pool:
        def start(body):
            call = pool.submit(httpx.post, s.url + "/generate", json=body, timeout=60)
            for _ in range(500):
                if _metric(c, "vllm:num_requests_running") >= 1:
                    return call
                time.sleep(0.01)
            raise AssertionError("never ran")
        call = start(long)
        assert c.post("/pause", params={"mode": "keep"}).json() == {"status": "paused"}
        assert c.get("/is_paused").json() == {"is_paused": True}
        made = _metric(c, "vllm:generation_tokens_total")
        time.sleep(0.3)
        assert _metric(c, "vllm:generation_tokens_total") == made and not call.done()
        assert c.post("/resume").json() == {"status": "resumed"} and c.get("/is_paused").json()["is_paused"] is False
        got = call.result().json()
        assert got["finish_reason"] == "length" and len(got["token_ids"]) == 300

        cached = {"input_ids": list(range(100, 150)), "sampling_params": {"max_tokens": 1}}
        c.post("/generate", json=cached)
        call = start(long)
        assert c.post("/pause").json() == {"status": "paused"}  # abort, clearing the cache
        got = call.result().json()
        assert got["finish_reason"] == "abort" and 0 < len(got["token_ids"]) < 300
        later = pool.submit(httpx.post, s.url + "/generate", json=cached, timeout=60)
        time.sleep(0.2)
        assert not later.done()  # paused: it waits
        c.post("/resume")
        assert later.result().json()["num_cached_tokens"] == 0  # the cache was cleared

        c.post("/generate", json=cached)
        call = start({"input_ids": [5, 6, 7], "sampling_params": {"max_tokens": 200, "ignore_eos": True}})
        drain = pool.submit(httpx.post, s.url + "/pause", params={"mode": "wait", "clear_cache": "false"}, timeout=60)
        while not c.get("/is_paused").json()["is_paused"]:  # (from the drain on)
            time.sleep(0.005)
        late = threading.Thread(target=lambda: got_late.append(httpx.post(s.url + "/generate", json=cached | {
            "sampling_params": {"max_tokens": 5, "ignore_eos": True}}, timeout=60).json()))
        got_late: list = []
        late.start()
        assert drain.result().json() == {"status": "paused"}
        assert _metric(c, "vllm:num_requests_running") == 0  # it finished before the reply (not frozen)
        got = call.result(timeout=30).json()  # (its own reply may come a moment after the pause's)
        assert got["finish_reason"] == "length" and len(got["token_ids"]) == 200
        time.sleep(0.1)
        assert not got_late  # it came during the drain: held back, and still held while paused
        c.post("/resume")
        late.join(30)
        assert len(got_late[0]["token_ids"]) == 5
        assert c.post("/generate", json=cached).json()["num_cached_tokens"] == 48  # kept
        assert c.post("/pause", params={"mode": "later"}).status_code == 400
        assert c.get("/is_paused").json()["is_paused"] is False
        _alive(c)


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
    assert lp["token_logprobs"][1:len(ids)] == pytest.approx(ref.prompt_token_logprobs[1:], abs=1e-4)
    assert lp["token_logprobs"][-1] == pytest.approx(ref.logprobs[0], abs=1e-4)
    assert [len(t) for t in lp["top_logprobs"][1:]] == [1] * len(ids)
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
    plain = client.post("/v1/completions", json=body | {"logprobs": None, "prompt": ids}).json()["choices"][0]
    assert plain["logprobs"] is None and plain["text"].startswith(text)
    gen = client.post("/generate", json={"input_ids": ids, "sampling_params": {
        "temperature": 0, "max_tokens": 1, "prompt_logprobs": 2}}).json()
    assert gen["prompt_logprobs"][0] is None
    assert gen["prompt_logprobs"][1:] == pytest.approx(ref.prompt_token_logprobs[1:], abs=1e-4)
    assert gen["prompt_top_logprobs"][0] is None and all(len(t) == 2 for t in gen["prompt_top_logprobs"][1:])
    assert client.post("/v1/completions", json=body | {"stream": True}).status_code == 400
    # max_tokens 0 with echo: the prompt alone, scored (vLLM's; a token generated and left out, as there)
    alone = client.post("/v1/completions", json=body | {"max_tokens": 0, "return_token_ids": True}).json()["choices"][0]
    assert alone["text"] == text and alone["logprobs"]["token_ids"] == ids
    assert {k: v[:len(ids)] for k, v in lp.items() if k != "text_offset"} == \
        {k: v for k, v in alone["logprobs"].items() if k != "text_offset"}
    assert alone["finish_reason"] == "length" and alone["prompt_token_ids"] == ids and len(alone["token_ids"]) == 1
    r = client.post("/v1/completions", json=body | {"max_tokens": 0, "echo": False})  # (nothing to reply: vLLM's 400)
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    unset = {"prompt": ids, "temperature": 0, "ignore_eos": True}  # max_tokens null: as not given (16), as vLLM's
    assert [client.post("/v1/completions", json=b).json()["usage"]["completion_tokens"]
            for b in (unset, unset | {"max_tokens": None})] == [16, 16]


def test_an_empty_stop_string_is_refused_as_vllm_refuses_it(client):
    """`stop: ""` is a 400 on both endpoints, as vLLM's ("stop cannot contain an empty string"); it was
    taken as no stop string at all. No stop (absent, null or []) still replies."""
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        for stop in ("", [""], ["a", ""]):
            r = client.post(path, json=body | {"max_tokens": 2, "stop": stop})
            assert r.status_code == 400 and "non-empty strings" in r.json()["error"]["message"], (path, stop)
        for stop in (None, []):
            assert client.post(path, json=body | {"max_tokens": 2, "stop": stop}).status_code == 200, (path, stop)


def test_chat_max_tokens_0_is_refused_as_vllm_refuses_it(client):
    """max_tokens (or max_completion_tokens) 0 asks for an empty reply: a 400, as vLLM's (it was taken
    as not given: a reply to the end of the context); not given at all: a reply."""
    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    for key in ("max_tokens", "max_completion_tokens"):
        r = client.post("/v1/chat/completions", json=body | {key: 0})
        assert r.status_code == 400 and "max_tokens must be >= 1, got 0" in r.json()["error"]["message"], key
    assert client.post("/v1/chat/completions", json=body | {"max_completion_tokens": 2, "max_tokens": 0}).json()[
        "usage"]["completion_tokens"] <= 2  # (the newer name first, as vLLM)


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


def test_a_parsed_reply_sent_back_renders_as_the_text_the_model_wrote(model_dir):
    """An agent on the chat API appends the reply (tool calls with JSON-string arguments, OpenAI's
    form) and sends it back: the chat template renders it to the very text generated, so a
    served model sees its own tokens, not arguments encoded twice."""
    from rollwise.agent.parsing import openai_tool_calls
    from rollwise.engine.tokenizer import Tokenizer
    tok = Tokenizer(model_dir)
    call = lambda name, args: f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'  # noqa: E731
    for text in (call("lookup", {"name": "Ana Berg"}), "Let me check.\n" + call("lookup", {"name": "Bo"}),
                 call("lookup", {"name": "Ada"}) + "\n" + call("finish", {"answer": "5", "n": [1, 2]})):
        content, calls = openai_tool_calls(text)
        reply = {"role": "assistant", "content": content or None, "tool_calls": calls}
        user = [{"role": "user", "content": "q"}]
        rendered = tok.apply_chat_template(user + [reply], add_generation_prompt=False)
        assert rendered == tok.apply_chat_template(user, add_generation_prompt=True) + text + "<|im_end|>\n"


def test_streamed_chat_sends_tool_calls_as_a_delta():
    """Streamed with tools: the content stops before the first <tool_call>, and the calls come in
    the last delta, as unstreamed; without tools, or with a malformed call, the text as it is.
    (A fake engine that streams a given reply a few characters at a time.)"""
    import asyncio
    from rollwise.agent.parsing import HermesParser
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
                                                                None, HermesParser() if tools else None)]
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


def test_sglangs_openai_fields_as_sglang_router_sends_them(client):
    # sglang-router (smg) adds no_stop_trim and return_hidden_states to every completion it passes on,
    # and separate_reasoning and stream_reasoning to every chat, at SGLang's defaults: taken
    msgs = [{"role": "user", "content": "Find the agent"}]
    sgl = {"no_stop_trim": False, "return_hidden_states": False}
    chat = {"messages": msgs, "temperature": 0, "max_tokens": 16}
    plain = client.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]
    r = client.post("/v1/chat/completions", json=chat | sgl | {"separate_reasoning": True, "stream_reasoning": True})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == plain
    cmpl = {"prompt": [5, 6, 7], "temperature": 0, "max_tokens": 16}
    text = client.post("/v1/completions", json=cmpl | sgl).json()["choices"][0]["text"]
    stop = text[6:9]  # no_stop_trim: the stop string stays in the text, as include_stop_str_in_output keeps it
    cut = client.post("/v1/completions", json=cmpl | {"stop": [stop]}).json()["choices"][0]["text"]
    kept = client.post("/v1/completions", json=cmpl | {"stop": [stop], "no_stop_trim": True}).json()["choices"][0]
    assert kept["text"] == cut + stop and text.startswith(kept["text"])
    for path, body in (("/v1/completions", cmpl), ("/v1/chat/completions", chat)):  # hidden states: a clear 400
        r = client.post(path, json=body | {"return_hidden_states": True})
        assert r.status_code == 400 and "no hidden states" in r.json()["error"]["message"], path
    _alive(client)


def test_streamed_text_is_decoded_a_step_at_a_time_and_adds_up(client, model_dir):
    """The stream decodes each step's new tokens only (`Tokenizer.decoder`): the same text as the
    whole output decoded at once, a character split across tokens shown once whole, special tokens
    kept or skipped; over HTTP the pieces add up to the unstreamed text."""
    import random

    from rollwise.engine.tokenizer import Tokenizer
    tok, rng = Tokenizer(model_dir), random.Random(1)
    split = tok.encode("naïve café ☕ 日本", add_special_tokens=False)
    for trial in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))] + split * (trial % 2)
        for skip in (True, False):
            grow, text = tok.decoder(skip), ""
            for i in range(0, len(ids), 3):
                text += grow(ids[i:i + 3])
                assert "\ufffd" not in text[-1:] or "\ufffd" in tok.decode(ids[:i + 3], skip)
            assert text == tok.decode(ids, skip).rstrip("\ufffd") or text == tok.decode(ids, skip), (ids, skip)
    assert tok.decoder()(split) == "naïve café ☕ 日本"
    wholes = []
    for extra in ({}, {"skip_special_tokens": False}, {"skip_special_tokens": False,
                                                       "spaces_between_special_tokens": False}):
        cmpl = {"prompt": [5, 6, 7], "temperature": 1.0, "seed": 4, "max_tokens": 48} | extra
        wholes.append(client.post("/v1/completions", json=cmpl).json()["choices"][0]["text"])
        with client.stream("POST", "/v1/completions", json=cmpl | {"stream": True}) as r:
            chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
        assert "".join(c["choices"][0]["text"] for c in chunks) == wholes[-1] and len(chunks) > 10, extra
    assert wholes[2] == wholes[1]  # vLLM's fast detokenizer leaves spaces_between_special_tokens be, as this one
    bad = {"prompt": [5], "max_tokens": 2, "spaces_between_special_tokens": "no"}
    assert client.post("/v1/completions", json=bad).status_code == 400


def test_tokenize_gives_the_ids_chat_generates_from_and_detokenize_reads_them_back(client, model_dir):
    """vLLM's /tokenize: a chat rendered exactly as /v1/chat/completions renders it (tools too), a
    prompt as the tokenizer encodes it; /detokenize back; /version; bad input a 400."""
    from rollwise.engine.tokenizer import Tokenizer
    tok = Tokenizer(model_dir)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 3?"}]
    chat = client.post("/v1/chat/completions", json={"messages": msgs, "tools": tools, "max_tokens": 2,
                                                      "return_token_ids": True}).json()
    got = client.post("/tokenize", json={"messages": msgs, "tools": tools}).json()
    assert got["tokens"] == chat["prompt_token_ids"] and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == 512
    plain = client.post("/tokenize", json={"prompt": "naïve café", "return_token_strs": True}).json()
    assert plain["tokens"] == tok.encode("naïve café") and len(plain["token_strs"]) == plain["count"]
    back = client.post("/detokenize", json={"tokens": got["tokens"]}).json()["prompt"]
    assert back == tok.decode(got["tokens"], skip_special_tokens=False) and "2 + 3?" in back
    assert client.get("/version").json()["version"]
    for body, why in (({"prompt": "x", "messages": msgs}, "one of them"), ({}, "one of them"),
                      ({"prompt": "x", "bogus": 1}, "bogus")):
        r = client.post("/tokenize", json=body)
        assert r.status_code == 400 and why in r.json()["error"]["message"], body
    r = client.post("/detokenize", json={"tokens": [1, 10**7]})
    assert r.status_code == 400 and "not in the vocabulary" in r.json()["error"]["message"]


def test_openai_sdk_fields_are_taken_and_parallel_tool_calls_false_keeps_the_first_call(client):
    """What the openai SDK may send (reasoning_effort, metadata, store, ...) is taken, not a 400;
    parallel_tool_calls false leaves a reply's first call only, whole and streamed."""
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"],
        "additionalProperties": False}}}]
    body = {"messages": [{"role": "user", "content": "2 + 3?"}], "tools": tools, "tool_choice": "required",
            "max_tokens": 120, "seed": 5, "reasoning_effort": "low", "metadata": {"run": "x"}, "store": False,
            "service_tier": "auto", "prompt_cache_key": "k", "safety_identifier": "u", "verbosity": "low",
            "structured_outputs": None}
    call = '<tool_call> "\\n{\\"name\\": \\"add\\", \\"arguments\\": {\\"a\\": " /[0-9]/ "}}\\n" </tool_call>'
    grammar = f'start: call "\\n" call\ncall: {call}'  # (the tags are tokens of their own: named)
    two = {k: v for k, v in body.items() if k not in ("tool_choice", "structured_outputs")} | {
        "structured_outputs": {"grammar": grammar}}
    both = client.post("/v1/chat/completions", json=two).json()["choices"][0]["message"]["tool_calls"]
    assert len(both) == 2
    one = client.post("/v1/chat/completions", json=two | {"parallel_tool_calls": False}).json()
    assert [c["function"] for c in one["choices"][0]["message"]["tool_calls"]] == [both[0]["function"]]
    with client.stream("POST", "/v1/chat/completions", json=two | {"parallel_tool_calls": False, "stream": True}) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    streamed = [c for ch in chunks for c in ch["choices"][0]["delta"].get("tool_calls") or []]
    assert [c["function"] for c in streamed] == [both[0]["function"]]
    assert client.post("/v1/chat/completions", json=body | {"structured_outputs": None}).status_code == 200


def test_a_reply_goes_on_writing_a_prefilled_assistant_message(client, model_dir):
    """vLLM's continue_final_message (with add_generation_prompt false): the prompt is the chat up
    to the last message's text, left open; /tokenize renders it the same; both flags true is a 400.
    With vLLM's `echo` the reply's content begins with that message's text."""
    from rollwise.engine.tokenizer import Tokenizer
    tok = Tokenizer(model_dir)
    msgs = [{"role": "user", "content": "2 + 3?"}, {"role": "assistant", "content": "The answer is"}]
    body = {"messages": msgs, "max_tokens": 3, "return_token_ids": True, "continue_final_message": True,
            "add_generation_prompt": False}
    got = client.post("/v1/chat/completions", json=body).json()
    want = tok.encode(tok.apply_chat_template(msgs[:1]) + "The answer is", add_special_tokens=False)
    assert got["prompt_token_ids"] == want
    assert client.post("/tokenize", json={k: body[k] for k in ("messages", "continue_final_message",
                                                                "add_generation_prompt")}).json()["tokens"] == want
    for bad, why in (({"add_generation_prompt": True}, "cannot both be true"),
                     ({"messages": msgs[:1]}, "needs a last message from the assistant")):
        r = client.post("/v1/chat/completions", json=body | bad)
        assert r.status_code == 400 and why in r.json()["error"]["message"], bad
    # vLLM's echo: the content begins with the prefilled message's text, whole and streamed alike
    body |= {"temperature": 0, "ignore_eos": True, "echo": True}
    said = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    plain = client.post("/v1/chat/completions", json=body | {"echo": False}).json()["choices"][0]["message"]["content"]
    assert said == "The answer is" + plain
    with client.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == said
    asked = {"messages": msgs[:1], "max_tokens": 3, "echo": True}  # the last message is not the reply's role
    assert not client.post("/v1/chat/completions", json=asked).json()["choices"][0]["message"]["content"].startswith(
        "2 + 3?")


def test_prompt_logprobs_as_vllm_gives_them(client):
    """vLLM's prompt_logprobs on completions (per choice) and chat (beside the choices): None for the
    first prompt token, then the token's logprob and the k most likely, ranked (the token by its place
    in the vocabulary); the same numbers as /generate's prompt logprobs for the same ids."""
    ids = [5, 6, 7, 8, 9]
    got = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "prompt_logprobs": 2}).json()
    plp = got["choices"][0]["prompt_logprobs"]
    gen = client.post("/generate", json={"input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
                                         "top_logprobs_num": 2, "sampling_params": {"max_tokens": 1}}).json()
    assert plp[0] is None and len(plp) == len(ids)
    for k, (t, lp) in enumerate(zip(ids[1:], gen["prompt_logprobs"][1:]), start=1):
        assert plp[k][str(t)]["logprob"] == pytest.approx(lp, abs=1e-5)
        ranked = sorted((e["rank"], e["logprob"]) for e in plp[k].values() if e["rank"] <= 2)
        mine = plp[k][str(t)]  # (one of the 2 most likely, or its place in the vocabulary below them)
        assert [r for r, _ in ranked] == [1, 2] and ranked[0][1] >= ranked[1][1]
        assert (mine["rank"] <= 2) == (t in {c for c, _ in gen["prompt_top_logprobs"][k]})
        assert mine["rank"] <= 2 or mine["logprob"] <= ranked[1][1] + 1e-6
        assert mine["rank"] == gen["prompt_logprob_ranks"][k]
    assert max(gen["prompt_logprob_ranks"][1:]) > 2  # (some ranked below the 2 shown: the engine's test checks them)
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                                     "prompt_logprobs": 0, "return_token_ids": True}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == len(chat["prompt_token_ids"])
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client, model_dir):
    """vLLM's `truncate_prompt_tokens`: the prompt's last k tokens (-1: up to the model's length,
    here 512); more than the model's length, 0, or below -1 is a 400 and the server keeps serving."""
    tok = LLM(model_dir).engine.tokenizer
    text = "The agent looked up the order and then the refund policy"
    ids = tok.encode(text)
    body = {"prompt": text, "temperature": 0, "max_tokens": 3, "return_token_ids": True, "truncate_prompt_tokens": 4}
    got = client.post("/v1/completions", json=body).json()
    assert got["choices"][0]["prompt_token_ids"] == ids[-4:] and got["usage"]["prompt_tokens"] == 4
    same = client.post("/v1/completions", json=body | {"prompt": ids[-4:], "truncate_prompt_tokens": None}).json()
    assert same["choices"][0]["token_ids"] == got["choices"][0]["token_ids"]  # as if only those were sent
    echo = client.post("/v1/completions", json=body | {"echo": True}).json()["choices"][0]["text"]
    assert echo.startswith(tok.decode(ids[-4:], skip_special_tokens=False)) and not echo.startswith(text)
    whole = client.post("/v1/completions", json=body | {"truncate_prompt_tokens": -1}).json()
    assert whole["choices"][0]["prompt_token_ids"] == ids
    msgs = [{"role": "user", "content": text}]
    chat = {"messages": msgs, "temperature": 0, "max_tokens": 2, "return_token_ids": True, "truncate_prompt_tokens": 5}
    assert client.post("/v1/chat/completions", json=chat).json()["prompt_token_ids"] == tok.encode_chat(msgs)[-5:]
    for bad, why in [(513, "more than the model's length"), (0, "at least 1"), (-2, "greater than or equal to -1")]:
        r = client.post("/v1/completions", json=body | {"truncate_prompt_tokens": bad})
        assert r.status_code == 400 and why in r.text, r.text
    _alive(client)


def test_sglang_flags_fold_into_ours(model_dir, monkeypatch):
    """What `rollwise serve` makes of SGLang's flags before it starts (no server): its parser names as
    ours, --lora-paths as --lora-modules, its names for our settings."""
    from rollwise import cli
    from rollwise.serve.launch import launch_args
    got = []
    monkeypatch.setattr(cli, "cmd_serve", lambda args: (launch_args(args), got.append(args)))
    cli.main(["serve", "--model-path", model_dir, "--tool-call-parser", "qwen25", "--reasoning-parser", "deepseek-r1",
              "--lora-paths", "a=/adapters/a", "/adapters/b", "--enable-lora", "--page-size", "32",
              "--enable-deterministic-inference", "--max-loras-per-batch", "3"])
    args, = got
    assert (args.model, args.tool_call_parser, args.reasoning_parser) == (model_dir, "hermes", "deepseek_r1")
    assert args.lora_modules == ["a=/adapters/a", "/adapters/b=/adapters/b"]
    assert (args.block_size, args.batch_invariant, args.max_loras) == (32, True, 3)


def test_sglang_ngram_speculation_folds_into_ours(model_dir, monkeypatch, capsys):
    """SGLang's NGRAM speculation (a trie over recent requests' tokens, no draft model) as the suffix
    trees: its draft-token count and trie depth as ours, its trie's own knobs taken with nothing to do;
    an algorithm that needs a draft model, or the depth given twice and differently, is refused."""
    from rollwise import cli
    from rollwise.peer_args import sglang_args
    from rollwise.serve.launch import launch_args
    got = []
    monkeypatch.setattr(cli, "cmd_serve", lambda args: (launch_args(args), got.append(args)))
    cli.main(["serve", "--model-path", model_dir, "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens",
              "8", "--speculative-ngram-max-trie-depth", "12", "--speculative-ngram-max-bfs-breadth", "4",
              "--speculative-ngram-match-type", "BFS"])
    args = got.pop()
    assert (args.speculative, args.spec_max_tokens, args.spec_max_depth) == ("suffix", 8, 12)
    model, kw = sglang_args({"model_path": model_dir, "speculative_algorithm": "NGRAM",
                             "speculative_ngram_branch_length": 18, "speculative_ngram_capacity": 1000})
    assert (model, kw["speculative"], kw["spec_max_depth"]) == (model_dir, "suffix", 18)
    with pytest.raises(ValueError, match=r"speculative_algorithm must be one of \['NGRAM'\].*got 'EAGLE3'"):
        sglang_args({"model_path": model_dir, "speculative_algorithm": "EAGLE3"})
    with pytest.raises(ValueError, match="spec_max_depth is given twice"):
        sglang_args({"model_path": model_dir, "speculative_ngram_branch_length": 18,
                     "speculative_ngram_max_trie_depth": 6})
    with pytest.raises(SystemExit):
        cli.main(["serve", model_dir, "--speculative", "ngram", "--speculative-algorithm", "NGRAM"])
    assert "--speculative and its SGLang name disagree" in capsys.readouterr().err


def test_vllm_speculative_config_flag_folds_into_ours(model_dir, monkeypatch, capsys):
    """`vllm serve --speculative-config JSON` as written: vLLM's ngram and suffix methods become
    --speculative and the --spec-* flags; one that disagrees with a flag given too is refused."""
    import json

    from rollwise import cli
    from rollwise.serve.launch import launch_args
    got = []
    monkeypatch.setattr(cli, "cmd_serve", lambda args: (launch_args(args), got.append(args)))
    spec = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    cli.main(["serve", model_dir, "--speculative-config", json.dumps(spec)])
    args = got.pop()
    assert (args.speculative, args.spec_max_tokens, args.spec_lookup_min, args.spec_lookup_max) == ("ngram", 5, 2, 4)
    cli.main(["serve", model_dir, "--logprobs-mode", "processed_logprobs", "--distributed-executor-backend", "mp",
              "--model-impl", "auto", "--data-parallel-size", "1"])  # (prime-rl's vLLM settings)
    assert got.pop().logprobs_mode == "processed_logprobs"
    cli.main(["serve", model_dir, "--speculative", "suffix", "--speculative-config", '{"method": "suffix"}'])
    assert (got[-1].speculative, got[-1].spec_max_tokens) == ("suffix", 24)
    with pytest.raises(SystemExit):
        cli.main(["serve", model_dir, "--speculative", "suffix", "--speculative-config", '{"method": "ngram"}'])
    assert "--speculative and --speculative-config disagree" in capsys.readouterr().err


def test_repetition_detection_over_http(client):
    """vLLM's repetition_detection on completions and chat, and in /generate's sampling_params (what a
    router sends its replicas): a looping greedy reply ends with finish_reason "repetition"; a bad
    rule is a 400 that names the fields."""
    rule = {"max_pattern_size": 8, "min_count": 3}
    body = {"prompt": "hello world", "max_tokens": 120, "temperature": 0, "ignore_eos": True}
    full = client.post("/v1/completions", json=body).json()["choices"][0]
    cut = client.post("/v1/completions", json=body | {"repetition_detection": rule}).json()["choices"][0]
    assert full["finish_reason"] == "length" and cut["finish_reason"] == "repetition"
    assert cut["stop_reason"] == "repetition_detected" and full["text"].startswith(cut["text"])
    assert len(cut["text"]) < len(full["text"])
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello world"}],
                                                     "max_tokens": 120, "temperature": 0, "ignore_eos": True,
                                                     "repetition_detection": rule}).json()
    assert chat["choices"][0]["finish_reason"] == "repetition"
    ids = client.post("/tokenize", json={"prompt": "hello world"}).json()["tokens"]
    gen = client.post("/generate", json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": 120, "temperature": 0, "ignore_eos": True, "repetition_detection": rule}}).json()
    assert gen["meta_info"]["finish_reason"]["type"] == "repetition"
    r = client.post("/v1/completions", json=body | {"repetition_detection": {"max_pattern_size": 4, "min_count": 1}})
    assert r.status_code == 400 and "min_count must be >= 2" in r.json()["error"]["message"]


def test_thinking_token_budget_over_http(client):
    """vLLM's thinking_token_budget on completions (a think block the prompt opened) and in
    /generate's sampling_params: the end of thinking is forced after the budget, then the model goes on."""
    ids = client.post("/tokenize", json={"prompt": "question <think> x y"}).json()["tokens"]
    end = client.post("/tokenize", json={"prompt": "</think>"}).json()["tokens"]
    body = {"prompt": ids, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    free = client.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
    cut = client.post("/v1/completions", json=body | {"thinking_token_budget": 6}).json()["choices"][0]["token_ids"]
    opened = ids.index(client.post("/tokenize", json={"prompt": "<think>"}).json()["tokens"][0])
    k = 6 - (len(ids) - opened - 1)  # (the block's tokens in the prompt count)
    assert cut[:k] == free[:k] and cut[k:k + len(end)] == end != free[k:k + len(end)]
    gen = client.post("/generate", json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": 12, "temperature": 0, "ignore_eos": True, "thinking_token_budget": 6}}).json()
    assert gen["output_ids"] == cut
    r = client.post("/v1/completions", json=body | {"thinking_token_budget": -3})
    assert r.status_code == 400 and "thinking_token_budget" in r.json()["error"]["message"]


def test_trace_decode_token_ids_over_generate(client):
    """vLLM's trace replay in /generate's sampling_params (what a router sends its replicas): the trace
    is the output, its logprobs the model's."""
    trace = [40, 41, 42, 43]
    body = {"input_ids": [5, 6, 7, 8], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 10, "temperature": 1.0, "trace_decode_token_ids": trace}}
    got = client.post("/generate", json=body).json()
    assert got["output_ids"] == trace and len(got["meta_info"]["output_token_logprobs"]) == 4
    bad = client.post("/generate", json=body | {"sampling_params": {"trace_decode_token_ids": "40"}})
    assert bad.status_code == 400 and "trace_decode_token_ids" in bad.json()["error"]["message"]


def test_logprob_token_ids_over_http(client):
    """vLLM's logprob_token_ids on completions and chat: each position's top_logprobs are exactly those
    tokens; without logprobs on it is a 400, as in vLLM."""
    ids = [40, 41, 42]
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0, "logprobs": 3, "logprob_token_ids": ids,
            "return_tokens_as_token_ids": True}
    got = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["top_logprobs"]
    assert [list(top) for top in got] == [[f"token_id:{t}" for t in ids]] * 4
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                     "logprobs": True, "logprob_token_ids": ids}).json()
    assert all(len(c["top_logprobs"]) == 3 for c in chat["choices"][0]["logprobs"]["content"])
    for bad in ({"logprobs": None}, {"logprobs": 2}):
        r = client.post("/v1/completions", json=body | bad)
        assert r.status_code == 400 and "logprob" in r.json()["error"]["message"]


def test_vllm_request_fields_ids_truncation_side_and_token_ids_in_chat(client, model_dir):
    """vLLM's `request_id` (the X-Request-Id header first) names the reply, and two requests under
    one id run at once, as in vLLM; `truncation_side: "right"` keeps the prompt's first tokens;
    `stream_interval: 4` streams chunks of up to 4 tokens;
    chat's `return_tokens_as_token_ids` shows each logprob's token as "token_id:N" (bytes its text's)."""
    tok = LLM(model_dir).engine.tokenizer
    text = "The agent looked up the order and then the refund policy"
    body = {"prompt": text, "temperature": 0, "max_tokens": 3, "return_token_ids": True}
    got = client.post("/v1/completions", json=body | {"request_id": "run7-ep3"}).json()
    assert got["id"] == "cmpl-run7-ep3"
    msgs = [{"role": "user", "content": text}]
    chat = {"messages": msgs, "temperature": 0, "max_tokens": 4, "logprobs": True, "top_logprobs": 2}
    r = client.post("/v1/chat/completions", json=chat | {"request_id": "body"}, headers={"X-Request-Id": "hdr-1"})
    assert r.json()["id"] == "chatcmpl-hdr-1"
    plain = r.json()["choices"][0]["logprobs"]["content"]
    ids = client.post("/v1/chat/completions", json=chat | {"return_tokens_as_token_ids": True}).json()
    content = ids["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{c['token_id']}" for c in plain]
    assert [c["bytes"] for c in content] == [c["bytes"] for c in plain]  # (the token's text)
    assert [[t["token"] for t in c["top_logprobs"]] for c in content] == \
        [[f"token_id:{t['token_id']}" for t in c["top_logprobs"]] for c in plain]
    streamed = client.post("/v1/chat/completions", json=chat | {"stream": True, "return_tokens_as_token_ids": True})
    first = next(line for line in streamed.text.splitlines() if line.startswith("data: "))
    assert json.loads(first[6:])["choices"][0]["logprobs"]["content"][0]["token"].startswith("token_id:")
    assert client.post("/pause", params={"mode": "keep"}).status_code == 200  # (requests stay in flight)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two at once under one id: both run, as in vLLM
        try:
            held = [pool.submit(client.post, "/v1/chat/completions", json=chat | {"request_id": "twice", "n": 2})
                    for _ in range(2)]
            deadline = time.monotonic() + 60  # (all four in the engine, held)
            while _metric(client, "vllm:num_requests_waiting") + _metric(client, "vllm:num_requests_running") < 4 \
                    and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            client.post("/resume")
        replies = [h.result().json() for h in held]
    assert [r["id"] for r in replies] == ["chatcmpl-twice"] * 2
    assert replies[0]["choices"] == replies[1]["choices"]  # (greedy: the same tokens)
    every4 = client.post("/v1/chat/completions", json=chat | {"stream": True, "stream_interval": 4, "max_tokens": 9,
                                                             "ignore_eos": True, "return_token_ids": True})
    sizes = [len(c["choices"][0].get("token_ids", [])) for c in map(json.loads, (
        x[6:] for x in every4.text.splitlines() if x.startswith("data: {"))) if c["choices"]]
    assert sum(sizes) == 9 and max(sizes) == 4 and sizes[0] == 1, sizes  # (the first at once, as in vLLM)
    assert client.post("/v1/completions", json=body | {"stream_interval": 0}).status_code == 400
    full = tok.encode(text)
    right = client.post("/v1/completions", json=body | {"truncate_prompt_tokens": 4, "truncation_side": "right"})
    assert right.json()["choices"][0]["prompt_token_ids"] == full[:4]
    bad = client.post("/v1/completions", json=body | {"truncation_side": "middle"})
    assert bad.status_code == 400 and "left" in bad.text
    _alive(client)


def test_add_special_tokens_and_include_reasoning(model_dir, tmp_path):
    """vLLM's `add_special_tokens`, on a tokenizer that writes a BOS: a completion's text prompt gets
    it by default and not with false; a chat's (the template writes what it wants) only with true.
    `include_reasoning: false` leaves a thinking model's reasoning out of the reply, streamed too."""
    import shutil
    d = tmp_path / "bos"
    shutil.copytree(model_dir, d)
    spec = json.loads((d / "tokenizer.json").read_text())
    spec["post_processor"] = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
                                                                       {"Sequence": {"id": "A", "type_id": 0}}],
                              "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                              "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}}}
    (d / "tokenizer.json").write_text(json.dumps(spec))
    text = "The agent looked up the order"
    with ServerProcess(str(d), "--max-model-len", "256", "--reasoning-parser", "deepseek_r1") as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        body = {"prompt": text, "temperature": 0, "max_tokens": 2, "return_token_ids": True}
        with_bos = c.post("/v1/completions", json=body).json()["choices"][0]["prompt_token_ids"]
        without = c.post("/v1/completions", json=body | {"add_special_tokens": False}).json()["choices"][0]
        assert with_bos == [1] + without["prompt_token_ids"] and without["prompt_token_ids"][0] != 1
        msgs = [{"role": "user", "content": text}]
        chat = {"messages": msgs, "temperature": 0, "max_tokens": 2, "return_token_ids": True}
        plain = c.post("/v1/chat/completions", json=chat).json()["prompt_token_ids"]
        assert c.post("/v1/chat/completions", json=chat | {"add_special_tokens": True}).json()["prompt_token_ids"] == \
            [1] + plain
        # DeepSeek-R1's parser: a reply with no end of thinking is all reasoning
        think = {"messages": msgs, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        shown = c.post("/v1/chat/completions", json=think).json()["choices"][0]["message"]
        hidden = c.post("/v1/chat/completions", json=think | {"include_reasoning": False}).json()["choices"][0]["message"]
        assert "reasoning_content" in shown and "reasoning_content" not in hidden and "reasoning" not in hidden
        assert hidden["content"] == shown["content"]
        lines = [json.loads(x[6:]) for x in c.post("/v1/chat/completions", json=think | {
            "include_reasoning": False, "stream": True}).text.splitlines() if x.startswith("data: {")]
        assert lines and not any("reasoning_content" in ch["choices"][0]["delta"] for ch in lines if ch["choices"])


def test_vllm_xargs_are_taken_as_the_requests_extra_args(client):
    """vLLM's `vllm_xargs` (values for custom extensions) reach SamplingParams.extra_args; values other
    than strings, numbers and lists of them are a 400, as in vLLM's schema."""
    from rollwise.serve.protocol import CompletionRequest
    xargs = {"a": 1, "b": ["x", 2.5], "c": "on"}
    assert CompletionRequest(prompt="hi", vllm_xargs=xargs).sampling(4).extra_args == xargs
    ok = client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2, "vllm_xargs": xargs})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "vllm_xargs": xargs}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    bad = client.post("/v1/completions", json={"prompt": [5], "max_tokens": 2, "vllm_xargs": {"a": {"b": 1}}})
    assert bad.status_code == 400
