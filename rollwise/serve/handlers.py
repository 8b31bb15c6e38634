"""The OpenAI endpoints' work once a request is parsed, shared by `rollwise serve` (over its engine)
and `rollwise route` (over the router): the samples run, streamed or whole, the reply built, and a
client that disconnects aborts them."""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable

from fastapi import Request

from rollwise.agent.parsing import HermesParser, bind
from rollwise.serve.responses import (chat_choices, completion_choices, parses_tools, stream_chat, stream_completion,
                                      usage, vllm_prompt_logprobs, with_usage)
from rollwise.serve.streams import gather_or_cancel, merged, primed, sse


class ClientGone(Exception):
    """The HTTP client disconnected before its response was ready."""


async def unless_disconnected(request: Request, work: Awaitable):
    """Await `work`; if the client disconnects first, cancel it, which aborts its requests (raises
    ClientGone). A non-streaming request would otherwise generate to its end for nobody, e.g. after
    an episode's deadline or a router's timeout; a streamed one is cancelled by Starlette itself."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task  # its requests are aborted before this returns
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _outputs(gen, request: Request, samples: list[tuple]) -> list:
    return await unless_disconnected(request, gather_or_cancel(
        gen.generate(p, sp, r, group_id=g, **opt) for p, sp, r, g, opt in samples))


async def completion_reply(gen, body, request: Request, samples: list[tuple], rid: str, model: str,
                           prompts: list, as_ids: bool):
    """/v1/completions over `gen` (an engine, or the router as one): `samples` are each choice's
    (prompt ids, params, request id, group, options), `prompts` the body's prompts as given."""
    if body.stream:
        if len(prompts) != 1:
            raise ValueError("streaming takes one prompt")
        if body.echo:
            raise ValueError("echo is not supported with stream")
        finals: list = []
        return sse(await primed(with_usage(merged([
            stream_completion(gen, p, sp, rid, j, model, body.logprobs is not None, g, as_ids,
                              finished=finals, return_token_ids=body.return_token_ids, engine_id=r, **opt)
            for j, (p, sp, r, g, opt) in enumerate(samples)]), body, finals,
            {"id": rid, "object": "text_completion", "model": model})))
    outs = await _outputs(gen, request, samples)
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": completion_choices(gen.tokenizer, body, prompts, outs, as_ids), "usage": usage(outs, body.n)}


async def chat_reply(gen, body, request: Request, samples: list[tuple], rid: str, model: str, prompt_ids: list[int],
                     parser=None, reasoning=None):
    """/v1/chat/completions over `gen`, the chat already rendered to `prompt_ids`; tool calls in the
    `parser`'s format (default Hermes); a thinking model's reasoning apart with a `reasoning` parser."""
    parser = bind(parser or HermesParser(), body.tools)  # (the tools' schemas type qwen3_coder's values)
    reasoning = reasoning if body.separate_reasoning else None  # (SGLang's: the reasoning left in the content)
    if body.stream:
        finals: list = []
        return sse(await primed(with_usage(merged([
            stream_chat(gen, p, sp, rid, j, model, body.logprobs, g, parser if parses_tools(body) else None,
                        finished=finals, return_token_ids=body.return_token_ids, reasoning=reasoning,
                        one_call=not body.parallel_tool_calls, as_ids=body.return_tokens_as_token_ids,
                        include_reasoning=body.include_reasoning, stream_reasoning=body.stream_reasoning,
                        engine_id=r, echo=body.echoed(), **opt)
            for j, (p, sp, r, g, opt) in enumerate(samples)]), body, finals,
            {"id": rid, "object": "chat.completion.chunk", "model": model})))
    outs = await _outputs(gen, request, samples)
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": chat_choices(gen.tokenizer, body, outs, parser, reasoning), "usage": usage(outs, body.n),
            **({"prompt_token_ids": prompt_ids} if body.return_token_ids else {}),
            **({"prompt_logprobs": vllm_prompt_logprobs(gen.tokenizer, outs[0])}
               if body.prompt_logprobs is not None else {})}
