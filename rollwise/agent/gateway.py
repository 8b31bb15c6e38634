"""An OpenAI endpoint (chat completions, and the Responses API: rollwise.agent.responses_api; also
Anthropic's Messages API: rollwise.agent.messages_api) through which an agent written against the
OpenAI API (the openai SDK, the OpenAI Agents SDK, LangChain, LiteLLM, plain HTTP) or Anthropic's
runs its episodes on the policy: `AgentEnv`
(rollwise.agent.envs.agent) holds one `Session` per episode, and each request on the session's
bearer key waits for the episode loop to generate the reply.

One server per event loop, on 127.0.0.1 and a free port, served by that loop; agents that block (a
plain function using `openai.OpenAI`, in a thread of its own) reach it like any client. A key
belongs to one episode and stops working when it ends: another process on the machine cannot
speak for an episode without its key.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
import uuid

from rollwise.agent.env import loop_forget, loop_shared
from rollwise.agent.episode import text_content
from rollwise.sampling import MAX_LOGPROBS

ROLES = ("system", "developer", "user", "assistant", "tool")


class GatewayError(Exception):
    """Returned to the agent as an HTTP error with OpenAI's JSON error body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


class Session:
    """One episode's side of the endpoint, on the episode's event loop: the agent's requests and its
    end arrive as events; `answer` replies to the request in wait."""

    def __init__(self) -> None:
        self.events: asyncio.Queue[tuple[str, object]] = asyncio.Queue()
        self.pending: asyncio.Future | None = None
        self.ended: str | None = None
        self.conversations: dict[str, list[dict]] = {}  # Responses API: response id -> its messages

    async def request(self, body: dict) -> dict:
        if self.ended is not None:
            raise GatewayError(400, f"this episode has ended: {self.ended}")
        if self.pending is not None:
            raise GatewayError(400, "one request at a time per episode: wait for the reply before asking again")
        check_request(body)
        self.pending = asyncio.get_running_loop().create_future()
        self.events.put_nowait(("request", body))
        return await self.pending

    def answer(self, reply: dict) -> None:
        pending, self.pending = self.pending, None
        if pending is not None and not pending.done():
            pending.set_result(reply)

    def end(self, reason: str) -> None:
        self.ended = reason
        pending, self.pending = self.pending, None
        if pending is not None and not pending.done():
            pending.set_exception(GatewayError(400, f"this episode has ended: {reason}"))


def check_stream(body: dict) -> None:
    """`stream` is a boolean (or absent, or null): not any value that reads as true."""
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise GatewayError(400, "stream must be true or false")


def check_request(body) -> None:
    if not isinstance(body, dict):
        raise GatewayError(400, "the body must be a JSON object")
    check_stream(body)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
        raise GatewayError(400, "messages must be a non-empty list of message objects")
    bad = sorted({str(m.get("role")) for m in msgs} - set(ROLES))
    if bad:
        raise GatewayError(400, f"unknown message roles {bad}; valid: {list(ROLES)}")
    for i, m in enumerate(msgs):  # (here, not in the episode: a malformed message is the agent's to fix)
        _check_message(i, m)
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise GatewayError(400, "model must be a string")
    if body.get("n", 1) != 1:
        raise GatewayError(400, "n must be 1: each request is one turn of one episode (the group's other "
                                "episodes are other agents)")
    if body.get("tools") is not None and not isinstance(body["tools"], list):
        raise GatewayError(400, "tools must be a list of function tools")
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) and stop or isinstance(stop, list)
                                 and all(isinstance(x, str) and x for x in stop)):
        raise GatewayError(400, "stop must be a non-empty string or a list of them")
    if body.get("logprobs") is not None and not isinstance(body["logprobs"], bool):
        raise GatewayError(400, "logprobs must be true or false")
    top = body.get("top_logprobs")
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_LOGPROBS:
            raise GatewayError(400, f"top_logprobs must be an integer from 0 to {MAX_LOGPROBS}")
        if not body.get("logprobs"):
            raise GatewayError(400, "top_logprobs needs logprobs: true")
    for k in ("max_tokens", "max_completion_tokens"):
        if body.get(k) is not None and (isinstance(body[k], bool) or not isinstance(body[k], int) or body[k] < 1):
            raise GatewayError(400, f"{k} must be a positive integer")


def loads(raw: bytes | str):
    """A request body parsed as strict JSON: NaN and Infinity (which Python's json takes, but JSON has
    not, nor can a reply that echoes them be written) are a ValueError like any other bad JSON."""
    def constant(name: str):
        raise ValueError(f"{name} is not a JSON value")
    try:
        return json.loads(raw, parse_constant=constant)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _check_message(i: int, m: dict) -> None:
    """A message the chat template can take: text content (a string, or text parts), and an
    assistant's tool calls each a function with a name and its arguments (a JSON string or object)."""
    if text_content(m.get("content")) is None:
        raise GatewayError(400, f"message {i}: content must be a string or a list of text parts")
    calls = m.get("tool_calls")
    if calls is None:
        return
    fn = lambda c: c.get("function") if isinstance(c, dict) else None  # noqa: E731
    if not isinstance(calls, list) or not all(isinstance(fn(c), dict) and isinstance(fn(c).get("name"), str)
                                              and isinstance(fn(c).get("arguments", "{}"), (str, dict))
                                              for c in calls):
        raise GatewayError(400, f'message {i}: tool_calls must be a list of {{"type": "function", "function": '
                                '{"name": ..., "arguments": "..."}}')


class Gateway:
    """The endpoint of one event loop (`await Gateway.running()`), served on that loop, so a request's
    handler awaits its episode directly (no thread between them). `url` is the OpenAI base URL
    (.../v1): a real server on 127.0.0.1 for agents in threads or other processes; coroutine agents
    on the loop reach the same app through `http()`."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):  # Ctrl-C stays the training run's, not this server's
                yield

        self.sessions: dict[str, Session] = {}
        # (uvicorn binds port 0 itself: a socket handed to it was 44 ms a request here, 1.5 ms this way)
        self.app = self._app()
        # keep-alive: longer than clients keep an idle connection (httpx: 5 s), so the client, not the
        # server, closes it; with uvicorn's 5 s both did, and a request sent as the server closed
        # failed ("Connection error": 5 of 2,560 episodes in a 40-step training run)
        self.server = Server(uvicorn.Config(self.app, host=host, port=0, log_level="warning", lifespan="off",
                                           timeout_keep_alive=600))
        self.host, self.url = host, ""
        self.started = asyncio.get_running_loop().create_future()
        self.task: asyncio.Task | None = None
        self._clients: dict[tuple[str, bool], object] = {}  # (httpx package, via the socket) -> client

    def http(self, via_socket: bool = False, lib=None):
        """The HTTP client every episode's SDK client on this loop shares (a client of its own costs
        ~30 ms, most of it an SSL context). It hands each request to the app as a call on this loop
        (ASGI) instead of through the socket: the same app, requests and replies, without the
        select wake-ups per hop, each of which can wait for the GIL behind the engine threads
        (the demo's training run through the socket took 823 s, 4.0x the built-in env's 208 s).
        `lib`: the httpx package the SDK takes (default httpx; newer anthropic SDKs take httpx2)."""
        if lib is None:
            import httpx as lib
        key = (lib.__name__, via_socket)
        if key not in self._clients:
            self._clients[key] = pooled(lib.AsyncClient, lib) if via_socket else lib.AsyncClient(
                transport=lib.ASGITransport(app=self.app), timeout=None)
        return self._clients[key]

    @classmethod
    async def running(cls) -> Gateway:
        gateway = loop_shared("gateway", cls)
        if gateway.task is None:
            gateway.task = asyncio.create_task(gateway._serve())
        await asyncio.shield(gateway.started)
        return gateway

    async def _serve(self) -> None:
        try:
            serving = asyncio.create_task(self.server.serve())
            while not self.server.started:
                if serving.done():
                    serving.result()
                    raise RuntimeError("the agent gateway's HTTP server did not start")
                await asyncio.sleep(0.002)
            self.url = f"http://{self.host}:{self.server.servers[0].sockets[0].getsockname()[1]}/v1"
            self.started.set_result(None)
            await serving
        except asyncio.CancelledError:  # the loop is ending: close the listening socket and connections
            self.server.should_exit = True
            with contextlib.suppress(Exception):
                await self.server.shutdown()
                for client in self._clients.values():
                    await client.aclose()
            raise
        except BaseException as e:
            if not self.started.done():
                self.started.set_exception(e)
            raise
        finally:
            loop_forget("gateway")  # (the next episode on this loop starts another)

    def register(self, session: Session) -> str:
        key = f"rw-{secrets.token_urlsafe(24)}"
        self.sessions[key] = session
        return key

    def unregister(self, key: str) -> None:
        self.sessions.pop(key, None)

    def _app(self):
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        from rollwise.agent.responses_api import chat_body, events, response
        from rollwise.serve.responses import error as json_error
        from rollwise.serve.streams import sse

        def error(e: GatewayError) -> JSONResponse:
            return json_error(e.status, e.message, e.kind)

        async def opened(request) -> tuple[Session, object]:
            # the key: anthropic's SDKs send it as x-api-key, openai's as a bearer token
            auth = request.headers.get("x-api-key") or request.headers.get("authorization", "")
            session = self.sessions.get(auth.removeprefix("Bearer ").strip())
            if session is None:
                raise GatewayError(401, "unknown or expired API key: each episode's client has a key of its own, "
                                        "valid until the episode ends", "authentication_error")
            try:
                return session, loads(await request.body())
            except ValueError as e:
                raise GatewayError(400, f"the body is not JSON: {e}") from None

        async def chat(request):
            try:
                session, body = await opened(request)
                reply = await session.request(body)
            except GatewayError as e:
                return error(e)
            if body.get("stream"):
                usage = (body.get("stream_options") or {}).get("include_usage", False)
                return sse(stream_chunks(reply, usage))
            return JSONResponse(reply)

        async def responses(request):  # OpenAI's Responses API, as a chat request (rollwise.agent.responses_api)
            try:
                session, body = await opened(request)
                chat, messages = chat_body(body, session.conversations)
                reply = await session.request(chat)
            except GatewayError as e:
                return error(e)
            resp = response(reply, body)
            session.conversations[resp["id"]] = messages + [reply["choices"][0]["message"]]
            return sse(events(resp)) if body.get("stream") else JSONResponse(resp)

        async def messages(request):  # Anthropic's Messages API, as a chat request (rollwise.agent.messages_api)
            from rollwise.agent.messages_api import chat_body as messages_chat, error_body, events, message, named_sse
            try:
                session, body = await opened(request)
                chat = messages_chat(body)
                if chat.get("continue_final_message"):
                    raise GatewayError(400, "a prefilled assistant message is not taken here: the policy writes "
                                            "its own turns, each a whole message")
                reply = await session.request(chat)
            except GatewayError as e:
                return JSONResponse(error_body(e.status, e.message), status_code=e.status)
            msg = message(reply, body)
            return named_sse(events(msg)) if body.get("stream") else JSONResponse(msg)

        async def models(request):
            listed = {"object": "list", "data": [{"id": "policy", "object": "model", "owned_by": "rollwise"}]}
            if "anthropic-version" in request.headers:  # the anthropic SDK's models.list()
                from rollwise.agent.messages_api import models_page
                listed = models_page(listed)
            return JSONResponse(listed)

        return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                                 Route("/v1/responses", responses, methods=["POST"]),
                                 Route("/v1/messages", messages, methods=["POST"]),
                                 Route("/v1/models", models, methods=["GET"])])


def pooled(client_class, lib=None):
    """An httpx client (`httpx.Client` or `httpx.AsyncClient`; `lib`'s, another httpx package) for
    many episodes' requests to the gateway's socket: connections unbounded, kept alive, no timeout
    of its own (the SDK's applies)."""
    if lib is None:
        import httpx as lib
    return client_class(limits=lib.Limits(max_connections=None, max_keepalive_connections=512), timeout=None)


def httpx_of(sdk: str):
    """The httpx package an SDK's clients take: httpx, or httpx2 (a fork newer anthropic SDKs use)."""
    import importlib
    import importlib.metadata
    import re
    needs = " ".join(importlib.metadata.requires(sdk) or [])
    return importlib.import_module("httpx2" if re.search(r"\bhttpx2\b", needs) else "httpx")


def completion(message: dict, finish_reason: str, model: str, usage: dict | None,
               logprobs: list[dict] | None = None, stop_reason: str | None = None) -> dict:
    """A chat completion; `logprobs`: its `logprobs.content` (rollwise.serve.responses.chat_logprobs);
    `stop_reason`: the stop string that ended it (vLLM's field)."""
    return {"id": f"chatcmpl-{uuid.uuid4().hex[:16]}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "message": message, "finish_reason": finish_reason,
                                         "stop_reason": stop_reason,
                                         "logprobs": None if logprobs is None else {"content": logprobs,
                                                                                    "refusal": None}}],
            "usage": usage}


async def stream_chunks(reply: dict, with_usage: bool):
    """A whole reply as OpenAI's stream chunks: one delta with the message, then the finish reason."""
    head = {k: reply[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    choice = reply["choices"][0]
    delta = {k: v for k, v in choice["message"].items() if k != "tool_calls"}
    if choice["message"].get("tool_calls"):
        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(choice["message"]["tool_calls"])]
    chunks = [head | {"choices": [{"index": 0, "delta": delta, "logprobs": choice["logprobs"], "finish_reason": None}]},
              head | {"choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}]}]
    if with_usage:
        chunks.append(head | {"choices": [], "usage": reply["usage"]})
    for c in chunks:
        yield c
