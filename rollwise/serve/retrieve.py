"""`rollwise retrieve CORPUS`: a `SearchIndex` (BM25 over sqlite FTS5) behind Search-R1's retrieval
protocol, so every replica, episode and machine of a run queries one index, and agents written
for Search-R1's retriever (or verl's search tool) use it unchanged:

    POST /retrieve {"queries": ["..."], "topk": 3, "return_scores": true}
      -> {"result": [[{"document": {"id", "contents": '"Title"\\ntext'}, "score": s}, ...], ...]}
    GET /health -> {"status": "ok", "documents": n}

Bad input is HTTP 400 with a JSON body; `--api-key` requires a bearer key (health stays open).
"""
from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel

from rollwise.agent.search import Hit, SearchIndex
from rollwise.serve.server import install_common

MAX_QUERIES = 512
THREADS = max(1, min(8, os.cpu_count() or 1))  # a request's queries run in up to this many threads


class RetrieveRequest(BaseModel):
    queries: list[str]
    topk: int = 3
    return_scores: bool = True


@dataclass
class _Auth:
    api_key: str | None
    is_loopback: bool = True  # (it serves no control endpoint: the rule for them off loopback guards nothing here)


def _doc(h: Hit) -> dict:
    return {"id": h.id, "contents": f'"{h.title}"\n{h.text}'}


def build_retrieve_app(index: SearchIndex, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="rollwise retrieve", docs_url=None, redoc_url=None)
    install_common(app, _Auth(api_key))

    @app.get("/health")
    async def health():
        return {"status": "ok", "documents": index.size}

    @app.post("/retrieve")
    async def retrieve(req: RetrieveRequest):
        if not 1 <= len(req.queries) <= MAX_QUERIES:
            raise ValueError(f"queries: 1 to {MAX_QUERIES} of them, got {len(req.queries)}")
        # the queries in a share per core, each in a thread of its own (sqlite lets go of the GIL while
        # it ranks): a trainer's one request of a whole batch's queries takes every core
        n = min(len(req.queries), THREADS)
        parts = [req.queries[i::n] for i in range(n)]
        got = await asyncio.gather(*(run_in_threadpool(lambda qs=qs: [index.search(q, req.topk) for q in qs])
                                     for qs in parts))
        hits = [got[i % n][i // n] for i in range(len(req.queries))]
        if req.return_scores:
            return {"result": [[{"document": _doc(h), "score": h.score} for h in hs] for hs in hits]}
        return {"result": [[_doc(h) for h in hs] for hs in hits]}

    return app
