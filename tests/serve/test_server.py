"""The HTTP server over real HTTP on 127.0.0.1 (a `rollwise serve` subprocess)."""
from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import pytest

from rollwise import LLM, SamplingParams
from rollwise.serve.process import ServerProcess


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


def test_masked_tokens_logprobs_are_json_as_vllm_writes_them(client):
    """Asking for more top logprobs than allowed_token_ids leaves tokens: the rest are -inf, not JSON,
    so such a request got a 400 before; now -9999.0, as vLLM writes them, in every API, streamed too
    (strict JSON: a parser that refuses NaN and Infinity reads every body)."""
    def strict(text: str):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in a body"))
    ids, allowed = [5, 17, 300], [40, 41]
    body = {"prompt": ids, "max_tokens": 3, "temperature": 0, "logprobs": 4, "allowed_token_ids": allowed,
            "return_tokens_as_token_ids": True}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    tops = strict(r.text)["choices"][0]["logprobs"]["top_logprobs"]
    assert all(sorted(t.values())[:2] == [-9999.0, -9999.0] and max(t.values()) > -9999.0 for t in tops)
    with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
        lines = [x[6:] for x in r.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
    assert [t for x in lines for t in (strict(x)["choices"][0]["logprobs"]["top_logprobs"] or [])] == tops
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0, "logprobs": True,
            "top_logprobs": 3, "allowed_token_ids": allowed}
    r = client.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200 and strict(r.text)["choices"][0]["logprobs"]["content"][0]["top_logprobs"][-1][
        "logprob"] == -9999.0
    r = client.post("/generate", json={"input_ids": ids, "sampling_params": {
        "temperature": 0, "max_tokens": 2, "logprobs": 3, "allowed_token_ids": allowed}})
    assert r.status_code == 200 and strict(r.text)["top_logprobs"][0][-1][1] == -9999.0


def _metric(client, name: str) -> float:
    line = [x for x in client.get("/metrics").text.splitlines() if x.startswith(name + "{")]
    return float(line[0].split()[-1])


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
        after = {"input_ids": [5], "sampling_params": {"max_tokens": 3, "ignore_eos": True}}  # (unseeded: EOS ~1%)
        assert len(c.post("/generate", json=after).json()["token_ids"]) == 3


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


def test_generate_takes_sglangs_n(client):
    """/generate with sampling_params.n, as SGLang answers it: a list of n replies, sample j the same
    tokens as a request of its own seeded seed + j, the prompt computed once; and SGLang's batch form
    (a list of prompts). n with a stream or a trajectory, or out of range, and a batch whose lists do
    not match, are 400s and the server goes on."""
    ids = [31 + i for i in range(40)]  # 2 full blocks of 16 + 8
    sp = {"max_new_tokens": 4, "temperature": 1.0, "seed": 5, "ignore_eos": True}
    before = _prefill(client)
    r = client.post("/generate", json={"input_ids": ids, "rid": "par", "sampling_params": sp | {"n": 3}})
    assert r.status_code == 200, r.text
    outs = r.json()
    assert _prefill(client) - before == 40 + 2 * 8
    assert [o["index"] for o in outs] == [0, 1, 2]
    assert [o["meta_info"]["id"] for o in outs] == ["par-0", "par-1", "par-2"]
    for j, o in enumerate(outs):
        alone = client.post("/generate", json={"input_ids": ids, "sampling_params": sp | {"seed": 5 + j}}).json()
        assert o["output_ids"] == o["token_ids"] == alone["token_ids"]
    assert len({tuple(o["token_ids"]) for o in outs}) > 1
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # SGLang's /abort_request by rid ends the n samples
        long = pool.submit(client.post, "/generate", json={"input_ids": ids, "rid": "par2", "sampling_params": {
            "max_new_tokens": 3000, "ignore_eos": True, "n": 2}})
        for _ in range(200):
            if _metric(client, "vllm:num_requests_running") >= 2:
                break
            time.sleep(0.02)
        assert client.post("/abort_request", json={"rid": "par2"}).json() == {"aborted": ["par2-0", "par2-1"]}
        assert [o["finish_reason"] for o in long.result().json()] == ["abort", "abort"]
    # SGLang's batch form: a list of prompts (ids or texts), a reply each in order (n each with n)
    two = [ids, ids[:20]]
    batch = client.post("/generate", json={"input_ids": two, "rid": ["b0", "b1"], "sampling_params": [
        sp | {"n": 2}, sp | {"seed": 9}]}).json()
    assert [o["meta_info"]["id"] for o in batch] == ["b0-0", "b0-1", "b1"]
    assert [o["token_ids"] for o in batch[:2]] == [o["token_ids"] for o in outs[:2]]
    assert batch[2]["token_ids"] == client.post("/generate", json={"input_ids": ids[:20], "sampling_params": sp | {
        "seed": 9}}).json()["token_ids"]
    texts = client.post("/generate", json={"text": ["a b", "c"], "sampling_params": {"max_new_tokens": 2}}).json()
    assert len(texts) == 2 and [o["meta_info"]["completion_tokens"] for o in texts] == [2, 2]
    for bad in ({"input_ids": two, "rid": ["x"]}, {"input_ids": two, "sampling_params": [sp]},
                {"input_ids": ids, "sampling_params": [sp]}, {"input_ids": two, "stream": True}):
        r = client.post("/generate", json=bad)
        assert r.status_code == 400 and r.json()["error"]["message"], (bad, r.text)
    for extra, sampling in (({"stream": True}, {"n": 2}), ({"trajectory_id": "t"}, {"n": 2}), ({}, {"n": 0}),
                            ({}, {"n": 129})):
        bad = client.post("/generate", json={"input_ids": ids, "sampling_params": sp | sampling} | extra)
        assert bad.status_code == 400 and "n" in bad.json()["error"]["message"], bad.text
    _alive(client)


def test_models_and_metrics(client):
    assert client.get("/v1/models").json()["data"][0]["max_model_len"] == 512
    # (tokens of its own: with xdist's work stealing this test may be the module's first on its worker)
    r = client.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}})
    assert r.status_code == 200
    text = client.get("/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:generation_tokens_total"):
        assert name in text
    gen = [line for line in text.splitlines() if line.startswith("vllm:generation_tokens_total")]
    assert float(gen[0].split()[-1]) > 0
    # vLLM's request histograms, in Prometheus' text format as prometheus_client parses it: each ended
    # request counted once, with its generated tokens
    from prometheus_client.parser import text_string_to_metric_families
    def hists():
        families = text_string_to_metric_families(client.get("/metrics").text)
        return {f.name: {(s.name.rsplit("_", 1)[-1], s.labels.get("le")): s.value for s in f.samples}
                for f in families if f.type == "histogram"}
    before = hists()
    assert {"vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
            "vllm:request_time_per_output_token_seconds", "vllm:request_generation_tokens",
            "vllm:inter_token_latency_seconds"} <= set(before)
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_tokens": 5, "ignore_eos": True}}
    for _ in range(3):
        client.post("/generate", json=body)
    after = hists()
    for name in ("vllm:e2e_request_latency_seconds", "vllm:time_to_first_token_seconds"):
        assert after[name][("count", None)] - before[name][("count", None)] == 3
        assert after[name][("bucket", "+Inf")] == after[name][("count", None)]
    gen = "vllm:request_generation_tokens"
    assert after[gen][("sum", None)] - before[gen][("sum", None)] == 15
    assert after[gen][("bucket", "5.0")] - before[gen][("bucket", "5.0")] == 3  # (le="5.0" holds a 5)
    itl = "vllm:inter_token_latency_seconds"  # a step per token after the first: 4 each
    assert after[itl][("count", None)] - before[itl][("count", None)] == 12


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
    ("/update_weights", {"model_dir": "a" * 5000}),  # a name too long to look at (OSError, not ValueError)
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"stop": 5}}),  # not a string or a list
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"stop_token_ids": True}}),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [10**9], "min_tokens": 2}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": 5}]}),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": True}]}]}),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function", "function": True}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": {"function": True},
                              "tools": [{"type": "function", "function": {"name": "f"}}]}),
    ("/v1/responses", {"input": "hi", "tools": 5}),
    ("/v1/responses", {"input": "hi", "text": "x"}),
    ("/v1/responses", {"input": "hi", "text": {"format": 5}}),
    ("/v1/responses", {"input": "hi", "stream": [1]}),  # a stream is asked for with true, nothing else
    ("/v1/messages", {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}),
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
    # NaN is not JSON: Python's parser takes it, and the Responses API's reply (which echoes the tools) could
    # not be written
    nan = b'{"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": NaN}}]}'
    for path in ("/v1/responses", "/v1/messages"):
        r = client.post(path, content=nan, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "NaN" in r.text, (path, r.status_code, r.text)
    _alive(client)


def test_a_body_nested_too_deeply_and_unknown_paths_get_json_errors(client):
    """JSON nested past Python's recursion limit: a 400 in the API's error shape on every route (the
    Responses and Messages routes parse their own bodies: a RecursionError there was a 500); 404 and
    405 in the same shape."""
    deep = b'{"prompt": "hi", "input": "hi", "max_tokens": 2, "user": ' + b"[" * 50000 + b"]" * 50000 + b"}"
    for path in ("/v1/completions", "/v1/chat/completions", "/generate", "/v1/responses", "/v1/messages"):
        r = client.post(path, content=deep, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["message"], (path, r.status_code, r.text[:200])
    assert client.get("/nowhere").json()["error"] == {"message": "Not Found", "type": "not_found_error", "code": 404}
    r = client.get("/generate")
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["code"] == 405
    _alive(client)


def test_unreadable_weights_get_400(client, tmp_path):
    """A directory whose safetensors file is not one (a failed copy): 400, the weights unchanged."""
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    r = client.post("/update_weights", json={"model_dir": str(tmp_path)})
    assert r.status_code == 400 and "cannot read" in r.json()["error"]["message"], r.text
    r = client.post("/update_weights_from_disk", json={"model_path": "a" * 5000})  # (SGLang's reply)
    assert r.status_code == 400 and r.json()["success"] is False and "cannot read" in r.json()["message"], r.text
    assert client.get("/health").json()["policy_version"] == 0
    _alive(client)


@pytest.mark.parametrize("path", ["/generate", "/v1/chat/completions", "/v1/responses"])
def test_junk_in_any_field_is_a_4xx_never_a_500(client, path, junk_failures):
    """Every field of a valid body (nested ones too) replaced by values of every other type: a reply, or
    a 4xx with a JSON error; never a 500, and the server keeps serving."""
    assert junk_failures(client, path) == []
    _alive(client)


def test_a_bad_request_does_not_fail_the_requests_in_flight(client, server):
    """A stop token id past the vocabulary with min_tokens once reached the sampler (which bans stop
    tokens before min_tokens) and failed the step: every request in it. It is refused up front."""
    def long():
        return client.post("/generate", json={"input_ids": [4, 5, 6], "sampling_params": {
            "max_tokens": 64, "ignore_eos": True, "temperature": 0}})
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(long)
        time.sleep(0.3)
        with httpx.Client(base_url=server.url, timeout=60) as other:
            bad = other.post("/generate", json={"input_ids": [1, 2], "sampling_params": {
                "stop_token_ids": [10**9], "min_tokens": 2, "max_tokens": 4}})
        assert bad.status_code == 400 and "stop_token_ids" in bad.json()["error"]["message"]
        done = running.result()
    assert done.status_code == 200 and len(done.json()["token_ids"]) == 64


def test_chat_content_parts_and_the_developer_role(client):
    """OpenAI's content parts (text ones, joined with newlines, as vLLM joins them) and `developer` (the
    system prompt's name for newer models) give the prompt of the plain message."""
    def ids(messages):
        r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1, "return_token_ids": True})
        assert r.status_code == 200, r.text
        return r.json()["prompt_token_ids"]
    parts = [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]
    # the agent gateway, the Responses and Messages APIs and SFT transcripts join them the same way
    from rollwise.agent.episode import text_content
    from rollwise.agent.responses_api import _text
    assert text_content(parts) == _text([dict(p, type="input_text") for p in parts]) == "hi\nthere"
    assert ids([{"role": "developer", "content": "be brief"}, {"role": "user", "content": parts}]) == \
        ids([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi\nthere"}])


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
        assert httpx.get(s.url + "/ping").json()["status"] == httpx.post(s.url + "/ping").json()["status"] == "ok"
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
        # a subset of the tensors (LoRA's merged linears) updates those alone, either way
        norm = "model.norm.weight"
        plain = {norm: -flipped[norm]}
        assert asyncio.run(HttpReplica(s.url, api_key="sekret", weights_via="stream").update_weights(plain, 9)) == 9
        assert httpx.post(s.url + "/generate", json=req, headers=h).json()["token_ids"] == before["token_ids"]
        assert asyncio.run(HttpReplica(s.url, api_key="sekret", weights_via="file").update_weights(
            {norm: flipped[norm]}, 10)) == 10
        assert httpx.post(s.url + "/generate", json=req, headers=h).json()["token_ids"] == after["token_ids"]
    with pytest.raises(ValueError, match="weights_via must be one of"):
        HttpReplica("http://127.0.0.1:1", weights_via="nfs")
    assert HttpReplica("http://127.0.0.1:1").weights_via == "file"
    assert HttpReplica("http://10.1.2.3:8000").weights_via == "stream"


def _generated(url: str, headers: dict) -> float:
    text = httpx.get(url + "/metrics", headers=headers).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:generation_tokens_total"))


def test_priority_needs_the_priority_policy_and_reaches_the_engine(client, model_dir):
    """vLLM's `priority` field: a 400 naming the policy on an FCFS server (the module's); on a server
    with --scheduling-policy priority (in-process app) each endpoint hands it to the engine."""
    bodies = {"/generate": {"input_ids": [4, 5, 6], "sampling_params": {"max_tokens": 2}},
              "/v1/completions": {"prompt": [4, 5, 6], "max_tokens": 2},
              "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}
    for path, body in bodies.items():
        r = client.post(path, json=body | {"priority": 2})
        assert r.status_code == 400 and "scheduling_policy 'priority'" in r.json()["error"]["message"], path
        assert client.post(path, json=body | {"priority": 0}).status_code == 200, path
        assert client.post(path, json=body | {"priority": "2"}).status_code == 400, path
    from fastapi.testclient import TestClient

    from rollwise.config import ServerConfig
    from rollwise.engine.async_engine import AsyncEngine
    from rollwise.serve.server import build_app
    engine = AsyncEngine(model_dir, scheduling_policy="priority")
    seen = []
    add = engine.engine.add_request
    engine.engine.add_request = lambda *a, **k: seen.append(k.get("priority")) or add(*a, **k)
    try:
        app = TestClient(build_app(engine, ServerConfig(), "m"))
        for path, body in bodies.items():
            assert app.post(path, json=body | {"priority": -3}).status_code == 200, path
            assert app.post(path, json=body | {"stream": True, "priority": 4}).status_code == 200, path
    finally:
        engine.shutdown()
    assert seen == [-3, 4] * 3


def test_cache_salt_keeps_a_prefix_to_its_salt_on_every_endpoint(client):
    """vLLM's `cache_salt`: on /generate, completions, chat and responses the same prompt under
    another salt (or none) computes its own KV, and under its own salt finds it; a 400 for a bad one."""
    import random
    rng = random.Random(77)
    words, other = (" ".join(rng.choice(["apple", "river", "stone", "cloud", "seven", "green"]) for _ in range(40))
                    for _ in range(2))
    ids = [rng.randrange(10, 500) for _ in range(40)]
    paths = {"/generate": ({"input_ids": ids, "sampling_params": {"max_tokens": 2}}, lambda j: j["num_cached_tokens"]),
             "/v1/completions": ({"prompt": ids[::-1], "max_tokens": 2},
                                 lambda j: j["usage"]["prompt_tokens_details"]["cached_tokens"]),
             "/v1/chat/completions": ({"messages": [{"role": "user", "content": words}], "max_tokens": 2},
                                      lambda j: j["usage"]["prompt_tokens_details"]["cached_tokens"]),
             "/v1/responses": ({"input": other, "max_output_tokens": 2},
                               lambda j: j["usage"]["input_tokens_details"]["cached_tokens"])}
    for path, (body, cached) in paths.items():
        got = []
        for salt in (None, "tenant-1", "tenant-1", "tenant-2", None):
            r = client.post(path, json=body | ({} if salt is None else {"cache_salt": salt}))
            assert r.status_code == 200, (path, r.text)
            got.append(cached(r.json()))
        assert got[0] == got[1] == got[3] == 0 and got[2] == got[4] >= 32, (path, got)
        for bad in ("", 5):
            r = client.post(path, json=body | {"cache_salt": bad})
            assert r.status_code == 400 and "cache_salt" in r.text, (path, bad, r.text)
    streamed = paths["/generate"][0] | {"stream": True, "cache_salt": "tenant-1"}
    with client.stream("POST", "/generate", json=streamed) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[-1]["num_cached_tokens"] >= 32


def test_weight_updates_off_loopback_need_an_api_key(model_dir):
    """A server bound off loopback without --api-key refuses weight updates, ours and SGLang's, and the
    control endpoints (pause, resume, flush, abort) (in-process app)."""
    from fastapi.testclient import TestClient

    from rollwise.config import ServerConfig
    from rollwise.engine.async_engine import AsyncEngine
    from rollwise.serve.server import build_app
    engine = AsyncEngine(model_dir)
    try:
        open_app = TestClient(build_app(engine, ServerConfig(host="0.0.0.0"), "m"))
        for path, body in (("/update_weights", {"model_dir": model_dir}), ("/sleep", None),
                           ("/update_weights_from_disk", {"model_path": model_dir}),
                           ("/release_memory_occupation", {}), ("/pause", None), ("/resume", None),
                           ("/pause_generation", {}), ("/continue_generation", None), ("/flush_cache", None),
                           ("/reset_prefix_cache", None), ("/abort_request", {"abort_all": True}),
                           ("/abort_requests", {}), ("/collective_rpc", {"method": "reset_weights"}),
                           ("/update_weight_version", {"new_version": "x"}), ("/weight_checker", {"action": "reset"}),
                           ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                                           "rank_offset": 1, "world_size": 2}),
                           ("/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": []}),
                           ("/destroy_weights_update_group", {})):
            r = open_app.post(path, json=body)  # (control endpoints too: pausing a server is not anyone's)
            assert r.status_code == 403 and "api-key" in r.json()["error"]["message"], path
        assert engine.policy_version == 0 and not engine.is_sleeping and not engine.paused
        assert engine.engine.weight_updates == 0 and engine.engine.get_weight_version() == "default"
        assert open_app.get("/weight_info").json() == {"weight_version": "default"}
        assert open_app.get("/health").status_code == 200 and open_app.get("/is_paused").status_code == 200
        keyed = TestClient(build_app(engine, ServerConfig(host="0.0.0.0", api_key="k"), "m"))
        r = keyed.post("/update_weights", json={"model_dir": model_dir}, headers={"Authorization": "Bearer k"})
        assert r.status_code == 200 and r.json()["policy_version"] == 1
        assert keyed.post("/pause", params={"mode": "keep"}, headers={"Authorization": "Bearer k"}).status_code == 200
        assert keyed.post("/resume", headers={"Authorization": "Bearer k"}).status_code == 200 and not engine.paused
        assert TestClient(build_app(engine, ServerConfig(), "m")).post("/flush_cache").status_code == 200  # loopback
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


def test_drafting_material_posted_under_a_salt_serves_that_salt_only(model_dir):
    """/spec/add_sequence (the router's way of sharing a turn served elsewhere) with a cache_salt:
    that salt's requests draft from it, another salt's do not; a bad salt is a 400 (in-process app)."""
    from fastapi.testclient import TestClient

    from rollwise.config import ServerConfig
    from rollwise.engine.async_engine import AsyncEngine
    from rollwise.serve.server import build_app
    engine = AsyncEngine(model_dir, speculative="suffix", spec_controller="always")
    try:
        app = TestClient(build_app(engine, ServerConfig(), "m"))
        req = {"input_ids": [9, 8, 7, 6, 5, 4, 3], "sampling_params": {"temperature": 0, "max_tokens": 30,
                                                                        "ignore_eos": True}}

        def drafted(salt: str) -> tuple[list[int], float]:
            before = engine.metrics()["spec_drafted_global"]
            out = app.post("/generate", json=req | {"cache_salt": salt}).json()
            return out["token_ids"], engine.metrics()["spec_drafted_global"] - before
        tokens, alone = drafted("elsewhere")
        r = app.post("/spec/add_sequence", json={"token_ids": tokens, "cache_salt": ""})
        assert r.status_code == 400 and "cache_salt must be a non-empty string" in r.json()["error"]["message"]
        assert app.post("/spec/add_sequence", json={"token_ids": tokens, "cache_salt": "s"}).json()["status"] == "ok"
        assert drafted("t") == (tokens, alone)
        ours = drafted("s")
        assert ours[0] == tokens and ours[1] > alone
    finally:
        engine.shutdown()


def test_a_prompt_lookup_server_drafts_from_each_request_alone(model_dir):
    """`rollwise serve --speculative ngram`: a repeating prompt's continuation is drafted and taken
    (the same tokens as without speculation); other requests' text posted to /spec/add_sequence is
    not its to draft from, and the reply says so."""
    from fastapi.testclient import TestClient

    from rollwise.config import ServerConfig
    from rollwise.engine.async_engine import AsyncEngine
    from rollwise.serve.server import build_app
    req = {"input_ids": [9, 8, 7, 6, 5] * 6,
           "sampling_params": {"temperature": 0, "max_tokens": 20, "ignore_eos": True}}
    plain = AsyncEngine(model_dir)
    try:
        want = TestClient(build_app(plain, ServerConfig(), "m")).post("/generate", json=req).json()["token_ids"]
    finally:
        plain.shutdown()
    engine = AsyncEngine(model_dir, speculative="ngram", spec_controller="always", spec_lookup_min=1, spec_lookup_max=3)
    try:
        app = TestClient(build_app(engine, ServerConfig(), "m"))
        assert app.post("/generate", json=req).json()["token_ids"] == want
        assert engine.metrics()["spec_drafted_ngram"] > 0
        r = app.post("/spec/add_sequence", json={"token_ids": [1, 2, 3]}).json()
        assert r == {"status": "ignored", "reason": "ngram speculation drafts from the request's own text only"}
    finally:
        engine.shutdown()


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


def test_the_openapi_schema_names_each_operation_once(client):
    """Endpoints served for GET and POST alike (vLLM's /ping, SGLang's /flush_cache, /health_generate,
    /get_weights_by_name) are an operation per method with ids of their own, as OpenAPI requires (one
    route for both gave both the same id: FastAPI warned at each /openapi.json and client generators
    refuse such a schema); both methods still answer."""
    ops = [op["operationId"] for ops in client.get("/openapi.json").json()["paths"].values() for op in ops.values()]
    assert len(ops) == len(set(ops)) > 40, sorted(o for o in ops if ops.count(o) > 1)
    for path in ("/ping", "/health_generate", "/flush_cache"):
        assert client.get(path).status_code == client.post(path).status_code == 200, path
