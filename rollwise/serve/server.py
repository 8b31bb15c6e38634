"""HTTP server: OpenAI-compatible completions and chat, token-level /generate, health, models,
Prometheus /metrics and /update_weights, over one `AsyncEngine`.

Every bad request gets HTTP 400 with a JSON body `{"error": {...}}`; nothing a client sends can stop
the server.
"""
from __future__ import annotations

import asyncio
import json
import tempfile
import uuid
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollwise.agent.messages_api import models_page
from rollwise.agent.parsing import make_parser
from rollwise.agent.reasoning import make_reasoning_parser
from rollwise.config import ServerConfig
from rollwise.serve.auth import AuthMiddleware
from rollwise.serve.defaults import Defaults
from rollwise.serve.metrics import prometheus_text
from rollwise.serve.protocol import (AddSequenceRequest, ChatCompletionRequest, CompletionRequest,
                                     GenerateRequest, UpdateWeightsRequest)
from rollwise.serve.handlers import ClientGone, chat_reply, completion_reply, unless_disconnected
from rollwise.serve.responses import (FiniteJSONResponse, choice_samples, completion_params, error, generate_json,
                                      stream_generate, weights_refused)
from rollwise.serve.streams import primed, sse
from rollwise.serve.lora import install_lora, with_adapter
from rollwise.serve.rlhf import install_rlhf, json_object, receive_weights
from rollwise.serve.sglang import (generate_batch, generate_params, generate_samples, install_sglang, is_batch,
                                   sglang_fields)
from rollwise.serve.sleep import install_sleep
from rollwise.serve.tito import install_tito
from rollwise.serve.tokenize import install_tokenize
from rollwise.engine.isolation import StepFailed
from rollwise.engine.sleep import EngineAsleep
from rollwise.types import WeightsNotHeld
from rollwise.wire import AdapterWeights

_WRITE_BYTES = 4 << 20  # a streamed weight update goes to disk in writes of about this size


def install_common(app: FastAPI, cfg: ServerConfig) -> None:
    """HTTP 400 + JSON for bad input, and the optional bearer API key (health and metrics stay open)."""

    @app.exception_handler(ClientGone)
    async def _gone(_: Request, exc: ClientGone):
        return Response(status_code=499)  # nobody reads it (nginx's "client closed request")

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        msgs = [f"{'.'.join(str(x) for x in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors()]
        return error(400, "; ".join(msgs) or "invalid request")

    @app.exception_handler(ValueError)
    async def _value(_: Request, exc: ValueError):
        return error(400, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):  # (a body that cannot be parsed, 404, 405)
        kind = {401: "authentication_error", 404: "not_found_error"}.get(exc.status_code, "invalid_request_error")
        reply = error(exc.status_code, str(exc.detail), kind)
        reply.headers.update(exc.headers or {})
        return reply

    @app.exception_handler(WeightsNotHeld)
    async def _not_held(_: Request, exc: WeightsNotHeld):
        return error(400, str(exc), "weights_not_held")

    @app.exception_handler(StepFailed)
    async def _step_failed(_: Request, exc: StepFailed):
        return error(500, str(exc), "request_failed")

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception):  # a bug (logged by the server): JSON all the same
        return error(500, str(exc) or type(exc).__name__, "internal_server_error")

    @app.exception_handler(EngineAsleep)
    async def _asleep(_: Request, exc: EngineAsleep):
        return error(503, str(exc), "engine_asleep")

    app.add_middleware(AuthMiddleware, cfg=cfg)


def build_app(engine, cfg: ServerConfig, model_name: str) -> FastAPI:
    app = FastAPI(title="rollwise", docs_url=None, redoc_url=None, default_response_class=FiniteJSONResponse)
    tok = engine.tokenizer
    parser = make_parser(cfg.tool_call_parser)
    reasoning = make_reasoning_parser(cfg.reasoning_parser)
    defaults = Defaults(cfg, tok)  # (--chat-template, --default-chat-template-kwargs, --generation-config)

    install_common(app, cfg)
    install_sglang(app, engine, cfg)
    install_rlhf(app, engine)
    install_lora(app, engine, cfg)
    install_sleep(app, engine, cfg)

    @app.get("/health")
    @app.get("/ping")  # vLLM's (SageMaker's) name for it
    @app.post("/ping")
    async def health():
        if not engine.is_running:  # its thread died: a load balancer should stop sending it requests
            return error(503, "the engine is not running", "unavailable")
        return {"status": "ok", "policy_version": engine.policy_version, "paused": engine.paused,
                "keep_weight_versions": engine.engine.config.keep_weight_versions,
                "batch_invariant": engine.engine.config.batch_invariant, "sleeping": sorted(engine.engine.asleep)}

    @app.get("/v1/models")
    async def models(request: Request):
        base = {"object": "model", "owned_by": "rollwise", "max_model_len": engine.engine.max_model_len}
        listed = {"object": "list", "data": [{"id": model_name, **base}] + [
            {"id": name, **base, "parent": model_name} for name in sorted(engine.engine.loras)]}
        return models_page(listed) if "anthropic-version" in request.headers else listed

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(engine.metrics(), model_name, engine.engine.request_stats.snapshot()))

    @app.post("/update_weights")
    async def update_weights(request: Request):
        """JSON `{"model_dir", "policy_version", "partial_rollout"}` (a directory this server can
        read: a model's, or a peft adapter's to serve on the weights held), or the weights themselves
        streamed as a safetensors file (Content-Type application/octet-stream;
        `?policy_version=N&partial_rollout=true|false`, and `lora_config=JSON` for a LoRA adapter)."""
        if refused := weights_refused(cfg):
            return refused
        ctype = request.headers.get("content-type", "").split(";")[0].strip()
        if ctype == "application/octet-stream":
            version, partial, lora_config = _query_update(request.query_params)
            with tempfile.TemporaryDirectory(prefix="rollwise-weights-") as tmp:
                # the body goes to disk as it arrives and is read back once: one copy of the weights
                # in memory, not the body's bytes beside the tensors made from them
                path = Path(tmp) / "model.safetensors"
                with open(path, "wb") as f:
                    buf = bytearray()
                    async for chunk in request.stream():
                        buf += chunk
                        if len(buf) >= _WRITE_BYTES:  # disk writes off the event loop: others keep being served
                            await asyncio.to_thread(f.write, buf)
                            buf.clear()
                    await asyncio.to_thread(f.write, buf)
                weights = await asyncio.to_thread(_safetensors, path)
            if lora_config is not None:  # a LoRA adapter on the weights held (a LoRA run's update)
                weights = AdapterWeights(lora_config, weights)
        elif ctype in ("application/json", "") and "update_info" in (raw := json_object(await request.body())):
            return await receive_weights(engine, raw["update_info"])  # (vLLM 0.32's weight transfer: rlhf.py)
        elif ctype in ("application/json", ""):
            body = UpdateWeightsRequest.model_validate(raw)  # ValueError -> 400
            weights, version, partial = body.model_dir, body.policy_version, body.partial_rollout
        else:
            raise ValueError(f"Content-Type {ctype!r}: use application/json (a model_dir) or "
                             "application/octet-stream (safetensors bytes)")
        version = await engine.update_weights(weights, version, partial)
        return {"status": "ok", "policy_version": version}

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request):
        given = [x for x in (body.input_ids, body.prompt, body.text) if x is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of input_ids, prompt or text")
        prompt = given[0]
        rid = body.request_id or body.rid or f"gen-{uuid.uuid4().hex[:16]}"
        if is_batch(prompt):  # SGLang's batch form: a list of prompts, a list of replies
            return await unless_disconnected(request, generate_batch(engine, tok, body, prompt, rid))
        params = generate_params(body)
        if params.n > 1:  # SGLang's parallel sampling: a list of n replies (sample j seeded seed + j, one group)
            return await unless_disconnected(request, generate_samples(engine, tok, body, prompt, params, rid))
        if body.stream:
            return sse(await primed(stream_generate(engine, prompt, params, rid, body.group_id,
                                                    policy_version=body.policy_version, session=body.trajectory_id,
                                                    forced_output=body.forced_output, priority=body.priority,
                                                    cache_salt=body.cache_salt)))
        out = await unless_disconnected(request, engine.generate(
            prompt, params, rid, group_id=body.group_id, forced_output=body.forced_output,
            session=body.trajectory_id, policy_version=body.policy_version, priority=body.priority,
            cache_salt=body.cache_salt))
        return generate_json(out) | sglang_fields(tok, out, body)

    @app.post("/spec/add_sequence")
    async def add_sequence(body: AddSequenceRequest):
        spec = engine.engine.spec
        if spec is None or not spec.shares_drafts:
            return {"status": "ignored", "reason": "speculation is off" if spec is None else
                    "ngram speculation drafts from the request's own text only"}
        await engine.call(lambda: spec.add_sequence(body.token_ids, body.group_id, body.cache_salt))
        return {"status": "ok"}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompts = body.prompt if isinstance(body.prompt, list) and body.prompt and not isinstance(
            body.prompt[0], int) else [body.prompt]
        if body.truncate_prompt_tokens is not None or body.add_special_tokens is False:  # (echo: what was kept)
            prompts = [body.truncated(tok.encode(p, body.add_special_tokens is not False) if isinstance(p, str) else p,
                                      engine.engine.max_model_len) for p in prompts]
        rid, base = body.reply_ids("cmpl", request.headers)
        samples = choice_samples(prompts, with_adapter(engine, completion_params(body, defaults.sampling), body.model),
                                 body.n, body.group_id, base,
                                 lambda j: {"priority": body.priority, "cache_salt": body.cache_salt})
        return await completion_reply(engine, body, request, samples, rid, model_name, prompts,
                                      body.return_tokens_as_token_ids)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        render = defaults.renderer(body)  # (the tokenizer's template, or the request's own where trusted)
        ids = body.truncated(render.encode_chat(messages, body.add_generation_prompt, body.tools,
                                                body.continue_final_message, bool(body.add_special_tokens),
                                                **defaults.kwargs(body)), engine.engine.max_model_len)
        room = engine.engine.max_model_len - len(ids)
        if body.top_logprobs and not body.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        limit = body.asked_tokens(defaults.sampling.get("max_tokens") or max(room, 1))
        params = with_adapter(engine, body.sampling(limit, body.top_logprobs or 0, tok, parser, defaults.sampling),
                              body.model)
        rid, base = body.reply_ids("chatcmpl", request.headers)
        return await chat_reply(engine, body, request, choice_samples([ids], params, body.n, body.group_id, base,
                                                                      lambda j: {"priority": body.priority,
                                                                                 "cache_salt": body.cache_salt}),
                                rid, model_name, ids, parser, reasoning)

    install_responses(app, chat)
    install_messages(app, chat, tok, defaults)
    install_tokenize(app, tok, defaults, engine.engine.max_model_len)
    install_tito(app, engine, model_name, defaults)
    return app


# fields a Responses request hands to chat as they are (vLLM's take priority and cache_salt too)
RESPONSE_PASSED = ("temperature", "top_p", "seed", "user", "priority", "cache_salt")
STORED_RESPONSES = 4096  # the conversations previous_response_id can continue, newest kept


def install_responses(app: FastAPI, chat) -> None:
    """POST /v1/responses: OpenAI's Responses API (what the OpenAI Agents SDK calls by default) as a
    chat request (`rollwise.agent.responses_api`: input items to messages, the reply to output
    items), `text.format` json_schema as structured outputs, and `previous_response_id` over the
    last STORED_RESPONSES responses (`store: false` keeps one out). Streamed token by token as the
    Responses API's events (from the chat stream; function calls whole at the end, as the chat
    stream gives them)."""
    from collections import OrderedDict

    from rollwise.agent.gateway import GatewayError, loads
    from rollwise.agent.responses_api import chat_body, response, streamed_events
    conversations: OrderedDict[str, list[dict]] = OrderedDict()

    @app.post("/v1/responses")
    async def responses(request: Request):
        try:
            body = loads(await request.body())
        except ValueError as e:
            return error(400, f"the body is not JSON: {e}")
        try:
            body_chat, messages = chat_body(body, conversations)
        except GatewayError as e:
            return error(e.status, e.message, e.kind)
        text = body.get("text") or {}
        if not isinstance(text, dict) or not isinstance(text.get("format") or {}, dict):
            return error(400, 'text must be an object, its format {"type": "text" | "json_object" | '
                              '"json_schema", ...}')
        fmt = text.get("format") or {"type": "text"}
        if fmt.get("type") == "json_schema":
            body_chat["response_format"] = {"type": "json_schema", "json_schema": {"schema": fmt.get("schema")}}
        elif fmt.get("type") != "text":
            body_chat["response_format"] = fmt
        body_chat["messages"] = [{**m, "role": "system" if m["role"] == "developer" else m["role"]}
                                 for m in body_chat["messages"]]
        extra = {k: body[k] for k in RESPONSE_PASSED if body.get(k) is not None}

        def store(resp: dict, reply: dict) -> None:
            if body.get("store", True):
                conversations[resp["id"]] = messages + [reply["choices"][0]["message"]]
                while len(conversations) > STORED_RESPONSES:
                    conversations.popitem(last=False)
        fields = {k: v for k, v in body_chat.items() if v is not None}
        if body.get("stream"):  # token by token: the chat stream's chunks as they come, as Responses events
            streamed = await chat(ChatCompletionRequest(**fields, **extra, stream=True,
                                                        stream_options={"include_usage": True}), request)
            return sse(streamed_events(_sse_chunks(streamed), body, store))
        reply = await chat(ChatCompletionRequest(**fields, **extra), request)
        resp = response(reply, body)
        store(resp, reply)
        return resp


def install_messages(app: FastAPI, chat, tokenizer, defaults: Defaults | None = None) -> None:
    """POST /v1/messages: Anthropic's Messages API as a chat request (rollwise.agent.messages_api),
    streamed token by token as its events; POST /v1/messages/count_tokens: the prompt's tokens as
    the chat template renders them (`tokenizer`; None: a router without one, refused)."""
    from fastapi.responses import JSONResponse

    from rollwise.agent.gateway import GatewayError, loads
    from rollwise.agent.messages_api import chat_body, error_body, message, named_sse, streamed_events

    async def parsed(request: Request, count: bool = False) -> tuple[dict, dict]:
        try:
            body = loads(await request.body())
        except ValueError as e:
            raise GatewayError(400, f"the body is not JSON: {e}") from None
        if count and isinstance(body, dict):
            body = {**body, "max_tokens": 1}  # (counting needs none)
        return body, chat_body(body)

    def refused(e: Exception) -> JSONResponse:
        status, text = (e.status, e.message) if isinstance(e, GatewayError) else (400, str(e))
        return JSONResponse(error_body(status, text), status_code=status)

    @app.post("/v1/messages")
    async def messages(request: Request):
        try:
            body, fields = await parsed(request)
            if body.get("stream"):
                streamed = await chat(ChatCompletionRequest(**fields, stream=True,
                                                            stream_options={"include_usage": True}), request)
                return named_sse(streamed_events(_sse_chunks(streamed), body))
            reply = await chat(ChatCompletionRequest(**fields), request)
        except (GatewayError, ValueError) as e:
            return refused(e)
        return message(reply, body)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        try:
            body, fields = await parsed(request, count=True)
            if tokenizer is None:
                raise ValueError("this router has no tokenizer to count with (start it with --tokenizer)")
            req = ChatCompletionRequest(**fields)
            render = defaults.renderer(req) if defaults is not None else tokenizer
            ids = render.encode_chat([m.model_dump(exclude_none=True) for m in req.messages],
                                     req.add_generation_prompt, req.tools, req.continue_final_message,
                                     **(defaults.kwargs(req) if defaults is not None else {}))
        except (GatewayError, ValueError) as e:
            return refused(e)
        return {"input_tokens": len(ids)}


async def _sse_chunks(streamed):
    """The chunks (dicts) of one of our SSE responses, read back from its body; an error chunk raises."""
    buf = ""
    async for piece in streamed.body_iterator:
        buf += piece if isinstance(piece, str) else piece.decode()
        while "\n\n" in buf:
            event, buf = buf.split("\n\n", 1)
            data = event.removeprefix("data: ")
            if data == "[DONE]":
                return
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(chunk["error"].get("message", "the stream failed"))
            yield chunk


def _safetensors(path: Path) -> dict:
    from safetensors.torch import load_file
    if path.stat().st_size == 0:
        raise ValueError("empty body: expected the weights as a safetensors file")
    try:
        return load_file(str(path))
    except Exception as e:  # noqa: BLE001 - the library raises several kinds for a bad file
        raise ValueError(f"body is not a safetensors file: {e}") from e


def _query_update(q) -> tuple[int | None, bool, dict | None]:
    unknown = sorted(set(q) - {"policy_version", "partial_rollout", "lora_config"})
    if unknown:
        raise ValueError(f"unknown query parameters {unknown}; valid: ['lora_config', 'partial_rollout', 'policy_version']")
    lora_config = None
    if "lora_config" in q:
        try:
            lora_config = json.loads(q["lora_config"])
        except ValueError:
            raise ValueError("lora_config must be the adapter's adapter_config.json as JSON") from None
        if not isinstance(lora_config, dict):
            raise ValueError("lora_config must be a JSON object (the adapter's adapter_config.json)")
    version = q.get("policy_version")
    if version is not None and not version.lstrip("-").isdigit():
        raise ValueError(f"policy_version must be an integer, got {version!r}")
    partial = q.get("partial_rollout", "false").lower()
    if partial not in ("true", "false", "1", "0"):
        raise ValueError(f"partial_rollout must be true or false, got {partial!r}")
    return (None if version is None else int(version)), partial in ("true", "1"), lora_config
