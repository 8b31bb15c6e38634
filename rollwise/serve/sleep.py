"""Sleep mode over HTTP (rollwise/engine/sleep.py), as vLLM and SGLang serve it for colocated RL:
vLLM's `POST /sleep?level=1|2`, `POST /wake_up` (`?tags=weights&tags=kv_cache`: those alone) and
`GET /is_sleeping`; SGLang's `POST /release_memory_occupation` and `/resume_memory_occupation`
(`{"tags": [...]}`, none: both). The server must be idle to sleep (400 otherwise, naming a request in
flight); while it sleeps, requests get 503. Off loopback these need the API key, as weight updates do."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from rollwise.config import ServerConfig
from rollwise.serve.responses import weights_refused


class MemoryRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    tags: list[str] | None = None  # "weights", "kv_cache" (SGLang's also name "cuda_graph": nothing here)


def _tags(tags: list[str] | None) -> list[str] | None:
    """The tags that name memory here (None: all; [] when only "cuda_graph" was named: nothing to do)."""
    return None if tags is None else [t for t in tags if t != "cuda_graph"]


def install_sleep(app: FastAPI, engine, cfg: ServerConfig) -> None:
    @app.post("/sleep")
    async def sleep(request: Request):
        if refused := weights_refused(cfg):
            return refused
        level = request.query_params.get("level", "1")
        if not level.isdigit():
            raise ValueError(f"level must be 1 or 2, got {level!r}")
        await engine.sleep(int(level))
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(request: Request):
        if refused := weights_refused(cfg):
            return refused
        await engine.wake_up(request.query_params.getlist("tags") or None)
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping():
        return {"is_sleeping": engine.is_sleeping}

    @app.post("/release_memory_occupation")
    async def release_memory_occupation(body: MemoryRequest | None = None):
        if refused := weights_refused(cfg):
            return refused
        if (tags := _tags((body or MemoryRequest()).tags)) != []:
            await engine.release_memory(tags)
        return {"success": True, "message": "Memory released."}

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation(body: MemoryRequest | None = None):
        if refused := weights_refused(cfg):
            return refused
        if (tags := _tags((body or MemoryRequest()).tags)) != []:
            await engine.wake_up(tags)
        return {"success": True, "message": "Memory resumed."}
