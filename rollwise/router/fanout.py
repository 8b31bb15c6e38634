"""`rollwise route`'s control routes that every replica answers, each forwarded to every healthy
replica at once (a drain lasts the longest replica's, not their sum): vLLM's RL routes (`/pause`,
`/resume`, `/is_paused`; `/collective_rpc`, `/weight_info`, `/update_weight_version`,
`/weight_checker`, `/get_world_size`, `/abort_requests`; the weight transfer's routes: serve/rlhf.py),
with vLLM's replies gathered as its multi-worker engine gathers its workers' (collective_rpc's
results one per worker, in the replicas' order; the trainer's group joined by replica i at the
rank_offset given plus i)."""
from __future__ import annotations

import asyncio

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rollwise.router.router import Router
from rollwise.serve.responses import error
from rollwise.serve.rlhf import (AbortRequests, RpcRequest, TransferInit, WeightCheckRequest, WeightVersionRequest,
                                 json_object)


async def replies(router: Router, path: str, body, method: str = "POST") -> list[tuple[str, object]]:
    """`path` on every healthy replica at once: (replica, its httpx.Response or the error that stood in
    for one), in the replicas' order. `body`: one for all, or a function of the replica's index."""
    async def one(i: int, name: str):
        client = getattr(router.replicas.get(name), "client", None)
        if client is None:
            return name, RuntimeError(f"{name} takes no HTTP control calls")
        try:
            return name, await client.request(method, path, json=body(i) if callable(body) else body,
                                              timeout=None if path in _WAITING else httpx.USE_CLIENT_DEFAULT)
        except httpx.HTTPError as e:
            return name, e
    return list(await asyncio.gather(*(one(i, n) for i, n in enumerate(sorted(router.healthy)))))


_WAITING = ("/init_weight_transfer_engine", "/update_weights")  # (they wait for the trainer: no client timeout)


async def fan_out(router: Router, path: str, body: dict | None, method: str = "POST") -> list[dict]:
    """The replies of the healthy replicas that answered `path` with a 200."""
    return [r.json() for _, r in await replies(router, path, body, method)
            if isinstance(r, httpx.Response) and r.status_code == 200]


async def every(router: Router, path: str, body, method: str = "POST") -> list[dict] | JSONResponse:
    """Every healthy replica's 200 reply to `path`, or the first other reply (its status and JSON
    error, the replica named) when one did not give one; 503 when no replica is healthy."""
    got = await replies(router, path, body, method)
    if not got:
        return error(503, "no healthy replica", "unavailable")
    for name, r in got:
        if not isinstance(r, httpx.Response):
            return error(502, f"{name}: {type(r).__name__}: {r}", "replica_error")
        if r.status_code != 200:
            try:
                err = r.json()["error"]
            except (ValueError, KeyError, TypeError):
                err = {"message": r.text[:500], "type": "replica_error"}
            return JSONResponse({"error": {**err, "message": f"{name}: {err.get('message')}"}},
                                status_code=r.status_code)
    return [r.json() for _, r in got]


async def receive_everywhere(router: Router, body: dict) -> dict | JSONResponse:
    """/update_weights with vLLM's `{"update_info"}`: every replica receives the trainer's broadcast."""
    got = await every(router, "/update_weights", body)
    return got if isinstance(got, JSONResponse) else {"message": "Weights updated", "replicas": len(got)}


def install_fanout(app: FastAPI, router: Router) -> None:
    @app.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(body: TransferInit):
        """Replica i joins the trainer's group at the rank_offset given plus i (the world size must
        hold them all: /get_world_size is the replicas' count)."""
        info = body.init_info
        offset = info.get("rank_offset")
        if not isinstance(offset, int) or isinstance(offset, bool):
            raise ValueError("init_info.rank_offset must be an integer")
        got = await every(router, "/init_weight_transfer_engine",
                          lambda i: {"init_info": {**info, "rank_offset": offset + i}})
        return got if isinstance(got, JSONResponse) else {"message": "Weight transfer initialized",
                                                          "replicas": len(got)}

    def forwarder(path: str):
        async def forward(request: Request):
            raw = await request.body()
            got = await every(router, path, json_object(raw) if raw else None)
            return got if isinstance(got, JSONResponse) else {**got[0], "replicas": len(got)}
        return forward

    for path in ("/start_weight_update", "/finish_weight_update", "/shutdown_weight_transfer_engine"):
        app.post(path)(forwarder(path))

    @app.post("/pause")
    async def pause(request: Request):  # vLLM's (rlhf.py), its query passed on to every replica
        got = await fan_out(router, f"/pause?{request.url.query}" if request.url.query else "/pause", {})
        return {"status": "paused", "replicas": len(got)}

    @app.post("/resume")
    async def resume():
        return {"status": "resumed", "replicas": len(await fan_out(router, "/resume", {}))}

    @app.get("/is_paused")
    async def is_paused():  # paused when every replica that answers is
        got = await fan_out(router, "/is_paused", None, "GET")
        return {"is_paused": bool(got) and all(r.get("is_paused") for r in got), "replicas": len(got)}

    @app.post("/collective_rpc")
    async def collective_rpc(body: RpcRequest):
        """On every replica's worker: the results, one per worker (a replica's first), as vLLM's."""
        got = await every(router, "/collective_rpc", body.model_dump(exclude_none=True))
        return got if isinstance(got, JSONResponse) else {"results": [x for r in got for x in r["results"]]}

    @app.get("/weight_info")
    async def weight_info():
        """The replicas' label of their weights (`agree`: every replica has the same one)."""
        got = await every(router, "/weight_info", None, "GET")
        if isinstance(got, JSONResponse):
            return got
        return {"weight_version": got[0]["weight_version"], "agree": len({r["weight_version"] for r in got}) == 1}

    @app.post("/update_weight_version")
    async def update_weight_version(body: WeightVersionRequest):
        got = await every(router, "/update_weight_version", body.model_dump())
        return got if isinstance(got, JSONResponse) else {"success": True, "new_version": body.new_version,
                                                          "replicas": len(got)}

    @app.post("/weight_checker")
    async def weight_checker(body: WeightCheckRequest):
        """checksum: the first replica's, and whether every replica's are the same; compare: every
        replica against the baseline (the mismatches of any); reset: every replica's weights zeroed."""
        got = await every(router, "/weight_checker", body.model_dump(exclude_none=True))
        if isinstance(got, JSONResponse) or body.action == "reset":
            return got if isinstance(got, JSONResponse) else {"status": "reset", "replicas": len(got)}
        if body.action == "checksum":
            return {"checksums": got[0]["checksums"], "agree": all(r["checksums"] == got[0]["checksums"] for r in got)}
        bad = sorted({k for r in got for k in r["mismatches"]})
        return {"match": not bad, "mismatches": bad}

    @app.get("/get_world_size")
    async def get_world_size(include_dp: bool = True):
        """Every healthy replica's workers (vLLM's world size across data parallelism); one replica's
        without it."""
        got = await every(router, "/get_world_size", None, "GET")
        if isinstance(got, JSONResponse):
            return got
        return {"world_size": sum(r["world_size"] for r in got) if include_dp else got[0]["world_size"]}

    @app.post("/abort_requests")
    async def abort_requests(body: AbortRequests | None = None):
        ids = body.request_ids if body is not None else None
        got = await fan_out(router, "/abort_requests", {"request_ids": ids})
        return {"status": "aborted", "aborted": len(ids) if ids else sum(r["aborted"] for r in got)}
