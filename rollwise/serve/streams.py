"""Streams of a reply: chunks merged from a request's choices, a stream run to its first chunk
before the headers go out, and server-sent events whose response closes the streams under it
however it ends (the client gone too), which aborts their requests."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import aclosing

import anyio
from fastapi.responses import StreamingResponse

from rollwise.engine.isolation import StepFailed
from rollwise.serve.responses import dumps


async def gather_or_cancel(coros) -> list:
    """asyncio.gather, but the first error (or the caller's cancellation) cancels the rest, which
    aborts their requests instead of leaving them to generate for nobody."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except BaseException:
        stop(tasks)
        raise
    stop(pending)
    failed = next((t for t in tasks if t in done and not t.cancelled() and t.exception() is not None), None)
    if failed is not None:
        raise failed.exception()
    return [t.result() for t in tasks]


def stop(tasks) -> None:
    """Cancel each task once, and leave it to end on its own: it closes its streams and aborts its
    requests (awaits of its own). Not asyncio.gather's way: a gather cancelled cancels its tasks
    again, and Starlette's cancel scope cancels a request's task again at every turn of the loop
    until it ends, so the tasks' closing awaits were cancelled too: a replica's request through
    `rollwise route` went on for nobody, its connection open."""
    for t in tasks:
        if not t.done():
            t.cancel()


async def primed(chunks: AsyncIterator[dict]) -> AsyncIterator[dict]:
    """Run a stream up to its first chunk, so that bad input raises (HTTP 400) before headers go out."""
    first = await chunks.__anext__()

    async def chain():
        async with aclosing(chunks):
            yield first
            async for c in chunks:
                yield c
    return chain()


class ClosingStream(StreamingResponse):
    """A StreamingResponse that closes its body however the response ends. Starlette leaves the body
    suspended when the client goes away (its task is cancelled, or `send` fails), to be closed when
    the garbage collector finds it; every stream here closes the streams it reads when it is closed
    (contextlib.aclosing), down to the requests, which are aborted. Shielded: the closing awaits run
    inside the request's cancelled scope."""

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


def sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def body():
        try:
            async with aclosing(chunks):
                async for c in chunks:
                    yield f"data: {dumps(c)}\n\n"
        except ValueError as e:
            yield _error_event(e, "invalid_request_error", 400)
        except StepFailed as e:  # this request failed the engine step (the server serves on)
            yield _error_event(e, "request_failed", 500)
        except RuntimeError as e:  # e.g. a router's replica failed mid-stream: say so rather than cut the stream
            yield _error_event(e, "unavailable", 503)
        yield "data: [DONE]\n\n"
    return ClosingStream(body(), media_type="text/event-stream")


def _error_event(e: Exception, kind: str, code: int) -> str:
    return f"data: {json.dumps({'error': {'message': str(e), 'type': kind, 'code': code}})}\n\n"


async def merged(streams: list[AsyncIterator[dict]]) -> AsyncIterator[dict]:
    """The chunks of several streams (a request's n choices) as they come; the first error ends it,
    and closing it closes every stream (which aborts their requests)."""
    if len(streams) == 1:
        async with aclosing(streams[0]):
            async for c in streams[0]:
                yield c
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(s):
        try:
            async with aclosing(s):
                async for c in s:
                    await queue.put(c)
            await queue.put(None)
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            await queue.put(e)
    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        stop(tasks)
