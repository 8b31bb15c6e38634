"""The router on real replicas: separate `rollwise serve` processes on 127.0.0.1."""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from rollwise.agent.envs import make_env
from rollwise.agent.episode import collect
from rollwise.agent.generator import ForcedGenerator, expert_policy
from rollwise.engine.tokenizer import Tokenizer
from rollwise.router.policies import POLICIES
from rollwise.router.replica import HttpReplica
from rollwise.router.router import Router
from rollwise.serve.process import ServerProcess, free_port, log_tail, wait_for_http
from rollwise.wire import from_npy64
from rollwise.types import SamplingParams

ARGS = ("--max-num-seqs", "16", "--max-model-len", "2048")


@pytest.fixture(scope="module")
def servers(model_dir):
    with ServerProcess(model_dir, *ARGS, threads=1) as a, ServerProcess(model_dir, *ARGS, threads=1) as b:
        yield [a, b]


def run_groups(router, env_name, n_tasks, group_size, seed=0, on_start=None):
    tasks = make_env(env_name).sample_tasks(n_tasks, seed=seed)
    gen = ForcedGenerator(router, expert_policy(lambda: make_env(env_name), tasks))

    async def go():
        if on_start:
            asyncio.get_running_loop().call_later(0.3, on_start)
        out = [t async for g in collect(gen, lambda: make_env(env_name), tasks, SamplingParams(max_tokens=128),
                                        group_size=group_size, max_concurrency=64) for t in g]
        await router.close()
        return out
    return asyncio.run(go())


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_serves_episodes_on_real_replicas(servers, model_dir, policy):
    router = Router([HttpReplica(s.url) for s in servers], policy, tokenizer=Tokenizer(model_dir),
                    record_placements=True)
    trajs = run_groups(router, "calculator", n_tasks=4, group_size=3)
    assert len(trajs) == 12 and all(t.status == "done" and t.reward == 1.0 for t in trajs)
    assert sum(t.num_generated for t in trajs) == sum(t.num_generated for t in run_groups(
        Router([HttpReplica(servers[0].url)], "least_load", tokenizer=Tokenizer(model_dir)), "calculator", 4, 3))
    placed: dict[str, set] = {}
    for tid, _, _, name in router.placements:
        placed.setdefault(tid, set()).add(name)
    if policy in ("verl", "sticky_least_load", "war", "sglang_cache_aware"):
        assert all(len(v) == 1 for v in placed.values()), placed  # a trajectory stays where its context is
    if policy == "rollwise":  # moves only when the other replica's shorter batch beats recomputing the context
        assert sum(len(v) == 1 for v in placed.values()) >= 0.5 * len(placed), placed
    if policy == "round_robin":
        assert {n for v in placed.values() for n in v} == {s.url for s in servers}


def test_rollwise_keeps_siblings_together_at_low_load(servers, model_dir):
    router = Router([HttpReplica(s.url) for s in servers], "rollwise", tokenizer=Tokenizer(model_dir),
                    record_placements=True)
    run_groups(router, "sql", n_tasks=2, group_size=2, seed=3)
    by_group: dict[str, set] = {}
    for _, gid, _, name in router.placements:
        by_group.setdefault(gid, set()).add(name)
    assert all(len(v) == 1 for v in by_group.values()), by_group
    assert router.metrics()["hit_rate"] > 0.3  # siblings and later turns reuse cached prefixes


def test_failover_loses_no_trajectory(model_dir):
    a, b = ServerProcess(model_dir, *ARGS, threads=1), ServerProcess(model_dir, *ARGS, threads=1)
    try:
        rb = HttpReplica(b.url)
        send = rb.generate

        async def generate(request):  # b dies mid-step, holding trajectories whose later turns come to it
            if request.turn and b.proc.poll() is None:
                b.proc.kill()
                b.proc.wait()
            return await send(request)
        rb.generate = generate
        router = Router([HttpReplica(a.url), rb], "sticky_least_load", tokenizer=Tokenizer(model_dir),
                        health_interval_s=0.2)
        trajs = run_groups(router, "frozenlake", n_tasks=6, group_size=2)
        assert len(trajs) == 12 and all(t.status == "done" and t.reward == 1.0 for t in trajs)
        assert router.metrics()["failovers"] >= 1 and b.url not in router.healthy
    finally:
        a.stop()
        b.stop()


def start_route(servers, model_dir, policy: str, *extra: str) -> tuple[subprocess.Popen, str]:
    """`rollwise route` in front of the servers (`extra`: more of its arguments), answering /health."""
    port = free_port()
    cmd = [sys.executable, "-m", "rollwise.cli", "route", "--port", str(port), "--policy", policy,
           "--tokenizer", model_dir, *extra] + [x for s in servers for x in ("--replica", s.url)]
    log = tempfile.TemporaryFile()  # not a pipe: one nobody reads blocks a route that logs much
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_http(url + "/health", proc, 60.0, ok=lambda r: r.status_code == 200, log=log)
    except TimeoutError:
        proc.terminate()
        raise TimeoutError(f"rollwise route did not answer: {log_tail(log)}") from None
    return proc, url


def test_route_proxy_over_http(servers, model_dir, junk_failures):
    proc, url = start_route(servers, model_dir, "sticky_least_load")
    try:
        with httpx.Client(base_url=url, timeout=60) as c:
            ids, seen = [5, 6, 7, 8] * 10, set()
            for turn in range(3):
                r = c.post("/generate", json={"input_ids": ids, "turn": turn, "sampling_params": {"max_tokens": 4}},
                           headers={"X-Session-Id": "sess-1", "X-Group-Id": "g"})
                assert r.status_code == 200, r.text
                seen.add(r.json()["replica"])
                ids = ids + r.json()["token_ids"] + [9, 9]
            assert len(seen) == 1  # the session stuck to one replica
            text = c.post("/v1/completions", json={"prompt": "The agent", "max_tokens": 3}).json()
            assert text["usage"]["completion_tokens"] == 3
            body = {"prompt": "The agent", "max_tokens": 3, "seed": 2, "ignore_eos": True, "logprobs": 0}
            group = c.post("/v1/completions", json=body | {"n": 3}).json()  # n samples: seeds 2, 3, 4
            assert [ch["index"] for ch in group["choices"]] == [0, 1, 2]
            assert group["usage"]["completion_tokens"] == 9 == group["usage"]["total_tokens"] - text["usage"]["prompt_tokens"]
            alone = c.post("/v1/completions", json=body | {"seed": 3}).json()["choices"][0]
            assert alone["logprobs"]["token_ids"] == group["choices"][1]["logprobs"]["token_ids"]
            tito = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 4, "seed": 2, "n": 2, "logprobs": 1,
                                                                "ignore_eos": True}}  # vLLM's token-in-token-out API
            routed = c.post("/inference/v1/generate", json=tito).json()
            direct = httpx.post(servers[0].url + "/inference/v1/generate", json=tito, timeout=60).json()
            assert [ch["token_ids"] for ch in routed["choices"]] == [ch["token_ids"] for ch in direct["choices"]]
            for a, b in zip(routed["choices"], direct["choices"]):  # (the samples may run on other replicas, in
                for x, y in zip(a["logprobs"]["content"], b["logprobs"]["content"]):  # other batches: float noise)
                    assert x["token_id"] == y["token_id"] and x["logprob"] == pytest.approx(y["logprob"], abs=1e-4)
                    assert [e["token_id"] for e in x["top_logprobs"]] == [e["token_id"] for e in y["top_logprobs"]]
                    assert isinstance(x["rank"], int) and abs(x["rank"] - y["rank"]) <= 1  # (a near tie may flip)
            assert routed["usage"] == direct["usage"] and routed["usage"]["completion_tokens"] == 8
            score = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 1,
                                                                 "prompt_logprob_token_ids": [[6, 1], [7, 2]]}}
            routed, direct = (from_npy64(httpx.post(u + "/inference/v1/generate", json=score, timeout=60).json()[
                "prompt_token_id_logprobs"]) for u in (url, servers[0].url))
            assert routed.shape == (2, 2) and np.allclose(routed, direct, atol=1e-4)  # (a teacher's scores, routed)
            tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
                "type": "object", "properties": {"q": {"type": "string", "maxLength": 4}}, "required": ["q"],
                "additionalProperties": False}}}]
            chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "tools": tools,
                                                        "tool_choice": "required", "max_tokens": 40, "seed": 4}).json()
            assert chat["choices"][0]["finish_reason"] == "tool_calls", chat  # held to a call, through the route
            assert chat["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "lookup"
            resp = c.post("/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 5}).json()
            assert resp["object"] == "response" and resp["usage"]["output_tokens"] <= 5  # the Responses API too
            msg = c.post("/v1/messages", json={"model": "m", "max_tokens": 5, "messages": [  # and Anthropic's
                {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}).json()
            assert msg["type"] == "message" and msg["content"][0]["type"] == "text"
            assert msg["usage"]["output_tokens"] <= 5
            assert c.post("/v1/messages/count_tokens", json={"model": "m", "messages": [
                {"role": "user", "content": "hi"}]}).json()["input_tokens"] == msg["usage"]["input_tokens"]
            # a priority goes through to the replicas, whose FCFS policy refuses it (a 400, as theirs)
            for path, body in (("/generate", {"input_ids": [5, 6], "priority": 2}),
                               ("/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "priority": 2}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                         "priority": 2})):
                r = c.post(path, json=body)
                assert r.status_code == 400 and "scheduling_policy" in r.json()["error"]["message"], (path, r.text)
                # so does a cache_salt, which their engines check
                r = c.post(path, json={k: v for k, v in body.items() if k != "priority"} | {"cache_salt": ""})
                assert r.status_code == 400 and "cache_salt must be" in r.json()["error"]["message"], (path, r.text)
                assert c.post(path, json={k: v for k, v in body.items() if k != "priority"} | {
                    "cache_salt": "tenant"}).status_code == 200, path
            for bad in ({"input_ids": "x"}, {"input_ids": []}, {"input_ids": [1], "sampling_params": {"max_tokens": -1}},
                        {"input_ids": [1], "bogus": 1}, {"prompt": "text"}, {"input_ids": [10**9]}):
                r = c.post("/generate", json=bad)
                assert r.status_code == 400 and "message" in r.json()["error"], (bad, r.text)
            # the stop token that ended a reply comes through the router as the replica's stop_reason
            greedy = {"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                      "return_token_ids": True}
            ids = httpx.post(servers[0].url + "/v1/completions", json=greedy).json()["choices"][0]["token_ids"]
            stop = greedy | {"stop_token_ids": [ids[3]]}
            direct = httpx.post(servers[0].url + "/v1/completions", json=stop).json()["choices"][0]
            routed = c.post("/v1/completions", json=stop).json()["choices"][0]
            assert routed["stop_reason"] == direct["stop_reason"] == ids[3] and routed["text"] == direct["text"]
            # top logprobs come through the router: the replica's own, as token ids
            top = {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "ignore_eos": True, "logprobs": 2}
            direct = httpx.post(servers[0].url + "/v1/completions", json=top | {"return_tokens_as_token_ids": True})
            routed = c.post("/v1/completions", json=top | {"return_tokens_as_token_ids": True}).json()
            assert [list(t) for t in routed["choices"][0]["logprobs"]["top_logprobs"]] == \
                [list(t) for t in direct.json()["choices"][0]["logprobs"]["top_logprobs"]]
            gen = c.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {
                "temperature": 0, "max_tokens": 3, "ignore_eos": True, "logprobs": 2}}).json()
            assert [[t for t, _ in x] for x in gen["top_logprobs"]] == \
                [[int(k.split(":")[1]) for k in t] for t in routed["choices"][0]["logprobs"]["top_logprobs"]]
            # SGLang's n: a list of n replies, each the tokens its seed gives on a replica
            par = {"input_ids": [5, 6, 7], "sampling_params": {"max_tokens": 3, "seed": 3, "ignore_eos": True, "n": 2}}
            outs = c.post("/generate", json=par).json()
            one = {**par, "sampling_params": {**par["sampling_params"], "n": 1}}
            alone = [httpx.post(servers[0].url + "/generate", json={**one, "sampling_params": {
                **one["sampling_params"], "seed": 3 + j}}, timeout=60).json()["token_ids"] for j in range(2)]
            assert [o["index"] for o in outs] == [0, 1] and [o["token_ids"] for o in outs] == alone
            assert c.get("/health_generate").json() == {"status": "ok", "replicas_ok": 2, "healthy": 2}
            batch = c.post("/generate", json={"input_ids": [[5, 6, 7], [5, 6, 7]], "rid": ["r0", "r1"],  # batch form
                                              "sampling_params": [{**one["sampling_params"], "seed": 3 + j}
                                                                  for j in range(2)]}).json()
            assert [o["token_ids"] for o in batch] == alone and [o["meta_info"]["id"] for o in batch] == ["r0", "r1"]
            # prompt logprobs and echo come through the router: the replica's own
            pl = {"input_ids": [5, 6, 7, 8, 9], "sampling_params": {"temperature": 0, "max_tokens": 2, "prompt_logprobs": 1}}
            direct = httpx.post(servers[0].url + "/generate", json=pl, timeout=60).json()
            routed = c.post("/generate", json=pl).json()
            assert routed["prompt_logprobs"] == pytest.approx(direct["prompt_logprobs"], abs=1e-5)
            assert routed["prompt_logprob_ranks"] == direct["prompt_logprob_ranks"]
            assert direct["prompt_logprob_ranks"][0] is None and min(direct["prompt_logprob_ranks"][1:]) >= 1
            assert routed["prompt_top_logprobs"][1:] == [[[t, pytest.approx(v, abs=1e-5)] for t, v in x]
                                                         for x in direct["prompt_top_logprobs"][1:]]
            echo = {"prompt": "The agent", "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}
            direct = httpx.post(servers[0].url + "/v1/completions", json=echo, timeout=60).json()["choices"][0]
            routed = c.post("/v1/completions", json=echo).json()["choices"][0]
            assert routed["text"] == direct["text"] and routed["logprobs"]["tokens"] == direct["logprobs"]["tokens"]
            assert routed["logprobs"]["token_logprobs"] == pytest.approx(direct["logprobs"]["token_logprobs"], abs=1e-5)
            # chat through the router: the replica's own reply, token for token; n seeded samples; a stop string
            msgs = [{"role": "user", "content": "Find the agent"}]
            greedy = {"temperature": 0, "max_tokens": 12}
            reply = httpx.post(servers[0].url + "/v1/chat/completions", json={"messages": msgs, **greedy},
                               timeout=60).json()["choices"][0]["message"]["content"]
            # the last: a piece of the greedy reply as a stop string (the replica stops there, the router cuts it)
            for extra in (greedy, {"seed": 4, "n": 2, "max_tokens": 8, "ignore_eos": True},
                          greedy | {"stop": [reply.strip()[2:4]]}):
                chat = {"messages": msgs, "logprobs": True, **extra}
                want = httpx.post(servers[0].url + "/v1/chat/completions", json=chat, timeout=60).json()
                got = c.post("/v1/chat/completions", json=chat, headers={"X-Session-Id": "chat-1"}).json()
                assert [ch["message"] for ch in got["choices"]] == [ch["message"] for ch in want["choices"]], extra
                assert [[t["token_id"] for t in ch["logprobs"]["content"]] for ch in got["choices"]] == \
                    [[t["token_id"] for t in ch["logprobs"]["content"]] for ch in want["choices"]]
                assert [ch["finish_reason"] for ch in got["choices"]] == [ch["finish_reason"] for ch in want["choices"]]
                assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
            assert got["choices"][0]["finish_reason"] == "stop" and extra["stop"][0] not in got["choices"][0]["message"]["content"]
            ids_chat = {"messages": msgs, "temperature": 0, "max_tokens": 6, "return_token_ids": True}
            want = httpx.post(servers[0].url + "/v1/chat/completions", json=ids_chat, timeout=60).json()
            got = c.post("/v1/chat/completions", json=ids_chat).json()
            assert got["prompt_token_ids"] == want["prompt_token_ids"]
            assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
            # truncate_prompt_tokens: the router cuts the prompt (chat's rendered ids too) as a replica does
            for path, cut in (("/v1/chat/completions", ids_chat),
                              ("/v1/completions", echo | {"return_token_ids": True})):
                cut = cut | {"truncate_prompt_tokens": 2}
                want = httpx.post(servers[0].url + path, json=cut, timeout=60).json()
                got = c.post(path, json=cut).json()
                assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"] == 2, path
                assert got["choices"][0].get("text") == want["choices"][0].get("text")  # echo: the 2 tokens kept
            assert c.post("/v1/completions", json=echo | {"truncate_prompt_tokens": 0}).status_code == 400
            assert c.post("/v1/chat/completions", json={"messages": msgs, "top_logprobs": 2}).status_code == 400
            assert c.post("/generate", content=b"{oops", headers={"content-type": "application/json"}).status_code == 400
            assert c.get("/v1/models").json() == httpx.get(servers[0].url + "/v1/models").json()
            assert c.get("/replicas").json()["replicas"] == sorted(s.url for s in servers)
            assert c.request("DELETE", "/replicas", json={"url": servers[1].url}).json()["replicas"] == [servers[0].url]
            assert c.request("DELETE", "/replicas", json={"url": "http://nowhere"}).status_code == 400
            assert c.post("/replicas", json={"url": servers[1].url}).json() == {
                "replicas": sorted(s.url for s in servers), "healthy": True}
            for junk in ("not a url", "ftp://x", "http://", "http://[::1"):  # refused: never a member
                r = c.post("/replicas", json={"url": junk})
                assert r.status_code == 400 and "http(s)://HOST[:PORT]" in r.json()["error"]["message"], junk
            # a server that does not answer yet joins unhealthy (routed to once it answers /health)
            assert c.post("/replicas", json={"url": "http://127.0.0.1:9"}).json()["healthy"] is False
            listed = c.get("/replicas").json()
            assert len(listed["replicas"]) == 3 and listed["healthy"] == sorted(s.url for s in servers)
            r = c.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_tokens": 2}})
            assert r.status_code == 200
            c.request("DELETE", "/replicas", json={"url": "http://127.0.0.1:9"})
            from prometheus_client.parser import text_string_to_metric_families  # (the page parses)
            families = {f.name: f for f in text_string_to_metric_families(c.get("/metrics").text)}
            assert families["rollwise_router:requests"].samples[0].value > 0
            for path in ("/generate", "/v1/chat/completions", "/inference/v1/generate"):  # a replica's 400: a 400
                assert junk_failures(c, path) == [], path
            assert c.get("/replicas").json()["healthy"] == sorted(s.url for s in servers)  # none blamed for it
            assert c.get("/health").json()["status"] == "ok"
        # after all of that, the route's process has not loaded torch (a start of 0.7 s, not 2.3; 76 MB, not 280)
        assert "libtorch" not in Path(f"/proc/{proc.pid}/maps").read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _events(client, path, body) -> list[dict]:
    with client.stream("POST", path, json=body | {"stream": True}) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]


def test_streaming_through_the_route(servers, model_dir):
    """/generate, completions (n samples) and chat streamed through `rollwise route`: the pieces add
    up to what the route returns unstreamed, text cut at a stop string included."""
    proc, url = start_route(servers, model_dir, "rollwise")
    try:
        with httpx.Client(base_url=url, timeout=60) as c:
            gen = {"input_ids": [5, 6, 7, 8], "sampling_params": {"temperature": 0, "max_tokens": 40, "ignore_eos": True,
                                                                  "logprobs": 2}}
            whole = c.post("/generate", json=gen).json()
            chunks = _events(c, "/generate", gen)
            assert len(chunks) > 1 and [t for ch in chunks for t in ch["token_ids"]] == whole["token_ids"]
            assert [t for ch in chunks for t in ch.get("top_logprobs", [])] == whole["top_logprobs"]
            assert chunks[-1]["finished"] and chunks[-1]["finish_reason"] == "length"
            cmpl = {"prompt": [5, 6, 7], "max_tokens": 30, "seed": 3, "n": 2, "ignore_eos": True, "logprobs": 0}
            whole = c.post("/v1/completions", json=cmpl).json()["choices"]
            chunks = _events(c, "/v1/completions", cmpl | {"stream_options": {"include_usage": True}})
            assert chunks[-1]["usage"]["completion_tokens"] == 60 and chunks[-1]["usage"]["prompt_tokens"] == 3
            chunks = chunks[:-1]
            for j in range(2):
                mine = [ch["choices"][0] for ch in chunks if ch["choices"][0]["index"] == j]
                assert [t for m in mine for t in m["logprobs"]["token_ids"]] == whole[j]["logprobs"]["token_ids"]
                assert "".join(m["text"] for m in mine) == whole[j]["text"] and mine[-1]["finish_reason"] == "length"
            msgs = [{"role": "user", "content": "Find the agent"}]
            chat = {"messages": msgs, "temperature": 0, "max_tokens": 16}
            reply = c.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]
            chat["stop"] = [reply.strip()[3:5]]
            whole = c.post("/v1/chat/completions", json=chat).json()["choices"][0]
            chunks = _events(c, "/v1/chat/completions", chat)
            assert "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks) == whole["message"]["content"]
            assert chunks[-1]["choices"][0]["finish_reason"] == whole["finish_reason"] == "stop"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _replica_metric(server, name: str) -> float:
    return sum(float(ln.split()[-1]) for ln in httpx.get(server.url + "/metrics").text.splitlines()
               if ln.startswith(name + "{"))


@pytest.mark.parametrize("path,body", [
    ("/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_tokens": 2000, "ignore_eos": True}}),
    # n > 1: each choice's turn in a task of its own. Their closing (the replica's connection) was
    # cancelled again and again with the request's task, and the replicas generated on for nobody
    ("/inference/v1/generate", {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 2000, "ignore_eos": True,
                                                                          "n": 2}}),
    ("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2000, "ignore_eos": True, "n": 3})])
def test_a_client_leaving_the_route_aborts_the_replica_request(servers, model_dir, path, body):
    """The router's client disconnects: the router cancels the turn, which closes its request to
    the replica, which aborts it there. (Streamed, so that the client leaves once tokens come: a
    reply cut off after a fixed wait could leave before a busy replica's first token.)"""
    proc, url = start_route(servers, model_dir, "round_robin")
    try:
        before = sum(_replica_metric(s, "vllm:generation_tokens_total") for s in servers)
        body = {**body, "stream": True}
        with httpx.stream("POST", url + path, json=body, timeout=30) as r:
            assert r.status_code == 200
            next(line for line in r.iter_lines() if line.startswith("data: {"))  # (then the client leaves)
        for _ in range(100):
            if all(_replica_metric(s, "vllm:num_requests_running") == 0 for s in servers):
                break
            time.sleep(0.05)
        assert all(_replica_metric(s, "vllm:num_requests_running") == 0 for s in servers)
        assert 0 < sum(_replica_metric(s, "vllm:generation_tokens_total") for s in servers) - before < 1000
        after = {"input_ids": [5], "sampling_params": {"max_tokens": 3, "ignore_eos": True}}  # (unseeded: EOS ~1%)
        r = httpx.post(url + "/generate", json=after, timeout=30)
        assert r.status_code == 200 and len(r.json()["token_ids"]) == 3
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_vllm_weight_routes_through_the_route(servers, model_dir):
    """vLLM 0.32's weight routes on the route reach every replica: collective_rpc's results one per
    replica, the weights' label set on each, checksums compared across them; a replica's 400 is the
    route's, naming it."""
    proc, url = start_route(servers, model_dir, "round_robin")
    try:
        got = httpx.post(url + "/collective_rpc", json={"method": "compute_weight_checksums"}).json()["results"]
        assert len(got) == 2 and got[0] == got[1] and len(got[0]) > 0  # (the same checkpoint on both)
        assert httpx.post(url + "/weight_checker", json={"action": "checksum"}).json() == \
            {"checksums": got[0], "agree": True}
        assert httpx.post(url + "/weight_checker", json={"action": "compare", "baseline": got[0]}).json() == \
            {"match": True, "mismatches": []}
        first = sorted(got[0])[0]
        off = httpx.post(url + "/weight_checker", json={"action": "compare", "baseline": {**got[0], first: "x"}})
        assert off.json() == {"match": False, "mismatches": [first]}
        before = [httpx.get(s.url + "/weight_info").json()["weight_version"] for s in servers]
        r = httpx.post(url + "/update_weight_version", json={"new_version": "route-1"})
        assert r.json() == {"success": True, "new_version": "route-1", "replicas": 2}
        assert [httpx.get(s.url + "/weight_info").json() for s in servers] == [{"weight_version": "route-1"}] * 2
        assert httpx.get(url + "/weight_info").json() == {"weight_version": "route-1", "agree": True}
        httpx.post(servers[1].url + "/update_weight_version", json={"new_version": "other"})
        assert httpx.get(url + "/weight_info").json()["agree"] is False
        for s, v in zip(servers, before):
            httpx.post(s.url + "/update_weight_version", json={"new_version": v})
        assert httpx.get(url + "/get_world_size").json() == {"world_size": 2}
        assert httpx.get(url + "/get_world_size", params={"include_dp": "false"}).json() == {"world_size": 1}
        bad = httpx.post(url + "/collective_rpc", json={"method": "nope"})
        assert bad.status_code == 400 and any(s.url in bad.json()["error"]["message"] for s in servers)
        assert httpx.post(url + "/abort_requests", json={}).json() == {"status": "aborted", "aborted": 0}
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_abort_request_through_the_route(servers, model_dir):
    """/abort_request on the route reaches the replica running the request; the routed caller gets
    what it has, finish reason "abort"."""
    proc, url = start_route(servers, model_dir, "round_robin")
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            call = pool.submit(httpx.post, url + "/generate", timeout=60, json={
                "input_ids": [5, 6, 7], "rid": "r-abort", "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}})
            for _ in range(200):
                if sum(_replica_metric(s, "vllm:num_requests_running") for s in servers) >= 1:
                    break
                time.sleep(0.02)
            assert httpx.post(url + "/abort_request", json={"rid": "r-abort"}).json() == {"aborted": ["r-abort"]}
            got = call.result().json()
        assert got["finish_reason"] == "abort" and 0 < len(got["token_ids"]) < 2000
        # pause and continue reach every replica
        assert httpx.post(url + "/pause_generation", json={"mode": "in_place"}).json()["replicas"] == 2
        assert all(httpx.get(s.url + "/health").json()["paused"] for s in servers)
        assert httpx.post(url + "/continue_generation").json()["replicas"] == 2
        assert not any(httpx.get(s.url + "/health").json()["paused"] for s in servers)
        assert httpx.post(url + "/pause", params={"mode": "keep"}).json() == {"status": "paused", "replicas": 2}
        assert all(httpx.get(s.url + "/is_paused").json()["is_paused"] for s in servers)  # vLLM's names too
        assert httpx.get(url + "/is_paused").json() == {"is_paused": True, "replicas": 2}
        assert httpx.post(url + "/resume").json() == {"status": "resumed", "replicas": 2}
        assert not any(httpx.get(s.url + "/is_paused").json()["is_paused"] for s in servers)
        assert httpx.get(url + "/is_paused").json()["is_paused"] is False
        # a drain (/pause?mode=wait) reaches the replicas at once: both drain together, each finishing its own
        # request (one after the other, the second would still be serving while the first drained)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            long = {"max_new_tokens": 600, "ignore_eos": True}
            calls = [pool.submit(httpx.post, url + "/generate", timeout=60,
                                 json={"input_ids": [5, 6, i], "sampling_params": long}) for i in (7, 8)]
            for _ in range(500):
                if all(_replica_metric(s, "vllm:num_requests_running") == 1 for s in servers):
                    break
                time.sleep(0.01)
            drain = pool.submit(httpx.post, url + "/pause", params={"mode": "wait"}, timeout=60)
            together = False
            while not drain.done() and not together:
                together = all(httpx.get(s.url + "/is_paused").json()["is_paused"]
                               and _replica_metric(s, "vllm:num_requests_running") == 1 for s in servers)
            assert together and drain.result().json() == {"status": "paused", "replicas": 2}
            assert [len(c.result().json()["token_ids"]) for c in calls] == [600, 600]
        assert httpx.post(url + "/resume").json()["replicas"] == 2
        # so does a cache flush (SGLang's /flush_cache, vLLM's /reset_prefix_cache): a prefix cached on
        # both replicas is cached on neither after it
        again = {"input_ids": list(range(100, 150)), "sampling_params": {"max_new_tokens": 1}}
        for s in servers:
            httpx.post(s.url + "/generate", json=again)
        assert all(httpx.post(s.url + "/generate", json=again).json()["num_cached_tokens"] == 48 for s in servers)
        flushed = httpx.post(url + "/flush_cache").json()
        assert flushed["replicas"] == 2 and flushed["evicted_blocks"] >= 6
        assert all(httpx.post(s.url + "/generate", json=again).json()["num_cached_tokens"] == 0 for s in servers)
        r = httpx.post(url + "/reset_prefix_cache")
        assert r.status_code == 200 and not r.content
        assert all(httpx.post(s.url + "/generate", json=again).json()["num_cached_tokens"] == 0 for s in servers)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_openai_replica_speaks_token_ids_through_completions(servers, model_dir):
    """The OpenAI-API replica (for vLLM/SGLang) against our own server: same tokens as /generate."""
    from rollwise.router.openai_replica import OpenAIReplica
    from rollwise.types import GenerateRequest

    async def go():
        req = GenerateRequest(prompt_token_ids=[11, 12, 13, 14], params=SamplingParams(temperature=0, max_tokens=6,
                                                                                       ignore_eos=True, logprobs=2))
        a = await OpenAIReplica(servers[0].url, "m").generate(req)
        b = await HttpReplica(servers[0].url).generate(req)
        load = await OpenAIReplica(servers[0].url, "m").load()
        # penalties are forwarded by both clients
        pen = dataclasses.replace(req, params=SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                             repetition_penalty=1.5, frequency_penalty=0.5))
        pa, pb = [await r.generate(pen) for r in (OpenAIReplica(servers[0].url, "m"), HttpReplica(servers[0].url))]
        plain = await HttpReplica(servers[0].url).generate(dataclasses.replace(
            pen, params=dataclasses.replace(pen.params, repetition_penalty=1.0, frequency_penalty=0.0)))
        assert pa.token_ids == pb.token_ids != plain.token_ids
        # so are logit_bias and allowed_token_ids
        biased = dataclasses.replace(req, params=SamplingParams(temperature=0, max_tokens=5, logit_bias={9: 100.0}))
        allowed = dataclasses.replace(req, params=SamplingParams(max_tokens=8, seed=1, allowed_token_ids=[30, 31]))
        for r in (OpenAIReplica(servers[0].url, "m"), HttpReplica(servers[0].url)):
            assert (await r.generate(biased)).token_ids == [9] * 5
            assert set((await r.generate(allowed)).token_ids) <= {30, 31}
        # and structured outputs (vLLM's `structured_outputs` field; /generate's sampling_params)
        choice = dataclasses.replace(req, params=SamplingParams(max_tokens=8, seed=1,
                                                                structured_outputs={"choice": ["yes", "no"]}))
        got = [await r.generate(choice) for r in (OpenAIReplica(servers[0].url, "m"), HttpReplica(servers[0].url))]
        assert got[0].token_ids == got[1].token_ids and got[0].finish_reason == "stop"
        assert Tokenizer(model_dir).decode(got[0].token_ids) in ("yes", "no")
        # and vLLM's repetition_detection: a looping greedy reply ends early, at the same token
        rule = {"max_pattern_size": 8, "min_count": 3}
        loop = GenerateRequest(prompt_token_ids=Tokenizer(model_dir).encode("hello world"), params=SamplingParams(
            temperature=0, max_tokens=120, ignore_eos=True, repetition_detection=rule))
        cut = [await r.generate(loop) for r in (OpenAIReplica(servers[0].url, "m"), HttpReplica(servers[0].url))]
        assert cut[0].token_ids == cut[1].token_ids and len(cut[0].token_ids) < 120
        assert [c.finish_reason for c in cut] == ["repetition"] * 2
        # and its thinking_token_budget: a block the prompt opened is closed after the budget, by both
        tok = Tokenizer(model_dir)
        think = GenerateRequest(prompt_token_ids=tok.encode("question <think> x y"), params=SamplingParams(
            temperature=0, max_tokens=12, ignore_eos=True, thinking_token_budget=6))
        closed = [await r.generate(think) for r in (OpenAIReplica(servers[0].url, "m"), HttpReplica(servers[0].url))]
        assert closed[0].token_ids == closed[1].token_ids and tok.encode("</think>")[-1] in closed[0].token_ids
        # and its logprob_token_ids: those tokens' logprobs at every position, the same through both APIs
        scored = dataclasses.replace(req, params=SamplingParams(temperature=0, max_tokens=4,
                                                                logprob_token_ids=[40, 41]))
        got = [await r.generate(scored) for r in (OpenAIReplica(servers[0].url, "m"), HttpReplica(servers[0].url))]
        assert [list(t) for t in got[0].top_logprobs] == [list(t) for t in got[1].top_logprobs] == [[40, 41]] * 4
        assert [v for t in got[0].top_logprobs for v in t.values()] == pytest.approx(
            [v for t in got[1].top_logprobs for v in t.values()], abs=1e-4)
        # streamed: the pieces add up to the whole, through either API
        for r in (OpenAIReplica(servers[0].url, "m"), HttpReplica(servers[0].url)):
            pieces = [p async for p in r.stream(req)]
            assert len(pieces) > 1 and [t for p in pieces for t in p.token_ids] == b.token_ids
            assert [x for p in pieces for x in p.logprobs] == pytest.approx(b.logprobs, abs=1e-4)
            assert [t for p in pieces for t in p.top_logprobs] == b.top_logprobs or isinstance(r, OpenAIReplica)
            assert pieces[-1].finish_reason == "length" and all(p.finish_reason is None for p in pieces[:-1])
        return a, b, load
    a, b, load = asyncio.run(go())
    assert a.token_ids == b.token_ids and len(a.token_ids) == 6 and a.finish_reason == "length"
    assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4) and load.busy_s is not None
    assert len(b.top_logprobs) == 6 and [list(t) for t in a.top_logprobs] == [list(t) for t in b.top_logprobs]
    assert [next(iter(t)) for t in b.top_logprobs] == b.token_ids  # greedy: the best is the token


def test_n_samples_through_the_route_survive_a_replica_dying(model_dir):
    """`n` fans out as n router requests; a replica killed while it generates some of them: each of
    those is retried on the other, and every choice still equals its seed (seed + j) alone."""
    a, b = ServerProcess(model_dir, *ARGS, threads=1), ServerProcess(model_dir, *ARGS, threads=1)
    proc, url = start_route([a, b], model_dir, "round_robin")  # the samples go to both
    body = {"prompt": "The agent", "max_tokens": 300, "seed": 10, "ignore_eos": True, "logprobs": 0}
    try:
        with httpx.Client(base_url=url, timeout=120) as c:
            def kill_b_once_busy():
                while b.proc.poll() is None:
                    running = [ln for ln in httpx.get(b.url + "/metrics").text.splitlines()
                               if ln.startswith("vllm:num_requests_running")]
                    if running and float(running[0].split()[-1]) > 0:
                        b.proc.kill()
                        return
                    time.sleep(0.01)
            killer = threading.Thread(target=kill_b_once_busy)
            killer.start()
            group = c.post("/v1/completions", json=body | {"n": 4})
            killer.join()
            assert group.status_code == 200, group.text
            choices = group.json()["choices"]
            assert [ch["index"] for ch in choices] == [0, 1, 2, 3]
            assert all(len(ch["logprobs"]["token_ids"]) == 300 for ch in choices)
            failovers = [x for x in c.get("/metrics").text.splitlines() if x.startswith("rollwise_router:failovers ")]
            assert float(failovers[0].split()[-1]) >= 1
            for j, ch in enumerate(choices):  # now all on a: the same tokens as that seed alone
                alone = c.post("/v1/completions", json=body | {"seed": 10 + j}).json()["choices"][0]
                assert alone["logprobs"]["token_ids"] == ch["logprobs"]["token_ids"], j
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        a.stop()
        b.stop()


def test_weights_through_the_route(model_dir):
    """/update_weights (and SGLang's /update_weights_from_disk) on the route reach every replica; a
    directory no replica can read is the request's fault: 400, and the replicas stay in routing."""
    with ServerProcess(model_dir, *ARGS, threads=1) as a:
        proc, url = start_route([a], model_dir, "round_robin")
        try:
            with httpx.Client(base_url=url, timeout=60) as c:
                got = c.post("/update_weights", json={"model_dir": model_dir}).json()
                assert got["policy_version"] == 1 and got["replicas"] == {a.url: 1}
                assert httpx.get(a.url + "/health").json()["policy_version"] == 1
                bad = c.post("/update_weights", json={"model_dir": "/nonexistent"})
                assert bad.status_code == 400 and "refused" in bad.json()["error"]["message"]
                assert c.get("/replicas").json()["healthy"] == [a.url]
                assert c.post("/generate", json={"input_ids": [5], "sampling_params": {"max_tokens": 2}}).status_code == 200
                got = c.post("/update_weights_from_disk", json={"model_path": model_dir}).json()
                assert got["success"] is True and got["weight_version"] == "2"
                assert c.post("/update_weights_from_disk", json={"model_path": "/nonexistent"}).json()["success"] is False
                # sleep mode through the route: the replica sleeps, out of routing; a request waits for it
                assert c.post("/sleep", params={"level": 1}).json()["asleep"] == [a.url]
                sleeping = lambda: httpx.get(a.url + "/is_sleeping").json()["is_sleeping"]  # noqa: E731
                assert sleeping() and c.get("/is_sleeping").json()["asleep"] == [a.url]
                body = {"input_ids": [5], "sampling_params": {"max_tokens": 2}}
                with concurrent.futures.ThreadPoolExecutor(1) as pool:
                    late = pool.submit(httpx.post, url + "/generate", json=body, timeout=60)
                    time.sleep(1.5)  # (the route's health loop runs every second: it leaves a sleeper out)
                    assert not late.done() and c.get("/replicas").json()["healthy"] == []
                    assert c.post("/wake_up").json()["woken"] == [a.url]
                    assert late.result().status_code == 200 and not sleeping()
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def test_weight_transfer_through_the_route(model_dir, tmp_path):
    """vLLM 0.32's weight transfer through the route: each replica joins the trainer's gloo group at
    its own rank, every weight reaches both in one broadcast each, and each takes them as one update;
    one that refuses an update (its weights asleep) calls it off for both."""
    from safetensors.torch import load_file

    from rollwise.engine.weight_transfer import GlooTrainer, HTTPWeightSyncClient
    from rollwise.make_model import make_model
    other = make_model(tmp_path / "other", family="qwen3", layers=2, hidden=64, heads=4, kv_heads=2, vocab=1024,
                       std=0.1, seed=7, tie=True, head_dim=32)
    body = {"input_ids": [5, 6, 7], "sampling_params": {"temperature": 0, "max_tokens": 8, "ignore_eos": True}}
    with ServerProcess(str(other), *ARGS, threads=1) as ref:
        expected = httpx.post(ref.url + "/generate", json=body).json()["token_ids"]
    with ServerProcess(model_dir, *ARGS, threads=1) as a, ServerProcess(model_dir, *ARGS, threads=1) as b:
        proc, url = start_route([a, b], model_dir, "round_robin")
        try:
            world = httpx.get(url + "/get_world_size").json()["world_size"]
            trainer = GlooTrainer([HTTPWeightSyncClient(url)], free_port(), world_sizes=[world])
            state = load_file(str(other / "model.safetensors"))
            trainer.send_weights(state, weight_version="step-1")
            assert httpx.get(a.url + "/weight_info").json() == {"weight_version": "step-1"}
            assert httpx.post(b.url + "/release_memory_occupation", json={"tags": ["weights"]}).json()["success"]
            with pytest.raises(ValueError, match="before any weight went.*asleep"):  # b refuses: a takes nothing
                trainer.send_weights(state, weight_version="step-2")
            assert httpx.get(a.url + "/health").json()["policy_version"] == 1
            assert httpx.get(a.url + "/weight_info").json() == {"weight_version": "step-1"}
            assert httpx.post(b.url + "/resume_memory_occupation", json={"tags": ["weights"]}).json()["success"]
            trainer.send_weights(state, weight_version="step-2")  # (b, its weights given back, takes every one)
            for s in (a, b):
                assert httpx.post(s.url + "/generate", json=body).json()["token_ids"] == expected
                assert httpx.get(s.url + "/health").json()["policy_version"] == 2
                assert httpx.get(s.url + "/weight_info").json() == {"weight_version": "step-2"}
            assert httpx.post(url + "/start_weight_update").status_code == 200
            again = httpx.post(url + "/start_weight_update")  # (one under way on every replica: a replica's 400)
            assert again.status_code == 400 and "under way" in again.json()["error"]["message"]
            assert httpx.post(url + "/finish_weight_update").json()["replicas"] == 2
            trainer.close()
            bad = httpx.post(url + "/update_weights", json={"update_info": {"names": 5}})
            assert bad.status_code == 400 and "update_info" in bad.json()["error"]["message"]
        finally:
            proc.terminate()
            proc.wait(timeout=10)
