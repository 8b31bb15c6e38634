"""SGLang's control endpoints, for RL frameworks that drive SGLang servers (e.g. AReaL, slime):
abort requests, pause and continue generation (around a weight update), load new weights from
disk, flush the prefix cache, model info.
Their bodies and replies follow SGLang's; the work is `rollwise serve`'s own."""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Literal

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from rollwise.config import ServerConfig
from rollwise.serve.protocol import AbortRequest
from rollwise.serve.responses import weights_refused


class UpdateFromDiskRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # SGLang's other options (load_format, ...) do not apply
    model_path: str
    weight_version: str | None = None  # our policy version when it is an integer; default: the next one
    abort_all_requests: bool = False  # True: requests in flight end now (finish reason "abort")


class PauseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    # abort: requests in flight end now with what they have (SGLang's default; a client resubmits
    # them with their tokens); in_place / retract: they wait, and go on after /continue_generation
    mode: Literal["abort", "in_place", "retract"] = "abort"


async def load_from_disk(body: UpdateFromDiskRequest, cfg: ServerConfig,
                         update: Callable[[str, int | None], Awaitable[int]],
                         abort_all: Callable[[], Awaitable[list[str]]]):
    """/update_weights_from_disk, on a server (`update`: its engine's) or a router (every replica):
    the weight-update rule, the version (SGLang's string; ours when an integer), SGLang's reply."""
    if refused := weights_refused(cfg):
        return refused
    version = int(body.weight_version) if body.weight_version and body.weight_version.isdigit() else None
    aborted = await abort_all() if body.abort_all_requests else []
    try:
        version = await update(body.model_path, version)
    except ValueError as e:
        return JSONResponse({"success": False, "message": str(e), "num_paused_requests": 0}, status_code=400)
    return {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0,
            "num_aborted_requests": len(aborted), "weight_version": str(version)}


def install_sglang(app: FastAPI, engine, cfg: ServerConfig) -> None:
    @app.post("/pause_generation")
    async def pause_generation(body: PauseRequest | None = None):
        aborted = await engine.pause(abort=(body or PauseRequest()).mode == "abort")
        return {"success": True, "message": "Generation paused.", "aborted": aborted}

    @app.post("/continue_generation")
    async def continue_generation():
        await engine.resume()
        return {"success": True, "message": "Generation continued."}

    @app.post("/abort_request")
    async def abort_request(body: AbortRequest):
        aborted = await engine.abort_all() if body.abort_all else [body.rid] if await engine.abort(body.rid) else []
        return {"aborted": aborted}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateFromDiskRequest):
        """Requests in flight finish under the weights they started with (unless aborted)."""
        return await load_from_disk(body, cfg, lambda path, v: engine.update_weights(path, v, False), engine.abort_all)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        """Drop every cached prefix block no request holds. (Not needed after a weight update: blocks
        are keyed by their weights' version, so old ones are never reused.)"""
        evicted = await engine.call(engine.engine.blocks.evict_cached)
        return {"success": True, "message": "Cache flushed.", "evicted_blocks": evicted}

    @app.get("/get_model_info")
    async def get_model_info():
        return {"model_path": engine.engine.config.model, "tokenizer_path": engine.engine.config.model,
                "is_generation": True, "weight_version": str(engine.policy_version)}
