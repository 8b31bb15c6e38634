"""vLLM's endpoints for RL frameworks (its dev-mode RLHF API), as they drive a vLLM server around a
weight update: `POST /pause?mode=abort|wait|keep` (abort: requests in flight end now with what they
have, finish reason "abort"; wait: they finish first, and requests that arrive meanwhile are held
back until /resume, when they begin under the weights loaded while paused; keep: they wait, KV
kept, and go on after /resume; `clear_cache`, default true, drops the cached prefix blocks after an abort or a wait;
`wait_for_inflight_requests=true` is the older spelling of wait), `POST /resume`, `GET /is_paused`,
and `POST /reset_prefix_cache` (SGLang's /flush_cache; not needed after a weight update here, since
cached blocks are keyed by their weights' version, but harmless). And vLLM 0.32's weight
routes: `POST /collective_rpc` (`{"method", "args", "kwargs", "timeout"}`: a worker method by name,
its own or the server's `--worker-extension-cls`'s, with JSON arguments), `GET /weight_info`,
`POST /update_weight_version`, `POST /weight_checker` (checksum, reset, compare), `GET
/get_world_size` and `POST /abort_requests`; and its weight transfer (`POST
/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights` with `{"update_info"}`,
`/finish_weight_update`, `/shutdown_weight_transfer_engine`; the gloo backend,
rollwise.engine.weight_transfer). Off loopback, every POST here needs the server started with an API
key (auth.py's CONTROL_PATHS). Replies as vLLM's."""
from __future__ import annotations

import asyncio
import json
from typing import Literal

from fastapi import FastAPI, Query
from fastapi.responses import Response
from pydantic import BaseModel, Field

from rollwise.serve.responses import error


class RpcRequest(BaseModel):
    method: str
    args: list = []
    kwargs: dict = {}
    timeout: float | None = Field(default=None, gt=0, le=86400)  # seconds


class WeightVersionRequest(BaseModel):
    new_version: str


class WeightCheckRequest(BaseModel):
    action: Literal["checksum", "reset", "compare"]
    baseline: dict[str, str] | None = None


class TransferInit(BaseModel):
    init_info: dict


class TransferFinish(BaseModel):
    weight_version: str | None = None


def json_object(raw: bytes) -> dict:
    """A request body that must be a JSON object (ValueError, a 400, otherwise)."""
    got = json.loads(raw)
    if not isinstance(got, dict):
        raise ValueError(f"the body must be a JSON object, got {type(got).__name__}")
    return got


async def receive_weights(engine, update_info) -> dict:
    """/update_weights with vLLM's `{"update_info": ...}`: this chunk's weights from the trainer's
    broadcast, received off the engine's thread (it keeps serving), taken at /finish_weight_update."""
    await asyncio.to_thread(engine.engine.receiver.receive, update_info)
    return {"message": "Weights updated"}


class AbortRequests(BaseModel):
    request_ids: list[str] | None = None  # None or empty: every request in flight


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

    @app.post("/collective_rpc")
    async def collective_rpc(body: RpcRequest):
        args, kwargs = tuple(body.args), body.kwargs
        try:
            results = await asyncio.wait_for(engine.call(
                lambda: engine.engine.collective_rpc(body.method, None, args, kwargs)), body.timeout)
        except (TypeError, OSError) as e:  # (arguments the method does not take, a file it cannot read)
            raise ValueError(f"{body.method}: {e}") from e
        except TimeoutError:
            return error(504, f"{body.method} did not return within {body.timeout} s", "timeout")
        return {"results": [r if r is None or isinstance(r, (dict, list)) else str(r) for r in results]}

    @app.get("/weight_info")
    async def weight_info():
        return {"weight_version": engine.engine.get_weight_version()}

    @app.post("/update_weight_version")
    async def update_weight_version(body: WeightVersionRequest):
        await engine.call(lambda: engine.engine.set_weight_version(body.new_version))
        return {"success": True, "new_version": body.new_version}

    @app.post("/weight_checker")
    async def weight_checker(body: WeightCheckRequest):
        """checksum: SHA-256 per weight (by its Hugging Face name); reset: every weight zeroed (a check
        of the sync that follows); compare: against `baseline` ({name: checksum})."""
        if body.action == "compare" and body.baseline is None:
            raise ValueError("action 'compare' needs a 'baseline' object")
        worker = engine.engine.worker
        if body.action == "reset":
            await engine.call(worker.reset_weights)
            return {"status": "reset"}
        sums = await engine.call(worker.compute_weight_checksums)
        if body.action == "checksum":
            return {"checksums": sums}
        bad = sorted(k for k in sums.keys() | body.baseline.keys() if sums.get(k) != body.baseline.get(k))
        return {"match": not bad, "mismatches": bad}

    @app.get("/get_world_size")
    async def get_world_size(include_dp: bool = True):
        return {"world_size": 1}  # (one process: no tensor, pipeline or data parallelism)

    @app.post("/abort_requests")
    async def abort_requests(body: AbortRequests | None = None):
        """Abort these requests (none given: every one in flight) without pausing."""
        ids = body.request_ids if body is not None else None
        aborted = await engine.abort(list(ids)) if ids else await engine.abort_all()
        return {"status": "aborted", "aborted": len(ids) if ids else len(aborted)}

    @app.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(body: TransferInit):
        await asyncio.to_thread(engine.engine.receiver.init, body.init_info)  # (the rendezvous waits for all)
        return {"message": "Weight transfer initialized"}

    @app.post("/start_weight_update")
    async def start_weight_update():
        engine.engine.receiver.start()
        return {"message": "Weight update started"}

    @app.post("/finish_weight_update")
    async def finish_weight_update(body: TransferFinish | None = None):
        version = (body or TransferFinish()).weight_version
        await engine.call(lambda: engine.engine.finish_weight_update(version, engine.retracted))
        return {"message": "Weight update finished"}

    @app.post("/shutdown_weight_transfer_engine")
    async def shutdown_weight_transfer_engine():
        engine.engine.receiver.shutdown()
        return {"message": "Weight transfer shut down"}

