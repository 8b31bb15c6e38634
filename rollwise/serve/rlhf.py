"""vLLM's endpoints for RL frameworks (its dev-mode RLHF API), as they drive a vLLM server around a
weight update: `POST /pause?mode=abort|wait|keep` (abort: requests in flight end now with what they
have, finish reason "abort"; wait: they finish first; keep: they wait, KV kept, and go on after
/resume; `clear_cache`, default true, drops the cached prefix blocks after an abort or a wait;
`wait_for_inflight_requests=true` is the older spelling of wait), `POST /resume`, `GET /is_paused`,
and `POST /reset_prefix_cache` (SGLang's /flush_cache; not needed after a weight update here, since
cached blocks are keyed by their weights' version, but harmless). Replies as vLLM's."""
from __future__ import annotations

import asyncio
from typing import Literal

from fastapi import FastAPI, Query
from fastapi.responses import Response


def install_rlhf(app: FastAPI, engine) -> None:
    @app.post("/pause")
    async def pause(mode: Literal["abort", "wait", "keep"] = "abort", clear_cache: bool = True,
                    wait_for_inflight_requests: bool = Query(False)):
        mode = "wait" if wait_for_inflight_requests and mode == "abort" else mode
        if mode == "wait" and not engine.paused:  # those in flight finish (any that come meanwhile run until
            # the pause, then wait with their KV)
            ids = await engine.call(lambda: list(engine.engine.seqs))
            while ids and await engine.call(lambda: any(r in engine.engine.seqs for r in ids)):
                await asyncio.sleep(0.01)
        await engine.pause(abort=mode == "abort")
        if clear_cache and mode != "keep":
            await engine.call(engine.engine.blocks.evict_cached)
        return {"status": "paused"}

    @app.post("/resume")
    async def resume():
        await engine.resume()
        return {"status": "resumed"}

    @app.get("/is_paused")
    async def is_paused():
        return {"is_paused": engine.paused}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        await engine.call(engine.engine.blocks.evict_cached)
        return Response(status_code=200)
