"""A FastAPI app served on 127.0.0.1 from a thread, for the tests' stand-in servers (a judge, a
simulated user, a retriever), and a chat-completions server whose replies a test writes."""
from __future__ import annotations

import asyncio
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rollwise.serve.process import free_port


class AppServer:
    """`with AppServer(app) as srv:` serves `app` on a free port until the block ends."""

    def __init__(self, app) -> None:
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join()


class ChatServer(AppServer):
    """OpenAI's chat completions and Anthropic's Messages API (and /v1/models, listing `model`), each
    reply's text from `reply(body)`; it keeps each request's (API key header, body), counts those in
    flight, and fails its first `fail` requests (HTTP 500)."""

    def __init__(self, reply, model: str, fail: int = 0, delay: float = 0.0) -> None:
        self.fail, self.delay, self.requests, self.in_flight, self.max_in_flight = fail, delay, [], 0, 0
        app = FastAPI()

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": model, "object": "model"}]}

        async def answer(request: Request, key: str | None) -> tuple[dict, JSONResponse | None]:
            body = await request.json()
            self.requests.append((key, body))
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                await asyncio.sleep(self.delay)
            finally:
                self.in_flight -= 1
            if self.fail > 0:
                self.fail -= 1
                return body, JSONResponse({"error": {"message": "overloaded"}}, status_code=500)
            return body, None

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body, failed = await answer(request, request.headers.get("authorization"))
            return failed or {"choices": [{"index": 0, "message": {"role": "assistant", "content": reply(body)},
                                           "finish_reason": "stop"}]}

        @app.post("/v1/messages")
        async def messages(request: Request):
            body, failed = await answer(request, request.headers.get("x-api-key"))
            return failed or {"type": "message", "role": "assistant", "stop_reason": "end_turn",
                              "content": [{"type": "text", "text": reply(body)}]}

        super().__init__(app)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"
