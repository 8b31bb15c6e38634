"""`rollwise route`: the HTTP API of `rollwise serve` in front of N replicas, plus membership.

Trajectories are identified by the body's `trajectory_id` / `group_id` / `turn` or by the headers
`X-Session-Id` / `X-Group-Id`. Bad input gets HTTP 400 with a JSON body, as on the replicas.
"""
from __future__ import annotations

import dataclasses
import functools
import uuid
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from rollwise.agent.messages_api import models_page
from rollwise.agent.parsing import make_parser
from rollwise.agent.reasoning import make_reasoning_parser
from rollwise.config import ServerConfig
from rollwise.router.fanout import fan_out as fan_out_to, install_fanout, receive_everywhere
from rollwise.router.replica import HttpReplica, ReplicaError
from rollwise.router.router import Router
from rollwise.serve.protocol import (AbortRequest, ChatCompletionRequest, CompletionRequest,
                                     GenerateRequest as GenerateBody, UpdateWeightsRequest)
from rollwise.serve.defaults import Defaults
from rollwise.serve.handlers import chat_reply, completion_reply, unless_disconnected
from rollwise.serve.responses import (FiniteJSONResponse, choice_samples, completion_params, error, generate_json,
                                      stream_generate, weights_refused)
from rollwise.serve.streams import primed, sse
from rollwise.serve.server import install_common, install_messages, install_responses
from rollwise.serve.lora import LoadLoraRequest, UnloadLoraRequest
from rollwise.serve.rlhf import json_object
from rollwise.serve.sglang import (PauseRequest, UpdateFromDiskRequest, generate_batch, generate_params,
                                   generate_samples, is_batch, load_from_disk, sglang_fields)
from rollwise.serve.tito import install_tito
from rollwise.serve.tokenize import install_tokenize
from rollwise.serve.metrics import router_text
from rollwise.types import GenerateOutput, GenerateRequest, RequestOutput, SamplingParams


UNTIL_MODEL_LEN = 2**31 - 1  # max_tokens of a chat request that gives none: the replica stops at its model length


class _NoText:
    """A router without a tokenizer: outputs are token ids only."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


class Routed:
    """The router as the server's response helpers see an engine: a tokenizer, and requests that end
    as `RequestOutput`s whose text is decoded here and cut at a stop string, as a replica's engine
    does. `stream` yields the cumulative output after every piece the replica sends."""

    def __init__(self, router: Router) -> None:
        self.router, self.tokenizer = router, router.tokenizer or _NoText()

    async def generate(self, prompt: list[int], params: SamplingParams, request_id: str, **options) -> RequestOutput:
        out = await self.router.generate(_request(prompt, params, request_id, **options))
        return self.grown(RequestOutput(request_id=request_id, prompt_token_ids=prompt), out, params)

    async def stream(self, prompt: list[int], params: SamplingParams, request_id: str,
                     **options) -> AsyncIterator[RequestOutput]:
        out = RequestOutput(request_id=request_id, prompt_token_ids=prompt)
        async for piece in self.router.stream(_request(prompt, params, request_id, **options)):
            out = self.grown(out, piece, params)
            yield out

    def grown(self, out: RequestOutput, piece: GenerateOutput, params: SamplingParams) -> RequestOutput:
        """`out` with the piece's tokens added, in place: a piece costs what it holds, not the whole
        output so far (a new output per piece made a 32,000-token stream copy 11 s of lists)."""
        out.token_ids += piece.token_ids
        out.logprobs += piece.logprobs
        out.top_logprobs += piece.top_logprobs
        if piece.finish_reason is not None:
            out.finished, out.finish_reason, out.num_cached_tokens = True, piece.finish_reason, piece.num_cached_tokens
            out.policy_version, out.version_segments = piece.policy_version, piece.version_segments
            out.prompt_token_logprobs, out.prompt_top_logprobs = piece.prompt_token_logprobs, piece.prompt_top_logprobs
            out.prompt_logprob_ranks = piece.prompt_logprob_ranks
            out.prompt_token_id_logprobs = piece.prompt_token_id_logprobs
            out.routed_experts, out.stop_reason = piece.routed_experts, piece.stop_reason
            eos = {getattr(self.tokenizer, "eos_token_id", None)}
            out.text = self.tokenizer.decode(params.text_ids(out.token_ids, out.finish_reason, eos),
                                             params.skip_special_tokens)
            hits = [(at, x) for x in params.stop if (at := out.text.find(x)) >= 0]
            if hits:
                at, out.stop_reason = min(hits)
                out.text = out.text[:at + (len(out.stop_reason) if params.include_stop_str_in_output else 0)]
                out.finish_reason = "stop"
        return out


def _request(prompt: list[int], params: SamplingParams, request_id: str, group_id: str | None = None,
             session: str | None = None, turn: int = 0, forced_output: list[int] | None = None,
             policy_version: int | None = None, priority: int = 0, cache_salt: str | None = None) -> GenerateRequest:
    return GenerateRequest(prompt_token_ids=prompt, params=params, request_id=request_id, group_id=group_id,
                           trajectory_id=session, turn=turn, forced_output=forced_output, policy_version=policy_version,
                           priority=priority, cache_salt=cache_salt)


class ReplicaBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    url: str = Field(min_length=1)


class EndTrajectoryBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    trajectory_id: str
    group_id: str | None = None
    token_ids: list[int] = Field(default_factory=list)
    num_turns: int = 0


def build_router_app(router: Router, cfg: ServerConfig, replica_api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="rollwise router", docs_url=None, redoc_url=None, default_response_class=FiniteJSONResponse)
    parser = make_parser(cfg.tool_call_parser)
    reasoning = make_reasoning_parser(cfg.reasoning_parser)
    defaults = Defaults(cfg, router.tokenizer)  # (the --tokenizer directory's generation config)

    install_common(app, cfg)

    @app.exception_handler(ReplicaError)
    async def _replica(_: Request, exc: ReplicaError):
        return error(503, str(exc), "unavailable")

    @app.get("/health")
    async def health():
        body = {"status": "ok" if router.healthy else "no healthy replica", "healthy": sorted(router.healthy),
                "replicas": sorted(router.replicas)}
        return JSONResponse(body, status_code=200 if router.healthy else 503)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(router_text(router.metrics()))

    @app.get("/v1/models")
    async def models(request: Request):
        """The models the replicas serve, as a healthy one lists them (OpenAI clients ask first; in
        the Messages API's shape for an anthropic client)."""
        for name in sorted(router.healthy):
            client = getattr(router.replicas.get(name), "client", None)
            try:
                r = await client.get("/v1/models") if client is not None else None
            except httpx.HTTPError:
                continue
            if r is not None and r.status_code == 200:
                return models_page(r.json()) if "anthropic-version" in request.headers else r.json()
        return error(503, "no healthy replica listed its models", "unavailable")

    @app.get("/replicas")
    async def replicas():
        return {"replicas": sorted(router.replicas), "healthy": sorted(router.healthy)}

    @app.post("/replicas")
    async def add_replica(body: ReplicaBody):
        """A new member (http(s)://HOST[:PORT]); one that does not answer /health yet joins unhealthy
        and is routed to once the health loop hears it (`healthy` in the reply says which)."""
        replica = HttpReplica(body.url, replica_api_key)
        if replica.name in router.replicas:
            await replica.close()
            raise ValueError(f"replica {replica.name!r} is already a member")
        up = await replica.health()
        if adapters and not up:
            await replica.close()
            raise ValueError(f"{body.url} does not answer, so it cannot load the route's LoRA adapters "
                             f"{sorted(adapters)}: add it once it is up")
        for name, path in adapters.items():  # the adapters loaded through the route, before it takes requests
            try:
                r = await replica.client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
                why = None if r.status_code == 200 else r.text[:300]
            except httpx.HTTPError as e:
                why = f"{type(e).__name__}: {e}"
            if why is not None:
                await replica.close()
                raise ValueError(f"{body.url} did not load LoRA adapter {name!r} ({path}): {why}")
        router.add_replica(replica, healthy=up)
        return {"replicas": sorted(router.replicas), "healthy": up}

    @app.delete("/replicas")
    async def remove_replica(body: ReplicaBody):
        router.remove_replica(body.url.rstrip("/"))
        return {"replicas": sorted(router.replicas)}

    fan_out = functools.partial(fan_out_to, router)  # (a path on every healthy replica: fanout.py)
    install_fanout(app, router)

    @app.get("/health_generate")
    @app.post("/health_generate")
    async def health_generate():
        """SGLang's: each healthy replica's /health_generate; healthy when one of them is."""
        got = await fan_out("/health_generate", None, "GET")
        body = {"status": "ok" if got else "no replica generates", "replicas_ok": len(got),
                "healthy": len(router.healthy)}
        return JSONResponse(body, status_code=200 if got else 503)

    @app.post("/abort_request")
    async def abort_request(body: AbortRequest):
        """Forwarded to every healthy replica (the one running it aborts it; its caller here gets what
        it has, finish reason "abort")."""
        return {"aborted": [rid for r in await fan_out("/abort_request", body.model_dump()) for rid in r["aborted"]]}

    @app.post("/pause_generation")
    async def pause_generation(body: PauseRequest | None = None):
        got = await fan_out("/pause_generation", (body or PauseRequest()).model_dump())
        return {"success": bool(got), "replicas": len(got), "aborted": [rid for r in got for rid in r["aborted"]]}

    @app.post("/continue_generation")
    async def continue_generation():
        got = await fan_out("/continue_generation", {})
        return {"success": bool(got), "replicas": len(got)}

    @app.get("/flush_cache")
    @app.post("/flush_cache")
    async def flush_cache():
        """Every replica's unheld prefix blocks dropped, and what the router knew of them."""
        got = await fan_out("/flush_cache", {})
        for name in list(router.replicas):
            router.index.remove_replica(name)
        return {"success": bool(got), "replicas": len(got), "evicted_blocks": sum(r["evicted_blocks"] for r in got)}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():  # vLLM's name for it
        await flush_cache()
        return Response(status_code=200)

    adapters: dict[str, str] = {}  # LoRA adapters loaded through the route: name -> path every replica reads

    @app.post("/v1/load_lora_adapter")
    @app.post("/load_lora_adapter")
    async def load_lora(body: LoadLoraRequest):
        """To every healthy replica; the adapter's name then picks it by `model` here too."""
        if refused := weights_refused(cfg):
            return refused
        got = await fan_out("/v1/load_lora_adapter", body.model_dump())
        if len(got) < len(router.healthy) or not got:
            raise ValueError(f"{len(got)} of {len(router.healthy)} replicas loaded LoRA adapter {body.lora_name!r}")
        adapters[body.lora_name] = body.lora_path
        return {"status": "ok", "lora_name": body.lora_name, "replicas": len(got)}

    @app.post("/v1/unload_lora_adapter")
    @app.post("/unload_lora_adapter")
    async def unload_lora(body: UnloadLoraRequest):
        if refused := weights_refused(cfg):
            return refused
        adapters.pop(body.lora_name, None)
        got = await fan_out("/v1/unload_lora_adapter", body.model_dump())
        return {"status": "ok", "lora_name": body.lora_name, "replicas": len(got)}

    def adapted(params, model: str | None):
        return dataclasses.replace(params, lora=model) if model in adapters and params.lora is None else params

    @app.post("/update_weights")
    async def update_weights(request: Request):
        """A model directory every replica can read, to every replica at once (`Router.update_weights`:
        one that fails is kept out of routing until it has them); or vLLM 0.32's weight transfer chunk
        (`{"update_info"}`: every replica receives the trainer's broadcast, fanout.py)."""
        if refused := weights_refused(cfg):
            return refused
        raw = json_object(await request.body())
        if "update_info" in raw:
            return await receive_everywhere(router, raw)
        body = UpdateWeightsRequest.model_validate(raw)
        version = router.policy_version + 1 if body.policy_version is None else body.policy_version
        got = await router.update_weights(body.model_dir, version, body.partial_rollout)
        return {"status": "ok", "policy_version": version, "replicas": got}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateFromDiskRequest):
        """SGLang's form of the same."""
        async def update(path: str, version: int | None) -> int:
            version = router.policy_version + 1 if version is None else version
            try:
                await router.update_weights(path, version)
            except ReplicaError as e:  # no replica took them: SGLang's failed reply, as for bad weights
                raise ValueError(str(e)) from e
            return version

        async def abort_all() -> list[str]:
            return [rid for r in await fan_out("/abort_request", {"abort_all": True}) for rid in r["aborted"]]
        return await load_from_disk(body, cfg, update, abort_all)

    @app.post("/sleep")
    async def sleep(request: Request):
        """Every idle replica sleeps (vLLM's sleep mode; `Router.sleep`): out of routing until /wake_up."""
        if refused := weights_refused(cfg):
            return refused
        level = request.query_params.get("level", "1")
        if level not in ("1", "2"):
            raise ValueError(f"level must be 1 or 2, got {level!r}")
        return {"status": "ok", "asleep": await router.sleep(int(level))}

    @app.post("/wake_up")
    async def wake_up():
        if refused := weights_refused(cfg):
            return refused
        names = sorted(router.asleep)
        await router.wake_up(names)
        return {"status": "ok", "woken": names}

    @app.get("/is_sleeping")
    async def is_sleeping():
        return {"is_sleeping": bool(router.asleep), "asleep": sorted(router.asleep)}

    @app.post("/end_trajectory")
    async def end_trajectory(body: EndTrajectoryBody):
        await router.end_trajectory(body.trajectory_id, body.group_id, body.token_ids, body.num_turns)
        return {"status": "ok"}

    routed = Routed(router)

    def runs(body, request: Request, prompt: list[int], params: SamplingParams, rid: str) -> list[tuple]:
        """(prompt, params, request id, group, options) of the body's n samples of one prompt: sample j
        of trajectory t is trajectory t/j; trajectory and group also from X-Session-Id / X-Group-Id."""
        n, group = body.n, body.group_id or request.headers.get("x-group-id")
        tid = body.trajectory_id or request.headers.get("x-session-id")
        return choice_samples([prompt], params, n, group, rid, lambda j: {
            "session": f"{tid}/{j}" if tid and n > 1 else tid, "turn": body.turn or 0, "priority": body.priority,
            "cache_salt": body.cache_salt})

    @app.post("/generate")
    async def generate(body: GenerateBody, request: Request):
        if body.input_ids is None or body.prompt is not None or body.text is not None:
            raise ValueError("the router takes input_ids (token ids), not prompt text")
        if not body.input_ids:
            raise ValueError("input_ids must not be empty")
        rid = body.request_id or body.rid or f"gen-{uuid.uuid4().hex[:16]}"
        if is_batch(body.input_ids):  # SGLang's batch form: each prompt routed, a list of replies
            group = body.group_id or request.headers.get("x-group-id")
            return await unless_disconnected(request, generate_batch(routed, routed.tokenizer, body, body.input_ids,
                                                                     rid, group))
        params = generate_params(body)
        options = {"session": body.trajectory_id or request.headers.get("x-session-id"), "turn": body.turn or 0,
                   "forced_output": body.forced_output, "policy_version": body.policy_version,
                   "priority": body.priority, "cache_salt": body.cache_salt}
        group = body.group_id or request.headers.get("x-group-id")
        if params.n > 1:  # SGLang's parallel sampling: n turns of one group, placed as such
            return await unless_disconnected(request, generate_samples(routed, routed.tokenizer, body, body.input_ids,
                                                                       params, rid, group))
        if body.stream:
            return sse(await primed(stream_generate(routed, body.input_ids, params, rid, group, **options)))
        out = await unless_disconnected(request, router.generate(_request(body.input_ids, params, rid, group, **options)))
        whole = routed.grown(RequestOutput(request_id=rid, prompt_token_ids=body.input_ids), out, params)
        return generate_json(whole) | {"replica": out.replica} | sglang_fields(routed.tokenizer, whole, body)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompt = body.prompt
        if isinstance(prompt, str):
            if router.tokenizer is None:
                raise ValueError("this router has no tokenizer (--tokenizer): send token ids as the prompt")
            prompt = router.tokenizer.encode(prompt, body.add_special_tokens is not False)
        if not prompt or not all(isinstance(t, int) for t in prompt):
            raise ValueError("prompt must be a string or one non-empty list of token ids")
        prompt = body.truncated(prompt, None)  # (-1 keeps it all: a replica refuses a prompt past its length)
        rid, base = body.reply_ids("cmpl", request.headers)
        samples = runs(body, request, prompt, adapted(completion_params(body, defaults.sampling), body.model), base)
        echoed = body.prompt if body.truncate_prompt_tokens is None else prompt
        return await completion_reply(routed, body, request, samples, rid, body.model, [echoed],
                                      body.return_tokens_as_token_ids or router.tokenizer is None)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        """Chat through the router: the router's tokenizer renders the chat template, the turn is
        routed as token ids, and the reply is decoded here (stop strings cut as the replica does)."""
        tok = router.tokenizer
        if tok is None:
            raise ValueError("this router has no tokenizer (--tokenizer): chat needs its chat template")
        if body.top_logprobs and not body.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        render = defaults.renderer(body)  # (the tokenizer's template, or the request's own where trusted)
        ids = body.truncated(render.encode_chat([m.model_dump(exclude_none=True) for m in body.messages],
                                                body.add_generation_prompt, body.tools, body.continue_final_message,
                                                bool(body.add_special_tokens), **defaults.kwargs(body)), None)
        # no max_tokens: up to the replica's model length (its engine stops there)
        limit = body.asked_tokens(defaults.sampling.get("max_tokens") or UNTIL_MODEL_LEN)
        params = adapted(body.sampling(limit, body.top_logprobs or 0, tok, parser, defaults.sampling), body.model)
        rid, base = body.reply_ids("chatcmpl", request.headers)
        return await chat_reply(routed, body, request, runs(body, request, ids, params, base), rid, body.model, ids,
                                parser, reasoning)

    install_responses(app, chat)  # the Responses API, as chat through the router
    install_messages(app, chat, router.tokenizer, defaults)  # and Anthropic's Messages API
    install_tokenize(app, router.tokenizer, defaults, None)
    install_tito(app, routed, None, defaults, adapt=adapted)  # vLLM's token-in-token-out API, routed
    return app
