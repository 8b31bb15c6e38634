"""The response bodies and event streams of the HTTP APIs (OpenAI completions and chat, /generate),
shared by `rollwise serve` and `rollwise route`: choices, logprobs in each API's format, tool calls
parsed from chat replies, and streams built from an engine's cumulative outputs."""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi.responses import JSONResponse

from rollwise.agent.parsing import HermesParser, ToolCallParser, openai_tool_calls as tool_calls
from rollwise.agent.reasoning import ReasoningParser, ReasoningStream
from rollwise.config import ServerConfig
from rollwise.engine.deltas import deltas
from rollwise.serve.protocol import ChatCompletionRequest, CompletionRequest
from rollwise.types import RequestOutput, SamplingParams
from rollwise.wire import encode_routing, npy64


def finite(x):
    """`x` (JSON-able) with each non-finite float as vLLM writes a logprob: -9999.0 for -inf (a token a
    mask or a top-k / top-p cut left out) and NaN, 9999.0 for inf."""
    if isinstance(x, float):
        return x if math.isfinite(x) else 9999.0 if x > 0 else -9999.0
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    return [finite(v) for v in x] if isinstance(x, (list, tuple)) else x


def dumps(obj, **kw) -> str:
    """json.dumps without NaN or Infinity, which are not JSON (a strict client fails on them): `finite`'s
    values in their place, the body walked for them only where one occurs."""
    try:
        return json.dumps(obj, allow_nan=False, **kw)
    except ValueError:
        return json.dumps(finite(obj), allow_nan=False, **kw)


class FiniteJSONResponse(JSONResponse):
    """The apps' JSON responses, as starlette writes them but with `finite`'s values for non-finite
    floats: a request for more top logprobs than a mask leaves tokens (allowed_token_ids, a structured
    output) was refused before, its -inf logprobs not being JSON."""

    def render(self, content) -> bytes:
        return dumps(content, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def weights_refused(cfg: ServerConfig) -> JSONResponse | None:
    """A weight update is refused (403) on a server off loopback started without an API key."""
    if not cfg.api_key and not cfg.is_loopback:
        return error(403, "weight updates off loopback need the server started with --api-key", "permission_error")
    return None


def generate_json(out: RequestOutput) -> dict:
    return {"request_id": out.request_id, "token_ids": out.token_ids, "logprobs": out.logprobs,
            "text": out.text, "finish_reason": out.finish_reason, "stop_reason": out.stop_reason,
            "num_cached_tokens": out.num_cached_tokens, "prompt_len": len(out.prompt_token_ids),
            "policy_version": out.policy_version, "version_segments": out.version_segments,
            **({"top_logprobs": pairs(out.top_logprobs), "top_logprob_ranks": ranks(out.top_logprobs)}
               if out.top_logprobs else {}),
            **({} if out.routed_experts is None else {  # SGLang's encoding (base64 int32) and the shape
                "routed_experts": encode_routing(out.routed_experts),
                "routed_experts_shape": list(out.routed_experts.shape)}),
            **({} if out.prompt_token_id_logprobs is None else {  # vLLM's scores of given ids, as its npy base64
                "prompt_token_id_logprobs": npy64(out.prompt_token_id_logprobs)}),
            **({} if out.prompt_token_logprobs is None else {
                "prompt_logprobs": out.prompt_token_logprobs,
                "prompt_top_logprobs": [None] + pairs(out.prompt_top_logprobs[1:]),
                "prompt_logprob_ranks": out.prompt_logprob_ranks})}


def pairs(tops: list[dict[int, float]]) -> list[list[list]]:
    """Top logprobs as JSON keeps token ids: per token, [[id, logprob], ...] best first."""
    return [[[t, lp] for t, lp in top.items()] for top in tops]


def ranks(tops: list[dict[int, float]]) -> list[int | None]:
    """Each token's rank in the vocabulary, where its top logprobs carry one (TopLogprobs)."""
    return [getattr(top, "rank", None) for top in tops]


def choice_samples(prompts: list, params: SamplingParams, n: int, group_id: str | None, rid: str,
                   options=lambda j: {}) -> list[tuple]:
    """(prompt, params, request id, group, options) of each choice, choice i * n + j being prompt i's
    sample j: request id `rid-(i * n + j)`, seeded seed + j, one drafting group per prompt when n > 1
    (unless the request names one), and `options(j)` for the engine or router."""
    return [(p, params.for_sample(j), f"{rid}-{i * n + j}", group_id or (f"{rid}-p{i}" if n > 1 else None), options(j))
            for i, p in enumerate(prompts) for j in range(n)]


def usage(outs: list[RequestOutput], n: int = 1) -> dict:
    """OpenAI's usage: each prompt counted once however many samples it has."""
    p = sum(len(o.prompt_token_ids) for o in outs[::n])
    c = sum(len(o.token_ids) for o in outs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outs[::n])}}


def _piece(tok, t: int, as_ids: bool = False) -> str:
    return f"token_id:{t}" if as_ids else tok.decode([t], skip_special_tokens=False)


def completion_tops(tok, tops: list[dict[int, float]], as_ids: bool = False) -> list[dict[str, float]] | None:
    """OpenAI completions' `top_logprobs`: per token {piece: logprob}, best first (None if none asked)."""
    return [None if top is None else {_piece(tok, t, as_ids): lp for t, lp in top.items()} for top in tops] if tops else None


def completion_params(body: CompletionRequest, defaults: dict | None = None) -> SamplingParams:
    """`defaults`: the model's generation config's sampling fields, for those the request leaves out."""
    defaults = defaults or {}
    given = body.max_tokens is not None and "max_tokens" in body.model_fields_set
    max_tokens = body.max_tokens if given else defaults.get("max_tokens", 16)
    # echo with max_tokens 0: the prompt alone, to score it (OpenAI's legacy form, vLLM's): one token is
    # generated, as vLLM generates it, and left out of the reply's text and logprobs
    params = body.sampling(1 if body.prompt_only() else max_tokens, body.logprobs or 0, defaults=defaults)
    if body.echo and body.logprobs is not None:  # e.g. lm-eval's loglikelihood: the prompt tokens' logprobs
        params = dataclasses.replace(params, prompt_logprobs=max(body.logprobs, body.prompt_logprobs or 0))
    return params


def vllm_prompt_logprobs(tok, out: RequestOutput) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs` in JSON: RequestOutput.prompt_logprobs with each Logprob a dict
    {"logprob", "rank", "decoded_token"} under its token id as a string."""
    got = dataclasses.replace(out, tokenizer=tok).prompt_logprobs
    return None if got is None else [None if pos is None else {str(t): {
        "logprob": x.logprob, "rank": x.rank, "decoded_token": x.decoded_token} for t, x in pos.items()} for pos in got]


def completion_choices(tok, body: CompletionRequest, prompts: list, outs: list[RequestOutput], as_ids: bool) -> list[dict]:
    """OpenAI's completion choices (choice i * n + j is prompt i's sample j); `echo` puts the prompt
    (as sent, or decoded from its ids) before each."""
    echoed = [(p if isinstance(p, str) else tok.decode(p, skip_special_tokens=False)) if body.echo else ""
              for p in prompts]
    alone = body.prompt_only()  # (echo with max_tokens 0: the prompt alone)
    return [{"index": i, "text": echoed[i // body.n] + ("" if alone else o.text), "finish_reason": o.finish_reason,
             "stop_reason": o.stop_reason,
             "logprobs": None if body.logprobs is None else _completion_logprobs(tok, o, as_ids, body.echo, not alone),
             **({"prompt_logprobs": vllm_prompt_logprobs(tok, o)} if body.prompt_logprobs is not None else {}),
             **({"prompt_token_ids": o.prompt_token_ids, "token_ids": o.token_ids} if body.return_token_ids else {})}
            for i, o in enumerate(outs)]


def _completion_logprobs(tok, out: RequestOutput, as_ids: bool = False, echo: bool = False,
                         generated: bool = True) -> dict:
    """OpenAI's completion logprobs; with `echo`, the prompt's tokens first (the first has none); not
    `generated`: the prompt's alone."""
    k = len(out.token_ids) if generated else 0
    ids, lps, tops = out.token_ids[:k], out.logprobs[:k], out.top_logprobs[:k]
    if echo:
        ids, lps = out.prompt_token_ids + ids, out.prompt_token_logprobs + lps
        tops = out.prompt_top_logprobs + tops if out.top_logprobs else []
    pieces = [_piece(tok, t, as_ids) for t in ids]
    offsets = list(itertools.accumulate(map(len, pieces), initial=0))[:-1]
    return {"tokens": pieces, "token_logprobs": lps, "text_offset": offsets, "token_ids": ids,
            "top_logprobs": completion_tops(tok, tops, as_ids)}


def chat_choices(tok, body: ChatCompletionRequest, outs: list[RequestOutput],
                 parser: ToolCallParser | None = None, reasoning: ReasoningParser | None = None) -> list[dict]:
    """OpenAI's chat choices. With tools offered (and tool_choice not "none"), the tool calls in a
    reply (the parser's format; Hermes `<tool_call>{"name": ..., "arguments": ...}</tool_call>`
    blocks by default) become its `tool_calls` (finish_reason "tool_calls") and the rest its
    content, as vLLM's parsers do; a reply with a malformed call stays text. With a `reasoning`
    parser, a thinking model's reasoning is the message's `reasoning_content` (and `reasoning`,
    vLLM's newer name), and the calls are read from the rest."""
    parse, parser, echo = parses_tools(body), parser or HermesParser(), body.echoed()
    choices = []
    for k, o in enumerate(outs):
        thought, text = reasoning.split(o.text) if reasoning else (None, o.text)
        message, reason = {"role": "assistant", "content": text}, o.finish_reason
        calls = tool_calls(text, parser) if parse else None
        if calls is not None:
            made = calls[1] if body.parallel_tool_calls else calls[1][:1]
            message, reason = {"role": "assistant", "content": calls[0] or None, "tool_calls": made}, "tool_calls"
        if thought is not None:
            message.update(content=message["content"] or None,
                           **({"reasoning_content": thought, "reasoning": thought} if body.include_reasoning else {}))
        if echo:
            message["content"] = echo + (message["content"] or "")
        choices.append({"index": k, "message": message, "finish_reason": reason, "stop_reason": o.stop_reason,
                        **({"token_ids": o.token_ids} if body.return_token_ids else {}),
                        "logprobs": {"content": chat_logprobs(tok, o.token_ids, o.logprobs, o.top_logprobs,
                                                              body.return_tokens_as_token_ids)}
                        if body.logprobs else None})
    return choices


def parses_tools(body: ChatCompletionRequest) -> bool:
    return bool(body.tools) and body.tool_choice != "none"


def chat_logprobs(tok, token_ids: list[int], logprobs: list[float], tops: list[dict[int, float]],
                  as_ids: bool = False) -> list[dict]:
    """`as_ids` (vLLM's return_tokens_as_token_ids): each token as "token_id:N"; its bytes stay its
    text's, the top ones' those of what is shown, as in vLLM."""
    out = []
    for i, (t, lp) in enumerate(zip(token_ids, logprobs)):
        piece = _piece(tok, t)
        top = [{"token": (p := _piece(tok, c, as_ids)), "logprob": v, "bytes": list(p.encode()), "token_id": c}
               for c, v in tops[i].items()] if tops else []
        out.append({"token": _piece(tok, t, as_ids) if as_ids else piece, "logprob": lp, "bytes": list(piece.encode()),
                    "top_logprobs": top, "token_id": t})
    return out


def with_usage(chunks: AsyncIterator[dict], body, finished: list[RequestOutput], head: dict) -> AsyncIterator[dict]:
    """OpenAI's `stream_options: {"include_usage": true}`: after the chunks, one with no choices and
    the usage of the `finished` outputs (which the streams fill in); otherwise the chunks."""
    if not (body.stream_options or {}).get("include_usage"):
        return chunks

    async def then_usage():
        async with aclosing(chunks):
            async for c in chunks:
                yield c
        yield {**head, "created": int(time.time()), "choices": [], "usage": usage(finished, body.n)}
    return then_usage()


async def stream_generate(engine, prompt, params, rid, group_id, **options):
    async with aclosing(deltas(engine, prompt, params, rid, group_id, **options)) as steps:
        async for ids, lps, tops, delta, final in steps:
            chunk = {"request_id": rid, "token_ids": ids, "logprobs": lps, "text": delta, "finished": final is not None}
            if tops:
                chunk |= {"top_logprobs": pairs(tops), "top_logprob_ranks": ranks(tops)}
            if final is not None:
                chunk |= {k: v for k, v in generate_json(final).items()
                          if k not in ("token_ids", "logprobs", "text", "top_logprobs", "top_logprob_ranks")}
            yield chunk


async def stream_completion(engine, prompt, params, rid, index: int, model, with_logprobs: bool,
                            group_id: str | None, as_ids: bool = False, finished: list | None = None,
                            return_token_ids: bool = False, engine_id: str | None = None, **options):
    """Completion chunks; with `return_token_ids`, each choice's new token ids, and in its first
    chunk the prompt's. `engine_id`: the engine's request id (default `rid-index`)."""
    tok = engine.tokenizer
    offset = 0  # of each token's piece in the whole text, as in a completion that is not streamed
    first = return_token_ids
    async with aclosing(deltas(engine, prompt, params, engine_id or f"{rid}-{index}", group_id, **options)) as steps:
        async for ids, lps, tops, delta, final in steps:
            pieces = [_piece(tok, t, as_ids) for t in ids] if with_logprobs else []
            offsets = list(itertools.accumulate(map(len, pieces), initial=offset))
            offset = offsets.pop()
            if final is not None and finished is not None:
                finished.append(final)
            choice = {"index": index, "text": delta, "finish_reason": final.finish_reason if final else None,
                      "logprobs": {"tokens": pieces, "token_logprobs": lps, "text_offset": offsets, "token_ids": ids,
                                   "top_logprobs": completion_tops(tok, tops, as_ids)}
                      if with_logprobs else None}
            if return_token_ids:
                choice["token_ids"] = ids
            if first:
                choice["prompt_token_ids"], first = prompt if isinstance(prompt, list) else tok.encode(prompt), False
            yield {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
                   "choices": [choice]}


async def stream_chat(engine, ids, params, rid, index: int, model, with_logprobs: bool, group_id: str | None,
                      tools: ToolCallParser | None = None, finished: list | None = None,
                      return_token_ids: bool = False, reasoning: ReasoningParser | None = None,
                      one_call: bool = False, as_ids: bool = False, include_reasoning: bool = True,
                      stream_reasoning: bool = True, engine_id: str | None = None, echo: str = "", **options):
    """Chat chunks. With `tools` (the parser of the model's tool calls), the content stops where a
    call may begin (Hermes: before the first `<tool_call>`, holding back what may begin one); at the
    end the reply's tool calls come as one delta, finish reason "tool_calls", or, if it has none (or
    a malformed one), the rest of its text. With `reasoning`, a thinking model's reasoning comes
    first as `reasoning_content` (and `reasoning`) deltas, the tags left out, and the content after
    it. With `return_token_ids`, each chunk's new token ids, and the prompt's in the first chunk.
    `one_call`: the request's parallel_tool_calls is false (its first call only); `as_ids`: logprobs'
    tokens as "token_id:N"; not `include_reasoning`: the reasoning is left out (its chunks empty);
    not `stream_reasoning` (SGLang's): the reasoning is held and sent as one delta once it ends;
    `engine_id`: the engine's request id (default `rid-index`); `echo`: text the content begins with
    (vLLM's echo), sent in the first chunk."""
    tok = engine.tokenizer
    # each chunk's work is bounded by its own text, not the reply so far (a long reply streams in linear time)
    first, whole, text, sent, content_began, held = True, "", "", 0, False, ""
    thinking = ReasoningStream(reasoning) if reasoning else None
    async with aclosing(deltas(engine, ids, params, engine_id or f"{rid}-{index}", group_id, **options)) as steps:
        async for new_ids, lps, tops, delta, final in steps:
            reason = final.finish_reason if final else None
            if final is not None and finished is not None:
                finished.append(final)
            d = {}
            if thinking:  # the content so far: the reply past its reasoning
                if final:
                    whole = final.text
                else:
                    whole += delta  # (extended in place: nothing else holds the string)
                said, at = thinking.feed(whole, final=final is not None)
                if not stream_reasoning:  # held until the reasoning ends (the content begins, or the reply)
                    held += said
                    said, held = (held, "") if at is not None or final else ("", held)
                if said and include_reasoning:
                    d = {"reasoning_content": said, "reasoning": said}
                if at is None:
                    text = ""
                elif content_began and not final:
                    text += delta
                else:
                    text = whole[at:]
                content_began = at is not None
            elif final:
                text = final.text
            else:
                text += delta
            calls = tool_calls(text, tools) if tools and final else None
            if calls is not None:  # what was not sent of the text outside the tool-call blocks, and the calls
                rest = tools.content(text)[sent:]
                d.update(content=rest if rest.strip() else None,
                         tool_calls=[dict(c, index=i) for i, c in enumerate(calls[1][:1] if one_call else calls[1])])
                reason = "tool_calls"
            else:
                shown = tools.content_end(text, sent) if tools and not final else len(text)
                if shown > sent or not d:
                    d["content"] = text[sent:max(shown, sent)]
                sent = max(shown, sent)
            if first:
                d = {"role": "assistant", **d, **({"content": echo + (d.get("content") or "")} if echo else {})}
            first = False
            choice = {"index": index, "delta": d, "finish_reason": reason,
                      **({"stop_reason": final.stop_reason} if final else {}),  # (vLLM's: the stop string or token)
                      "logprobs": {"content": chat_logprobs(tok, new_ids, lps, tops, as_ids)}
                      if with_logprobs else None,
                      **({"token_ids": new_ids} if return_token_ids else {})}
            yield {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
                   "choices": [choice], **({"prompt_token_ids": ids} if return_token_ids and "role" in d else {})}
