"""SGLang's control endpoints, for RL frameworks that drive SGLang servers (e.g. AReaL, slime):
abort requests, pause and continue generation (around a weight update), load new weights from
disk or from a trainer's process group (rollwise.engine.group_transfer), read one back by name,
flush the prefix cache, model info; and its /generate dialect (`generate_params`: its
sampling names, `sglang_fields`: its reply fields).
Their bodies and replies follow SGLang's; the work is `rollwise serve`'s own."""
from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Awaitable, Callable
from typing import Literal

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from rollwise import __version__
from rollwise.config import ServerConfig
from rollwise.serve.protocol import AbortRequest
from rollwise.serve.responses import _piece, choice_samples, error, generate_json, weights_refused
from rollwise.serve.streams import gather_or_cancel
from rollwise.types import RequestOutput, SamplingParams
from rollwise.wire import GROUP, encode_routing


class UpdateFromDiskRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # SGLang's other options (load_format, ...) do not apply
    model_path: str
    weight_version: str | None = None  # our policy version when it is an integer; default: the next one
    abort_all_requests: bool = False  # True: requests in flight end now (finish reason "abort")


class PauseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    # abort: requests in flight end now with what they have (SGLang's default; a client resubmits
    # them with their tokens); in_place: they wait with their KV, and go on after /continue_generation
    # under the weights they began with; retract: they wait with their KV dropped, and a weight update
    # before /continue_generation moves them onto the new weights (their tokens recomputed under them)
    mode: Literal["abort", "in_place", "retract"] = "abort"


class GroupInit(BaseModel):  # SGLang's init_weights_update_group
    model_config = ConfigDict(extra="forbid", strict=True)
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = GROUP
    backend: str = "gloo"  # (SGLang's default, "nccl", needs GPUs)
    timeout_s: float = Field(300.0, gt=0, le=86400)  # rollwise's own: how long the join and each receive may wait


class GroupUpdate(BaseModel):  # SGLang's update_weights_from_distributed
    model_config = ConfigDict(extra="forbid", strict=True)
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = GROUP
    weight_version: str | None = None  # our policy version when it is an integer; default: the next one
    abort_all_requests: bool = False
    load_format: Literal["auto", "flattened_bucket"] | None = None  # flattened_bucket: one broadcast
    flush_cache: bool = True  # (nothing to do: cached blocks are keyed by their weights' version)
    torch_empty_cache: bool = False  # (no CUDA cache here)
    partial_rollout: bool = False  # rollwise's own: requests in flight continue under the new weights
    update_id: int | None = None  # rollwise's own: a trainer's that takes part in the handshake (handshake.py)


class GroupName(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    group_name: str = GROUP


class WeightsByName(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    truncate_size: int = Field(100, ge=1)


def version_of(weight_version: str | None) -> int | None:
    """SGLang's weight version string as our policy version: an integer's, else the next one."""
    return int(weight_version) if weight_version and weight_version.isdigit() else None


async def update_from_group(engine, body: GroupUpdate) -> tuple[bool, str]:
    """SGLang's update_weights_from_distributed on an AsyncEngine: the weights named, received off the
    engine's thread (it keeps serving) as the trainer broadcasts them, then one weight update (a
    bucket replaces those weights of the newest; the same integer weight_version again writes into
    that version). Whatever the update's fate, the group stays usable: a refusal in the handshake
    comes before any broadcast, one after it once they are all taken. abort_all_requests aborts the
    requests in flight once the weights came, just before the update (a refused one aborts none)."""
    aborted: list[str] = []
    try:
        weights = await asyncio.to_thread(engine.engine.group_receiver.receive, body.names, body.dtypes, body.shapes,
                                          body.group_name, body.load_format == "flattened_bucket", body.update_id)
        aborted = await engine.abort_all() if body.abort_all_requests else []
        if weights:
            await engine.update_weights(weights, version_of(body.weight_version), body.partial_rollout)
    except ValueError as e:
        return False, str(e)
    return True, (f"Succeeded to update parameter online: {len(body.names)} weights, version {engine.policy_version}"
                  f"{f', {len(aborted)} requests aborted' if aborted else ''}.")


def weights_by_name(engine, name: str, truncate_size: int) -> list:
    """SGLang's get_weights_by_name: a weight's first `truncate_size` rows, by its Hugging Face name."""
    tensors = engine.engine.runner.model.hf_tensors()
    if name not in tensors:
        raise ValueError(f"{name!r} is not a weight of this model (e.g. {next(iter(tensors))!r})")
    return tensors[name][:truncate_size].float().tolist()


def sglang_reply(ok: bool, message: str) -> dict | JSONResponse:
    return {"success": True, "message": message} if ok else JSONResponse({"success": False, "message": message},
                                                                         status_code=400)


async def load_from_disk(body: UpdateFromDiskRequest, cfg: ServerConfig,
                         update: Callable[[str, int | None], Awaitable[int]],
                         abort_all: Callable[[], Awaitable[list[str]]]):
    """/update_weights_from_disk, on a server (`update`: its engine's) or a router (every replica):
    the weight-update rule, the version (SGLang's string; ours when an integer), SGLang's reply."""
    if refused := weights_refused(cfg):
        return refused
    version = version_of(body.weight_version)
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
        mode = (body or PauseRequest()).mode
        aborted = await engine.pause(abort=mode == "abort", retract=mode == "retract")
        return {"success": True, "message": "Generation paused.", "aborted": aborted}

    @app.post("/continue_generation")
    async def continue_generation():
        await engine.resume()
        return {"success": True, "message": "Generation continued."}

    @app.post("/abort_request")
    async def abort_request(body: AbortRequest):
        """By rid (one not in flight: the samples `rid-j` of a /generate with sampling_params.n), or all."""
        return {"aborted": await abort_rid(engine, body.rid, body.abort_all)}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateFromDiskRequest):
        """Requests in flight finish under the weights they started with (unless aborted)."""
        return await load_from_disk(body, cfg, lambda path, v: engine.update_weights(path, v, False), engine.abort_all)

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(body: GroupInit):
        """Join the trainer's group (waits for every rank to join, off the engine's thread)."""
        if refused := weights_refused(cfg):
            return refused
        try:
            await asyncio.to_thread(engine.engine.group_receiver.init, body.master_address, body.master_port,
                                    body.rank_offset, body.world_size, body.group_name, body.backend, body.timeout_s)
        except ValueError as e:
            return sglang_reply(False, str(e))
        return {"success": True, "message": f"Initialized group {body.group_name!r} as rank {body.rank_offset}.",
                "update_handshake": True}  # (rollwise's own: its updates take part in the handshake)

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(body: GroupUpdate):
        if refused := weights_refused(cfg):
            return refused
        return sglang_reply(*await update_from_group(engine, body))

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(body: GroupName | None = None):
        name = (body or GroupName()).group_name
        try:
            await asyncio.to_thread(engine.engine.group_receiver.destroy, name)
        except ValueError as e:
            return sglang_reply(False, str(e))
        return sglang_reply(True, f"Destroyed group {name!r}.")

    @app.get("/get_weights_by_name")
    @app.post("/get_weights_by_name")
    async def get_weights_by_name(body: WeightsByName):
        return await engine.call(lambda: weights_by_name(engine, body.name, body.truncate_size))

    @app.get("/flush_cache")
    @app.post("/flush_cache")
    async def flush_cache():
        """Drop every cached prefix block no request holds. (Not needed after a weight update: blocks
        are keyed by their weights' version, so old ones are never reused.)"""
        evicted = await engine.call(engine.engine.blocks.evict_cached)
        return {"success": True, "message": "Cache flushed.", "evicted_blocks": evicted}

    @app.get("/get_model_info")
    async def get_model_info():
        return {"model_path": engine.engine.config.model, "tokenizer_path": engine.engine.config.model,
                "is_generation": True, "weight_version": str(engine.policy_version)}

    @app.get("/get_server_info")
    async def get_server_info():
        return server_info(engine)

    @app.get("/health_generate")
    @app.post("/health_generate")
    async def health_generate():
        """SGLang's: healthy when the engine generates a token within HEALTH_GENERATE_S (503 if not). A
        paused or sleeping server, or one waiting for its weights (load_format "dummy"), is healthy
        without generating: it holds its requests on purpose."""
        if not engine.is_running:
            return error(503, "the engine is not running", "unavailable")
        if engine.paused or engine.engine.asleep or engine.engine.weights_lost:  # (held or waiting for weights)
            return {"status": "ok", "generated": False, "paused": engine.paused,
                    "sleeping": sorted(engine.engine.asleep), "weights_missing": len(engine.engine.weights_missing)}
        rid = f"health-{uuid.uuid4().hex[:12]}"
        try:
            out = await asyncio.wait_for(engine.generate([0], SamplingParams(max_tokens=1, temperature=0), rid),
                                         HEALTH_GENERATE_S)
        except (TimeoutError, asyncio.TimeoutError):  # (the wait cancels the request, which aborts it)
            return error(503, f"no token generated within {HEALTH_GENERATE_S:g} s", "unavailable")
        if out.finish_reason == "abort" or not out.token_ids:
            return error(503, "the health check's request was aborted", "unavailable")
        return {"status": "ok", "generated": True}


HEALTH_GENERATE_S = 20.0


def server_info(engine) -> dict:
    """SGLang's server info: the engine's settings, and its state (the metrics of /metrics) in `internal_states`."""
    state = {**engine.metrics(), "paused": engine.paused, "sleeping": sorted(engine.engine.asleep)}
    return {**dataclasses.asdict(engine.engine.config), "max_model_len": engine.engine.max_model_len,
            "version": __version__, "weight_version": str(engine.policy_version), "internal_states": [state]}


async def abort_rid(engine, rid: str | None, abort_all: bool = False) -> list[str]:
    """SGLang's abort: every request in flight, or one by rid (with the samples `rid-j` of a /generate
    with sampling_params.n); the ids aborted."""
    return await (engine.abort_all() if abort_all else engine.abort_samples(rid))


SGLANG_RENAMED = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "no_stop_trim": "include_stop_str_in_output"}


def generate_params(body, given: dict | None = None) -> SamplingParams:
    """/generate's sampling_params (`given`: one prompt's of a batch), SGLang's names too (its clients
    and router send only those), its logprob options (`top_logprobs_num` k asks the k most likely
    tokens per position, `return_logprob` with `logprob_start_len` >= 0 the prompt's logprobs), and
    SGLang's `lora_path`: the name of a loaded adapter."""
    if given is None and any(isinstance(getattr(body, k), list) for k in ("sampling_params", "rid", *PER_PROMPT)):
        raise ValueError(f"sampling_params, rid and {', '.join(PER_PROMPT)} are lists (one per prompt) only with a "
                         "list of prompts")
    given = body.sampling_params if given is None else given
    sp = dict(given)
    for old, new in SGLANG_RENAMED.items():
        if old in sp:
            if new in sp and sp[new] != sp[old]:
                raise ValueError(f"{new} and {old} (its SGLang name) disagree")
            sp[new] = sp.pop(old)
    sglang = {k: sp.pop(k) for k in ("json_schema", "regex", "ebnf") if k in sp}  # SGLang's structured outputs
    if sglang:
        if len(sglang) > 1 or "structured_outputs" in sp:
            raise ValueError("give one of json_schema, regex, ebnf (SGLang's) or structured_outputs")
        (k, v), = sglang.items()
        if k == "ebnf":
            raise ValueError("ebnf grammars are not taken; give structured_outputs.grammar (Lark) instead")
        sp["structured_outputs"] = {"json" if k == "json_schema" else k: v}
    if body.top_logprobs_num:
        sp.setdefault("logprobs", body.top_logprobs_num)
    if body.return_routed_experts:
        sp["return_routed_experts"] = True
    if body.return_logprob and body.logprob_start_len is not None and body.logprob_start_len >= 0:
        sp.setdefault("prompt_logprobs", body.top_logprobs_num or 0)
    if body.lora_path is not None:
        sp["lora"] = body.lora_path
    return SamplingParams.from_dict(sp)


def _several(body, what: str) -> None:
    """A body that makes several requests takes no stream, trajectory or forced output (send them one by one)."""
    if body.stream or body.trajectory_id is not None or body.forced_output is not None:
        raise ValueError(f"{what} makes several requests: it takes no stream, trajectory_id or forced_output "
                         "(send the requests one by one, with one group_id)")


def is_batch(prompt) -> bool:
    """SGLang's batch form of /generate: a list of prompts (token-id lists or texts)."""
    return isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)


PER_PROMPT = ("return_logprob", "top_logprobs_num", "logprob_start_len", "lora_path")  # SGLang's: a list, one each


async def generate_batch(engine, tok, body, prompts: list, rid: str | list[str], group: str | None = None) -> list:
    """/generate with a list of prompts, as SGLang answers it: their replies in order (n each with
    sampling_params.n); `sampling_params` and each of PER_PROMPT one for all or one each, `rid` a
    list (else `rid-i`)."""
    _several(body, "a list of prompts")
    n = len(prompts)
    sps = body.sampling_params if isinstance(body.sampling_params, list) else [body.sampling_params] * n
    rids = rid if isinstance(rid, list) else [f"{rid}-{i}" for i in range(n)]
    lists = {k: getattr(body, k) for k in PER_PROMPT if isinstance(getattr(body, k), list)}
    if len(sps) != n or len(rids) != n or any(len(v) != n for v in lists.values()):
        raise ValueError(f"{n} prompts take one sampling_params or {n}, {n} rids, and one or {n} of each of "
                         f"{', '.join(PER_PROMPT)}")
    bodies = [body.model_copy(update={k: v[i] for k, v in lists.items()}) for i in range(n)]  # as each prompt sees it
    params = [generate_params(b, sp) for b, sp in zip(bodies, sps)]  # (all checked before any runs)
    options = {"group_id": group or body.group_id, "policy_version": body.policy_version, "priority": body.priority,
               "cache_salt": body.cache_salt}

    async def one(p, sp: SamplingParams, r: str, b) -> list[dict]:
        if sp.n > 1:
            return await generate_samples(engine, tok, b, p, sp, r, group)
        out = await engine.generate(p, sp, r, **options)
        return [generate_json(out) | sglang_fields(tok, out, b)]
    return [x for xs in await gather_or_cancel(one(*a) for a in zip(prompts, params, rids, bodies)) for x in xs]


async def generate_samples(engine, tok, body, prompt, params: SamplingParams, rid: str,
                           group: str | None = None) -> list[dict]:
    """/generate with sampling_params.n > 1, as SGLang answers it: a list of n replies, the samples
    of OpenAI's n (`choice_samples`: sample j `rid-j`, seeded seed + j; the n one group, `group` or
    the body's unless named, that drafts and is placed together)."""
    _several(body, "sampling_params.n > 1")
    options = {"policy_version": body.policy_version, "priority": body.priority, "cache_salt": body.cache_salt}
    samples = choice_samples([prompt], params, params.n, group or body.group_id, rid, lambda j: options)
    outs = await gather_or_cancel(engine.generate(p, sp, r, group_id=g, **o) for p, sp, r, g, o in samples)
    return [generate_json(o) | sglang_fields(tok, o, body) | {"index": j} for j, o in enumerate(outs)]


def sglang_fields(tok, out: RequestOutput, body) -> dict:
    """SGLang's /generate reply fields, beside ours: `output_ids` and `meta_info` (finish reason as
    {"type", "matched" / "length"}, token counts, and with `return_logprob` the logprobs as
    [logprob, token id, text or None] triples), as SGLang clients such as AReaL's and slime's read them."""
    piece = (lambda t: _piece(tok, t)) if body.return_text_in_logprobs else (lambda t: None)
    reason = None if out.finish_reason is None else {"type": out.finish_reason, **(
        {"matched": out.stop_reason} if out.finish_reason == "stop" else
        {"length": len(out.token_ids)} if out.finish_reason == "length" else {})}
    meta = {"id": out.request_id, "finish_reason": reason, "prompt_tokens": len(out.prompt_token_ids),
            "completion_tokens": len(out.token_ids), "cached_tokens": out.num_cached_tokens,
            "weight_version": str(out.policy_version)}
    if body.return_logprob:
        meta["output_token_logprobs"] = [[lp, t, piece(t)] for t, lp in zip(out.token_ids, out.logprobs)]
        if body.top_logprobs_num:
            meta["output_top_logprobs"] = [[[v, t, piece(t)] for t, v in top.items()] for top in out.top_logprobs]
        if out.prompt_token_logprobs is not None:
            start = body.logprob_start_len
            meta["input_token_logprobs"] = [[lp, t, piece(t)] for t, lp in
                                            zip(out.prompt_token_ids, out.prompt_token_logprobs)][start:]
            if body.top_logprobs_num:
                meta["input_top_logprobs"] = [None if top is None else [[v, t, piece(t)] for t, v in top.items()]
                                              for top in out.prompt_top_logprobs][start:]
    if body.return_routed_experts and out.routed_experts is not None:  # (asked the SGLang way: where it puts them)
        meta["routed_experts"] = encode_routing(out.routed_experts)
    return {"output_ids": out.token_ids, "meta_info": meta}
