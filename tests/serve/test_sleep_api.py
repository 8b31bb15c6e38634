"""Sleep mode over HTTP (rollwise/serve/sleep.py): vLLM's /sleep, /wake_up, /is_sleeping and
SGLang's memory-occupation endpoints on a `rollwise serve` process, the replica clients that drive
them, and the router sleeping only idle replicas."""
from __future__ import annotations

import asyncio

import pytest

from rollwise.engine.async_engine import AsyncEngine
from rollwise.router.replica import HttpReplica, LocalReplica, ReplicaError
from rollwise.router.router import Router
from rollwise.types import GenerateRequest, SamplingParams

BODY = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}}


def _metric(client, name: str) -> float:
    return next(float(line.split()[-1]) for line in client.get("/metrics").text.splitlines() if line.startswith(name))


def test_sleep_endpoints_give_memory_back_and_serve_the_same_tokens_after(server, client, model_dir):
    before = client.post("/generate", json=BODY).json()["token_ids"]
    assert client.get("/is_sleeping").json() == {"is_sleeping": False}
    replica = HttpReplica(server.url)

    async def sleep_then_generate():
        assert await replica.sleep(1) is True
        with pytest.raises(ReplicaError, match="503"):  # the router's failover takes it elsewhere
            await replica.generate(GenerateRequest(prompt_token_ids=[5, 6], params=SamplingParams(max_tokens=2)))
        await replica.client.aclose()
    asyncio.run(sleep_then_generate())
    assert client.get("/is_sleeping").json() == {"is_sleeping": True}
    assert client.get("/health").json()["sleeping"] == ["kv_cache"] and _metric(client, "rollwise:is_sleeping") == 1
    r = client.post("/generate", json=BODY)
    assert r.status_code == 503 and r.json()["error"]["type"] == "engine_asleep"
    assert client.post("/wake_up").status_code == 200
    assert client.post("/generate", json=BODY).json()["token_ids"] == before
    # level 2: the weights wake without values; an update of every weight, then the KV pool
    assert client.post("/sleep", params={"level": 2}).status_code == 200
    assert client.post("/wake_up", params={"tags": "weights"}).status_code == 200
    assert client.get("/health").json()["sleeping"] == ["kv_cache"]
    assert client.post("/update_weights", json={"model_dir": model_dir}).status_code == 200
    got = client.post("/resume_memory_occupation", json={"tags": ["kv_cache", "cuda_graph"]}).json()
    assert got["success"] and not client.get("/is_sleeping").json()["is_sleeping"]
    assert client.post("/generate", json=BODY).json()["token_ids"] == before
    # SGLang's names: a CUDA graph alone names nothing here; no tags, both; woken weights serve nothing until loaded
    assert client.post("/release_memory_occupation", json={"tags": ["cuda_graph"]}).json()["success"]
    assert not client.get("/is_sleeping").json()["is_sleeping"]
    assert client.post("/release_memory_occupation", json={}).json()["success"]
    assert client.get("/health").json()["sleeping"] == ["kv_cache", "weights"]
    assert client.post("/resume_memory_occupation").json()["success"]
    r = client.post("/generate", json=BODY)
    assert r.status_code == 503 and "level-2" in r.json()["error"]["message"]
    assert client.post("/update_weights", json={"model_dir": model_dir}).status_code == 200
    assert client.post("/generate", json=BODY).json()["token_ids"] == before
    # bad input: named, and the server serves on
    for path, kw in (("/sleep", {"params": {"level": 3}}), ("/sleep", {"params": {"level": "x"}}),
                     ("/release_memory_occupation", {"json": {"tags": ["gpu"]}})):
        r = client.post(path, **kw)
        assert r.status_code == 400 and any(w in r.json()["error"]["message"] for w in ("level", "tags"))
    assert not client.get("/is_sleeping").json()["is_sleeping"]
    assert client.post("/generate", json=BODY).json()["token_ids"] == before


def test_the_router_sleeps_idle_replicas_only_and_wakes_them(model_dir):
    async def go():
        engines = [AsyncEngine(model_dir, kv_cache_gb=0.05) for _ in range(2)]
        router = Router([LocalReplica(f"r{i}", e) for i, e in enumerate(engines)], "least_load")
        try:
            busy = asyncio.create_task(engines[1].generate([5, 6, 7], SamplingParams(max_tokens=2000, ignore_eos=True)))
            while not engines[1].engine.seqs:
                await asyncio.sleep(0.01)
            assert await router.sleep(2) == ["r0"]  # r1 has a request in flight: it stays awake
            assert engines[0].is_sleeping and not engines[1].is_sleeping
            await router.wake_up(["r0"])
            assert not engines[0].is_sleeping and engines[0].engine.weights_lost  # (an update brings them)
            await engines[1].abort_all()
            await busy
        finally:
            await router.close()
            for e in engines:
                e.shutdown()
    asyncio.run(go())


def test_a_server_started_with_dummy_weights_serves_once_they_are_loaded(client, model_dir):
    """`rollwise serve --load-format dummy` (a launch line of verl's): 503 naming why until the weights
    come (healthy meanwhile, as SGLang's /health_generate sees it), then the checkpoint's tokens."""
    import httpx

    from rollwise.serve.process import ServerProcess
    want = client.post("/generate", json=BODY).json()["token_ids"]
    with ServerProcess(model_dir, "--load-format", "dummy") as s, httpx.Client(base_url=s.url, timeout=60) as c:
        r = c.post("/generate", json=BODY)
        assert r.status_code == 503 and "load_format 'dummy'" in r.json()["error"]["message"]
        health = c.get("/health_generate").json()
        assert health["generated"] is False and health["weights_missing"] > 0
        assert c.post("/update_weights_from_disk", json={"model_path": model_dir}).json()["success"]
        assert c.post("/generate", json=BODY).json()["token_ids"] == want
