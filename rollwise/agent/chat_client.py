"""A model behind an OpenAI chat-completions server (vLLM, SGLang, `rollwise serve`, a hosted API),
or with `api = "messages"` behind Anthropic's Messages API (Anthropic's, `rollwise serve`'s), as a
part of an environment: the LLM judge (rollwise.agent.judge) and the simulated user
(rollwise.agent.users) ask it through one `ChatClient` per event loop. A request that fails
(connection, HTTP error, a reply its caller cannot use) is retried with a doubling wait; then the
caller's error is raised, which ends the episode with status `error` (the service failed, not the
policy) for the training run to rerun. At most `max_concurrency` requests are in flight at once."""
from __future__ import annotations

import asyncio
import os
from typing import Callable

import httpx


def bearer_key(api_key: str | None, api_key_env: str | None, what: str) -> str | None:
    """The key given, or the one the environment variable `api_key_env` holds (a ValueError if unset)."""
    key = api_key or (os.environ.get(api_key_env) if api_key_env else None)
    if api_key_env and not key:
        raise ValueError(f"{what} api_key_env {api_key_env!r} is not set")
    return key


APIS = ("chat", "messages")  # OpenAI's chat completions, Anthropic's Messages API
ANTHROPIC_VERSION = "2023-06-01"  # the Messages API's version header


def check_api(api: str, what: str) -> None:
    if api not in APIS:
        raise ValueError(f"{what} api {api!r}: valid are {list(APIS)}")


class ChatClient:
    def __init__(self, url: str, *, model: str | None = None, api_key: str | None = None,
                 api_key_env: str | None = None, timeout_s: float = 60.0, retries: int = 2, backoff_s: float = 1.0,
                 max_concurrency: int = 16, what: str = "model", error: type[Exception] = RuntimeError,
                 api: str = "chat") -> None:
        check_api(api, what)
        key = bearer_key(api_key, api_key_env, what)
        self.url, self.model, self.what, self.error, self.api = url, model, what, error, api
        self.retries, self.backoff_s = retries, backoff_s
        headers = {"x-api-key": key or "", "anthropic-version": ANTHROPIC_VERSION} if api == "messages" else (
            {"Authorization": f"Bearer {key}"} if key else {})
        self.client = httpx.AsyncClient(base_url=url.rstrip("/"), timeout=timeout_s, headers=headers)
        self.slots = asyncio.Semaphore(max_concurrency)
        self.stats = {"requests": 0, "failures": 0}

    async def _model(self) -> str:
        if self.model is None:  # the first model the server lists
            r = await self.client.get("/models")
            r.raise_for_status()
            self.model = r.json()["data"][0]["id"]
        return self.model

    async def complete(self, messages: list[dict], read: Callable[[str], object] = str, **body):
        """`read` of the reply's text (it raises ValueError, or the caller's error, for a reply it
        cannot use: retried like a failed request); `body` adds the request's fields."""
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                async with self.slots:
                    self.stats["requests"] += 1
                    path, payload = self._request(messages, await self._model(), body)
                    r = await self.client.post(path, json=payload)
                r.raise_for_status()
                return read(self._text(r.json()))
            except (httpx.HTTPError, self.error, KeyError, IndexError, ValueError) as e:
                self.stats["failures"] += 1
                last = e
        raise self.error(f"{self.what} at {self.url} failed {self.retries + 1} times; last: "
                         f"{type(last).__name__}: {last}")

    def _request(self, messages: list[dict], model: str, body: dict) -> tuple[str, dict]:
        """The path and JSON of a request: chat completions', or the Messages API's (the system
        messages its `system`, a max_tokens always: the API requires one)."""
        if self.api == "chat":
            return "/chat/completions", {"model": model, "messages": messages, **body}
        system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
        rest = [m for m in messages if m["role"] != "system"]
        return "/messages", {"model": model, "messages": rest, **({"system": system} if system else {}),
                             "max_tokens": 1024, **body}

    def _text(self, reply: dict) -> str:
        if self.api == "chat":
            return reply["choices"][0]["message"]["content"] or ""
        return "".join(b.get("text", "") for b in reply["content"] if b.get("type") == "text")
