"""`rollwise serve` under chaos: concurrent requests of every kind (streamed or not, n > 1 on every
API, priorities, clients that leave early) while control calls pause (three modes), resume, abort,
flush the cache and load weights. Every reply is a 200 or a 4xx with a JSON error, every stream
ends with [DONE], and the server ends idle and healthy. (Timing decides the interleaving; these hold
for all.)"""
from __future__ import annotations

import asyncio
import json
import random

import httpx

from rollwise.serve.process import ServerProcess


def test_the_server_survives_chaos(model_dir):
    rng = random.Random(0)
    bad: list = []
    seen: dict[str, int] = {}

    def check(status: int, text: str, what: str) -> None:
        try:
            ok = status == 200 or status < 500 and isinstance(json.loads(text).get("error"), dict)
        except ValueError:
            ok = False
        if not ok:
            bad.append((what, status, text[:200]))
        seen[str(status)] = seen.get(str(status), 0) + 1

    async def request(c: httpx.AsyncClient) -> None:
        kind, mt = rng.choice(["generate", "chat", "completions"]), rng.randint(1, 40)
        stream = kind != "completions" and rng.random() < 0.5
        body, path = {
            "generate": ({"input_ids": [rng.randrange(3, 900) for _ in range(rng.randint(1, 50))], "stream": stream,
                          "sampling_params": {"max_tokens": mt, "ignore_eos": True,
                                              "n": 1 if stream else rng.choice([1, 2])}}, "/generate"),
            "chat": ({"messages": [{"role": "user", "content": "hi " * rng.randint(1, 9)}], "max_tokens": mt,
                      "n": rng.choice([1, 2]), "stream": stream}, "/v1/chat/completions"),
            "completions": ({"prompt": [rng.randrange(3, 900) for _ in range(8)], "max_tokens": mt,
                             "n": rng.choice([1, 3])}, "/v1/completions")}[kind]
        body["priority"] = rng.randint(-1, 1)
        timeout = 0.05 if rng.random() < 0.15 else 60  # some clients leave early
        try:
            if stream:
                async with c.stream("POST", path, json=body, timeout=timeout) as r:
                    text = (await r.aread()).decode()
                    check(r.status_code, text, kind)
                    if r.status_code == 200 and not text.endswith("data: [DONE]\n\n"):
                        bad.append(("a stream without [DONE]", kind, text[-200:]))
            else:
                r = await c.post(path, json=body, timeout=timeout)
                check(r.status_code, r.text, kind)
        except httpx.TimeoutException:
            seen["left"] = seen.get("left", 0) + 1

    async def control(c: httpx.AsyncClient, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.sleep(0.05 + rng.random() * 0.15)
            op = rng.choice(["abort", "wait", "keep", "abort_all", "flush", "update", "pause_generation"])
            if op in ("abort", "wait", "keep"):
                calls = [("/pause", {"mode": op}, None), ("/resume", None, None)]
            elif op == "pause_generation":  # (retract: the KV dropped, and an update moves them onto it)
                calls = [("/pause_generation", None, {"mode": rng.choice(["in_place", "retract"])})]
                if rng.random() < 0.5:
                    calls.append(("/update_weights_from_disk", None, {"model_path": model_dir}))
                calls.append(("/continue_generation", None, None))
            else:
                calls = [{"abort_all": ("/abort_request", None, {"abort_all": True}),
                          "flush": ("/flush_cache", None, None),
                          "update": ("/update_weights_from_disk", None, {"model_path": model_dir})}[op]]
            for path, params, body in calls:
                r = await c.post(path, params=params, json=body, timeout=60)
                if r.status_code != 200:
                    bad.append((op, path, r.status_code, r.text[:200]))
                await asyncio.sleep(0.02)

    async def go(url: str):
        async with httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=32)) as c:
            stop = asyncio.Event()
            ctl = asyncio.ensure_future(control(c, stop))
            slots = asyncio.Semaphore(16)

            async def limited():
                async with slots:
                    await request(c)
            await asyncio.gather(*(limited() for _ in range(240)))
            stop.set()
            await ctl
            await c.post("/resume")
            await asyncio.sleep(0.3)
            return (await c.get("/metrics")).text, (await c.get("/health")).json()

    with ServerProcess(model_dir, "--max-num-seqs", "8", "--scheduling-policy", "priority",
                       "--speculative", "suffix") as s:
        metrics, health = asyncio.run(asyncio.wait_for(go(s.url), 300))
    assert not bad, bad[:5]
    assert seen.get("200", 0) > 100 and health["status"] == "ok" and not health["paused"]
    idle = [line for line in metrics.splitlines() if line.startswith(("vllm:num_requests_running{",
                                                                     "vllm:num_requests_waiting{"))]
    assert len(idle) == 2 and all(line.endswith(" 0.0") for line in idle), idle
