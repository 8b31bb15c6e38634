"""`AsyncEngine`: the engine loop on a background thread, served to asyncio callers.

Every change to engine state (add, abort, weight update) runs on the engine thread between steps, so
the engine itself stays single-threaded; results come back to each caller's event loop.
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import dataclasses
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Callable

import torch

from rollwise.config import EngineConfig
from rollwise.engine.isolation import StepFailed
from rollwise.engine.llm_engine import LLMEngine
from rollwise.engine.model_runner import set_threads
from rollwise.sampling import MAX_N
from rollwise.types import GenerateOutput, GenerateRequest, RequestOutput, SamplingParams

log = logging.getLogger("rollwise.engine")


class AsyncEngine:
    """AsyncEngine(model_dir, **EngineConfig fields). Use `async generate`, `stream`, `abort`,
    `update_weights`, `metrics`; `shutdown()` stops the loop."""

    def __init__(self, model: str, **kwargs) -> None:
        caller = torch.get_num_threads()  # the model runs on the engine thread, which sets its own count:
        try:  # building it here must not change the caller's (torch's thread count is per thread)
            self.engine = LLMEngine(EngineConfig(model=str(model), **kwargs))
        finally:
            torch.set_num_threads(caller)
        self.tokenizer = self.engine.tokenizer
        self._commands: list[tuple[Callable, cf.Future]] = []
        self._wake = threading.Condition()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self._exited = False  # the engine thread has ended (shut down, or died of a bug)
        self.paused = False  # no engine steps (requests wait; commands such as weight updates still run)
        self.retracted = False  # paused with the KV in flight dropped: an update moves those requests onto it
        self._thread = threading.Thread(target=self._loop, name="rollwise-engine", daemon=True)
        self._thread.start()

    # public API ----------------------------------------------------------------------------------
    async def generate(self, prompt: str | list[int] | GenerateRequest, params: SamplingParams | None = None,
                       request_id: str | None = None, **options) -> RequestOutput | GenerateOutput:
        """The finished output (finish_reason "abort" if it was aborted). options: `group_id` (the
        prompt group, for drafting from siblings), `forced_output` (trace replay), `session` (the
        trajectory: its next turn extends this turn's drafting tree instead of rebuilding it).

        Given a `GenerateRequest` (the agent's `Generator` protocol) it returns a `GenerateOutput`.
        With `params.n` > 1 (vLLM's), the n samples run as requests `request_id-j` (seeded seed + j, one
        drafting group) and the output is the first's, all n in `.samples` (and `.outputs`)."""
        if params is not None and params.n > 1:
            return await self._samples(prompt, params, request_id or f"async-{uuid.uuid4().hex[:12]}", options)
        if isinstance(prompt, GenerateRequest):
            req = prompt
            out = await self.generate(req.prompt_token_ids, req.params, req.request_id, group_id=req.group_id,
                                      forced_output=req.forced_output, session=req.trajectory_id,
                                      policy_version=req.policy_version, priority=req.priority,
                                      cache_salt=req.cache_salt)
            return GenerateOutput.of(out)
        out = None
        async for out in self._outputs(prompt, params, request_id, False, options):
            pass
        return out

    async def _samples(self, prompt, params: SamplingParams, rid: str, options: dict) -> RequestOutput:
        if options.get("session") is not None or options.get("forced_output") is not None:
            raise ValueError("n > 1 makes n requests: it takes no session or forced_output")
        options = {**options, "group_id": options.get("group_id") or rid}
        tasks = [asyncio.ensure_future(self.generate(prompt, params.for_sample(j), f"{rid}-{j}", **options))
                 for j in range(params.n)]
        try:
            outs = await asyncio.gather(*tasks)
        finally:  # an error or a cancellation ends the others (their requests aborted)
            for t in tasks:
                t.cancel()
        for j, out in enumerate(outs):
            out.index = j
        return dataclasses.replace(outs[0], samples=outs)

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None,
               request_id: str | None = None, **options) -> AsyncIterator[RequestOutput]:
        """Yields the cumulative output after every step that adds tokens; the last one has
        `finished=True`. Before it, the same object grows in place (read it before the next), and
        only its token ids, logprobs and top logprobs are filled in. Closing the iterator early
        (e.g. a client disconnect) aborts the request."""
        return self._outputs(prompt, params, request_id, True, options)

    async def _outputs(self, prompt, params, request_id, stream: bool, options: dict) -> AsyncIterator[RequestOutput]:
        params = params or SamplingParams()
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def add() -> str:
            rid = self.engine.add_request(prompt, params, request_id, stream=stream, **options)
            self._streams[rid] = (loop, queue)
            return rid

        rid = await self.call(add)
        finished, grown = False, None
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                if not finished:  # a step's new tokens (LLMEngine._progress), added up here, in place
                    if grown is None:
                        grown = item
                    else:
                        grown.token_ids += item.token_ids
                        grown.logprobs += item.logprobs
                        grown.top_logprobs += item.top_logprobs
                    item = grown
                yield item
                if finished:
                    return
        finally:
            if not finished:
                await asyncio.shield(self.call(lambda: self._abort(rid)))

    async def abort(self, request_id: str | list[str]) -> bool | list[str]:
        """Abort a request in flight (True if it was); given a list, those of them in flight (their ids)."""
        if isinstance(request_id, list):
            return await self.call(lambda: [r for r in request_id if self._abort(r)])
        return await self.call(lambda: self._abort(request_id))

    async def abort_samples(self, request_id: str) -> list[str]:
        """Abort a request and the samples `request_id-j` that `generate` made of it (n > 1); the ids aborted."""
        ids = (request_id, *(f"{request_id}-{j}" for j in range(MAX_N)))
        return await self.call(lambda: [r for r in ids if self._abort(r)])

    async def abort_all(self) -> list[str]:
        """Abort every request in flight; their ids."""
        return await self.call(self._abort_all)

    async def pause(self, abort: bool = False, wait: bool = False, retract: bool = False) -> list[str]:
        """Stop stepping (e.g. around a weight update) until `resume`; with `abort`, requests in
        flight end now with what they have (their ids are returned), else they wait, KV kept. With
        `wait`, those in flight finish first, and requests that arrive meanwhile are held back
        (vLLM's drain): they start after `resume`, under whatever weights are loaded then. With
        `retract` (SGLang's), they wait with their KV dropped (its memory given back), and a weight
        update before `resume` moves them onto the new weights, as a partial rollout does."""
        if wait and not self.paused:
            sch = self.engine.scheduler

            def in_flight() -> list[str]:  # (not those held by a drain under way already)
                sch.hold(True)
                return [rid for rid, seq in self.engine.seqs.items() if seq not in sch.held]
            ids = await self.call(in_flight)
            try:
                while ids and await self.call(lambda: any(r in self.engine.seqs for r in ids)):
                    await asyncio.sleep(0.01)
            except BaseException:  # the drain was given up: admit those held
                await asyncio.shield(self.call(lambda: None if self.paused else sch.hold(False)))
                raise

        def go() -> list[str]:
            self.paused = True
            if retract:
                self.retracted = True
                self.engine.scheduler.requeue_running(lambda seq: True)
            return self._abort_all() if abort else []
        return await self.call(go)

    async def resume(self) -> None:
        def go() -> None:
            self.paused = self.retracted = False
            self.engine.scheduler.hold(False)
        await self.call(go)

    async def update_weights(self, weights, version: int | None = None, partial_rollout: bool = False) -> int:
        """New weights between two steps (`LLMEngine.update_weights`; after a retracting pause, as a
        partial rollout); returns the new policy version."""
        return await self.call(lambda: self.engine.update_weights(weights, version, partial_rollout or self.retracted))

    async def sleep(self, level: int = 1) -> None:
        """Give back the KV pool (level 1), and the weights (level 2), of an idle engine (sleep.py)."""
        await self.call(lambda: self.engine.sleep(level))

    async def release_memory(self, tags=None) -> None:
        await self.call(lambda: self.engine.release_memory(tags))

    async def wake_up(self, tags=None) -> None:
        await self.call(lambda: self.engine.wake_up(tags))

    @property
    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping

    def metrics(self) -> dict[str, float]:
        return self.engine.metrics()

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    def shutdown(self) -> None:
        """Stop the engine thread and free the KV pool and weights at once (not when the last reference
        goes: a stopped engine serves nothing)."""
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.engine.runner.release()

    # engine thread -------------------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return not self._stopped and not self._exited

    async def call(self, fn: Callable):
        """Run fn() on the engine thread between two steps (engine state is single-threaded)."""
        fut: cf.Future = cf.Future()
        with self._wake:
            if not self.is_running:
                raise RuntimeError("engine is shut down" if self._stopped else "the engine thread died")
            self._commands.append((fn, fut))
            self._wake.notify()
        return await asyncio.wrap_future(fut)

    def _abort_all(self) -> list[str]:
        return [rid for rid in list(self.engine.seqs) if self._abort(rid)]

    def _abort(self, rid: str) -> bool:
        out = self.engine.abort(rid)
        if out is not None:
            self._deliver([out])
        return out is not None

    def _loop(self) -> None:
        why = RuntimeError("engine shut down")
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001 - a bug in the loop itself: tell everyone waiting
            log.critical("the engine thread died", exc_info=e)
            why = RuntimeError(f"the engine thread died: {e!r}")
        with self._wake:
            self._exited = True
            commands, self._commands = self._commands, []
        for _, fut in commands:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(why)
        self._fail_all(why)

    def _run(self) -> None:
        if self.engine.config.num_threads:  # per thread: this one runs the model
            set_threads(self.engine.config.num_threads)
        while True:
            with self._wake:
                while not self._commands and not self._can_step() and not self._stopped:
                    self._wake.wait()
                if self._stopped:
                    break
                commands, self._commands = self._commands, []
            for fn, fut in commands:
                if not fut.set_running_or_notify_cancel():
                    continue  # the caller gave up (cancelled): do not run it, and do not die on it
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - returned to the caller
                    fut.set_exception(e)
            if self._can_step():
                try:
                    self._deliver(self.engine.step())
                except Exception as e:  # noqa: BLE001 - fail the request that caused it, keep serving
                    try:
                        self._step_failed(e)
                    except Exception as again:  # noqa: BLE001 - the engine's state is in doubt: fail them all
                        log.error("taking the failed step apart failed", exc_info=again)
                        self._fail_all(again)

    def _can_step(self) -> bool:
        """Not paused, and a request that is not held back."""
        return not self.paused and len(self.engine.seqs) > len(self.engine.scheduler.held)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            target = self._streams.get(out.request_id)
            if target is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            by_loop.setdefault(target[0], []).append((target[1], out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that caller's loop is closed
                pass

    def _step_failed(self, exc: Exception) -> None:
        """A step raised: the engine takes it apart (isolation.py); the request found to cause it
        (the step's only one) gets the error, the others go on."""
        log.error("engine step failed", exc_info=exc)
        outputs, culprits = self.engine.isolation.failed()
        self._deliver(outputs)
        for rid in culprits:
            self.engine.abort(rid)
            target = self._streams.pop(rid, None)
            if target is not None:
                err = StepFailed(f"request {rid} failed the engine step: {exc!r}")
                err.__cause__ = exc
                _raise_in(*target, err)

    def _fail_all(self, exc: BaseException) -> None:
        for rid in list(self.engine.seqs):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - its state is broken: drop it, tell its caller all the same
                log.exception("aborting %s failed", rid)
                self.engine.seqs.pop(rid, None)
        streams, self._streams = self._streams, {}
        for loop, q in streams.values():
            _raise_in(loop, q, exc)


def _raise_in(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, exc: BaseException) -> None:
    """Hand `exc` to a caller waiting on `queue` in `loop` (it raises it there)."""
    try:
        loop.call_soon_threadsafe(queue.put_nowait, exc)
    except RuntimeError:  # that caller's loop is closed
        pass


def _put_all(items) -> None:
    for q, out in items:
        q.put_nowait(out)
