"""vLLM's endpoints for RL frameworks (its dev-mode RLHF API), as they drive a vLLM server around a
weight update: `POST /pause?mode=abort|wait|keep` (abort: requests in flight end now with what they
have, finish reason "abort"; wait: they finish first, and requests that arrive meanwhile are held
back until /resume, when they begin under the weights loaded while paused; keep: they wait, KV
kept, and go on after /resume; `clear_cache`, default true, drops the cached prefix blocks after an abort or a wait;
`wait_for_inflight_requests=true` is the older spelling of wait), `POST /resume`, `GET /is_paused`,
and `POST /reset_prefix_cache` (SGLang's /flush_cache; not needed after a weight update here, since
cached blocks are keyed by their weights' version, but harmless). Replies as vLLM's."""
from __future__ import annotations

from typing import Literal

from fastapi import FastAPI, Query
from fastapi.responses import Response


def install_rlhf(app: FastAPI, engine) -> None:
    @app.post("/pause")
    async def pause(mode: Literal["abort", "wait", "keep"] = "abort", clear_cache: bool = True,
                    wait_for_inflight_requests: bool = Query(False)):
        mode = "wait" if wait_for_inflight_requests and mode == "abort" else mode
        await engine.pause(abort=mode == "abort", wait=mode == "wait")  # (wait: those that come meanwhile wait)
        if clear_cache and mode != "keep":
            await engine.call(engine.engine.blocks.evict_cached)
        return {"status": "paused"}

    @app.post("/resume")
    async def resume():
        await engine.resume()
        return {"status": "resumed"}

    @app.get("/is_paused")
    async def is_paused():
        return {"is_paused": engine.paused or engine.engine.scheduler.holding}  # (as vLLM's: from the drain on)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        await engine.call(engine.engine.blocks.evict_cached)
        return Response(status_code=200)
