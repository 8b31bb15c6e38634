"""vLLM 0.32's token-in-token-out API, `POST /inference/v1/generate`: token ids and vLLM's
SamplingParams in; token ids, their logprobs (with the most likely ones, as vLLM lists them), the
finish, routed experts (base64 .npy) and weight labels out, in vLLM's body shapes; the prompt's
logprobs, and with prompt_logprob_token_ids its rows' given tokens scored (a teacher's logprobs of a
student's candidates: `prompt_token_id_logprobs`, base64 .npy [rows, ids]). Streamed as vLLM
streams it (a chunk per step of each choice, a usage chunk with stream_options.include_usage,
then `[DONE]`). `output_mode: "text"` adds the text. vLLM's multimodal, KV-transfer and
token-offset fields are refused when given (nothing here takes them)."""
from __future__ import annotations

import time
import uuid
from contextlib import aclosing
from typing import Any, Literal

from fastapi import FastAPI, Request
from pydantic import Field

from rollwise.engine.deltas import deltas
from rollwise.serve.handlers import unless_disconnected
from rollwise.serve.lora import with_adapter
from rollwise.serve.protocol import _Strict
from rollwise.serve.responses import choice_samples, error, finite as _lp
from rollwise.serve.streams import gather_or_cancel, merged, primed, sse
from rollwise.types import RequestOutput, SamplingParams
from rollwise.wire import npy64

REFUSED = ("token_offsets", "features", "content_parts", "kv_transfer_params", "ec_transfer_params",
           "reasoning_ended", "reasoning_parser_kwargs")


class TitoRequest(_Strict):
    request_id: str | None = None
    token_ids: list[int] = Field(min_length=1)
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    model: str | None = None
    output_mode: Literal["tokens", "text"] = "tokens"
    return_token_ids: bool | None = None
    stream: bool | None = False
    stream_options: dict[str, bool] | None = None  # include_usage, continuous_usage_stats
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    priority: int = 0
    token_offsets: Any = None
    features: Any = None
    content_parts: Any = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None
    reasoning_ended: Any = None
    reasoning_parser_kwargs: Any = None


def token_logprobs(ids: list[int], lps: list[float], tops: list[dict[int, float]], k: int) -> dict:
    """vLLM's tokens-mode logprobs: each token's logprob and rank (its place among the most likely,
    where it is one of them, else its rank in the vocabulary where the engine gave one), and the
    first max(k, 1) entries of its position's {token: Logprob} (the token first, then the most
    likely), as vLLM enumerates them."""
    content = []
    for i, (t, lp) in enumerate(zip(ids, lps)):
        top = tops[i] if i < len(tops) and tops[i] else {}
        ranks = {x: r for r, x in enumerate(top, 1)}
        rank = ranks.get(t, getattr(top, "rank", None))
        entries = [(t, lp, rank)] + [(x, v, ranks[x]) for x, v in top.items() if x != t]
        content.append({"token_id": t, "logprob": _lp(lp), "rank": rank,
                        "top_logprobs": [{"token_id": x, "logprob": _lp(v), "rank": r}
                                         for x, v, r in entries[:max(k, 1)]]})
    return {"content": content}


def _choice(index: int, ids: list[int], lps: list[float], tops: list, k: int | None,
            final: RequestOutput | None, text: str | None, whole: bool = False) -> dict:
    """One choice: the tokens given (all of them, or a stream's new ones), with what the final output
    adds (its finish, routed experts and weight labels); `whole`: a full reply (its finish "stop"
    unless named)."""
    c = {"index": index, "logprobs": None if k is None else token_logprobs(ids, lps, tops, k),
         "finish_reason": None if final is None else final.finish_reason or ("stop" if whole else None),
         "stop_reason": None if final is None else final.stop_reason, "token_ids": ids,
         "routed_experts": None if final is None or final.routed_experts is None else npy64(final.routed_experts),
         "sampling_mask": None,
         "weight_versions": None if final is None or final.weight_versions is None else [
             {"version": s.version, "start": s.start, "end": s.end} for s in final.weight_versions]}
    return c if text is None else {**c, "text": text}


def prompt_logprobs(out: RequestOutput) -> list | None:
    if out.prompt_token_logprobs is None:
        return None
    return [None if pos is None else {str(t): {"logprob": _lp(p.logprob), "rank": p.rank,
                                               "decoded_token": p.decoded_token} for t, p in pos.items()}
            for pos in out.prompt_logprobs]


def usage(prompt: int, completion: int, nulls: bool = True) -> dict:
    """vLLM's usage; a stream's leaves out its null details, as vLLM's does."""
    got = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    return got | {"prompt_tokens_details": None, "completion_tokens_details": None} if nulls else got


def install_tito(app: FastAPI, engine, model_name: str | None, defaults, adapt=None) -> None:
    """On `rollwise serve` (`engine`: its AsyncEngine) and `rollwise route` (the router as an engine,
    `adapt` its LoRA adapter naming)."""
    adapt = adapt or (lambda params, model: with_adapter(engine, params, model))

    @app.post("/inference/v1/generate")
    async def generate(body: TitoRequest, request: Request):
        given = [k for k in REFUSED if getattr(body, k) is not None]
        if given:
            return error(400, f"{', '.join(given)}: not taken here (no multimodal inputs, KV transfer or reasoning "
                              "hand-off on this engine)")
        sp = {**defaults.sampling, **body.sampling_params}
        params = adapt(SamplingParams.from_dict(sp), body.model)
        if body.stream and params.prompt_logprob_token_ids is not None:
            return error(400, "prompt_logprob_token_ids are not available when stream=true (as in vLLM)")
        k = sp.get("logprobs")  # (vLLM's None: no logprobs in the reply; the engine keeps the sampled ones anyway)
        rid = f"generate-tokens-{body.request_id or uuid.uuid4().hex}"
        samples = choice_samples([body.token_ids], params, params.n, None, rid,
                                 lambda j: {"priority": body.priority, "cache_salt": body.cache_salt})
        text_mode = body.output_mode == "text"
        head = {"request_id": rid}
        if body.stream:
            return sse(await primed(_stream(engine, body, samples, k, head, text_mode)))
        outs = await unless_disconnected(request, gather_or_cancel(
            [engine.generate(p, sp_j, r, group_id=g, **o) for p, sp_j, r, g, o in samples]))
        return {**head, "model": body.model or model_name or "", "created": int(time.time()),
                "usage": usage(len(body.token_ids), sum(len(o.token_ids) for o in outs)),
                "prompt_logprobs": prompt_logprobs(outs[0]),
                "prompt_token_id_logprobs": None if (a := outs[0].prompt_token_id_logprobs) is None else npy64(a),
                "prompt_token_ids": body.token_ids if body.return_token_ids else None,
                "output_mode": body.output_mode, "mm_placeholders": None, "metrics": None,  # (vLLM's, none here)
                "kv_transfer_params": None, "ec_transfer_params": None,
                "choices": [_choice(j, o.token_ids, o.logprobs, o.top_logprobs, k, o, o.text if text_mode else None,
                                    whole=True) for j, o in enumerate(outs)]}


async def _stream(engine, body: TitoRequest, samples: list, k: int | None, head: dict, text_mode: bool):
    """A chunk per step of each choice with new tokens (or text, or its end), the first with the
    prompt's ids when asked; then the usage when asked."""
    opts = body.stream_options or {}
    counts = [0] * len(samples)

    async def one(j, prompt, sp, r, g, o):
        async with aclosing(deltas(engine, prompt, sp, r, g, **o)) as steps:
            async for ids, lps, tops, delta, final in steps:
                counts[j] += len(ids)
                if ids or final is not None or (text_mode and delta):
                    yield _choice(j, ids, lps, tops, k, final, delta if text_mode else None)

    first = True
    async with aclosing(merged([one(j, *s) for j, s in enumerate(samples)])) as choices:
        async for c in choices:
            chunk = {**head, "output_mode": body.output_mode, "choices": [c]}
            if first and body.return_token_ids:
                chunk["prompt_token_ids"] = body.token_ids
            first = False
            if opts.get("continuous_usage_stats"):
                chunk["usage"] = usage(len(body.token_ids), counts[c["index"]], nulls=False)
            yield chunk
    if opts.get("include_usage"):
        yield {**head, "output_mode": body.output_mode, "choices": [],
               "usage": usage(len(body.token_ids), sum(counts), nulls=False)}
