"""vLLM's async engine API over `AsyncEngine`: `AsyncLLM` (also named `AsyncLLMEngine`) and
`AsyncEngineArgs`, so that an RL framework's vLLM rollout worker runs as written:

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=path, enable_prefix_caching=True))
    async for out in engine.generate(TokensPrompt(prompt_token_ids=ids), sampling_params, request_id):
        final = out

Its streams are made of `deltas` (rollwise/engine/deltas.py), as the servers' are.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Iterable
from contextlib import aclosing

from rollwise.peer_args import engine_args
from rollwise.engine.async_engine import AsyncEngine
from rollwise.engine.deltas import deltas
from rollwise.engine.llm import PAUSE_MODES, none_only, transfer_field
from rollwise.engine.lora import adapter_name
from rollwise.sampling import RequestOutputKind, SamplingParams, prompt_parts
from rollwise.types import RequestOutput

log = logging.getLogger("rollwise.engine")


class AsyncEngineArgs:
    """vLLM's engine arguments (`EngineArgs` too): the model and keyword arguments, checked now as
    `LLM(...)` checks them (`EngineConfig`'s fields, and vLLM's that agree with this engine)."""

    def __init__(self, model: str, **kwargs) -> None:
        self.model, self.kwargs = str(model), engine_args(kwargs, model)


EngineArgs = AsyncEngineArgs


class AsyncLLM:
    """vLLM's `AsyncLLM`: `AsyncLLM(model, **engine arguments)` or `AsyncLLM.from_engine_args(args)`.
    `self.engine` is the AsyncEngine under it (rollwise's own API: weight updates, metrics)."""

    def __init__(self, model: str, **kwargs) -> None:
        self.engine = AsyncEngine(model, **engine_args(kwargs, model))
        self.tokenizer = self.engine.tokenizer
        self._lora_ids: dict[int, str] = {}  # vLLM's adapter ids (LoRARequest.lora_int_id): names
        self._awake: asyncio.Event | None = None  # cleared by sleep: new requests wait for wake_up (made in the loop)

    @classmethod
    def from_engine_args(cls, engine_args: AsyncEngineArgs, start_engine_loop: bool = True, usage_context=None,
                         stat_loggers=None) -> AsyncLLM:
        if not isinstance(engine_args, AsyncEngineArgs):
            raise ValueError(f"engine_args must be rollwise's AsyncEngineArgs, got {type(engine_args).__name__}")
        if not start_engine_loop:
            raise ValueError("the engine loop starts with the engine here (start_engine_loop=False is not taken)")
        return cls(engine_args.model, **engine_args.kwargs)

    async def generate(self, prompt, sampling_params: SamplingParams | None, request_id: str, *,
                       prompt_text: str | None = None, lora_request=None, tokenization_kwargs: dict | None = None,
                       trace_headers=None, priority: int = 0, data_parallel_rank: int | None = None,
                       **untaken) -> AsyncIterator[RequestOutput]:
        """vLLM's: the request's outputs as `sampling_params.output_kind` asks, by default the output so
        far after every step that adds tokens; the last has `finished=True` (and "abort" as its
        finish_reason if it was aborted). prompt: text, token ids, or a TextPrompt / TokensPrompt
        (with an optional cache_salt); `prompt_text` names token ids' text in `.prompt`. With n > 1
        it yields once, when the n samples are done (in `.outputs`). Closing the generator early, or
        cancelling its task, aborts the request. (`trace_headers`, vLLM's OpenTelemetry context, is
        taken and not used; its other options, e.g. `session_id` or `kv_hints`, None only.)"""
        none_only(tokenization_kwargs=tokenization_kwargs, **untaken)
        if data_parallel_rank not in (None, 0):
            raise ValueError("data_parallel_rank: this engine is one replica (rank 0)")
        sp = sampling_params or SamplingParams()
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"sampling_params must be rollwise's SamplingParams, got {type(sp).__name__}")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        prompt, salt = prompt_parts(prompt)
        await self._gate().wait()  # (asleep: it waits for wake_up, as vLLM queues it)
        text = prompt if isinstance(prompt, str) else prompt_text
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        if lora_request is not None:
            sp = dataclasses.replace(sp, lora=await self._adapter(lora_request))
        options = {"priority": priority, "cache_salt": salt}
        if sp.n > 1:
            out = await self.engine.generate(ids, sp, request_id, **options)
            for o in out.samples:
                o.prompt = text
            yield dataclasses.replace(out, request_id=request_id, prompt=text)
            return
        tok, kind = self.tokenizer if sp.detokenize else None, sp.output_kind  # (detokenize: decoded_token)
        got = RequestOutput(request_id=request_id, prompt_token_ids=ids, prompt=text, tokenizer=tok,
                            flat_logprobs=sp.flat_logprobs)
        async with aclosing(deltas(self.engine, ids, sp, request_id, **options)) as pieces:
            async for new, lps, tops, delta, final in pieces:
                if final is not None:
                    final.prompt = text
                    yield final if kind != RequestOutputKind.DELTA else dataclasses.replace(
                        final, token_ids=new, logprobs=lps, top_logprobs=tops, text=delta)
                    return
                got.token_ids += new
                got.logprobs += lps
                got.top_logprobs += tops
                got.text += delta
                if kind == RequestOutputKind.CUMULATIVE:  # (a copy: the caller may keep it)
                    yield dataclasses.replace(got, token_ids=list(got.token_ids), logprobs=list(got.logprobs),
                                              top_logprobs=list(got.top_logprobs))
                elif kind == RequestOutputKind.DELTA:
                    yield RequestOutput(request_id=request_id, prompt_token_ids=ids, token_ids=new, logprobs=lps,
                                        top_logprobs=tops, text=delta, prompt=text, tokenizer=tok,
                                        flat_logprobs=sp.flat_logprobs)

    async def abort(self, request_id: str | Iterable[str], internal: bool = False) -> None:
        """Abort requests in flight (with n > 1, the request's samples)."""
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            await self.engine.abort_samples(rid)

    async def _adapter(self, lora_request) -> str:
        name = await self.engine.call(lambda: adapter_name(self.engine.engine, lora_request))
        self._lora_ids[getattr(lora_request, "lora_int_id", 0)] = name
        return name

    async def add_lora(self, lora_request) -> bool:
        """Load a LoRARequest's adapter (once per name)."""
        await self._adapter(lora_request)
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        name = self._lora_ids.pop(lora_id, None)
        if name is None or name not in self.engine.engine.loras:
            return False
        await self.engine.call(lambda: self.engine.engine.remove_lora(name))
        return True

    async def list_loras(self) -> set[int]:
        return {i for i, name in self._lora_ids.items() if name in self.engine.engine.loras}

    async def pin_lora(self, lora_id: int) -> bool:
        """(Adapters are never evicted here: a loaded one is pinned already.)"""
        return lora_id in await self.list_loras()

    def get_tokenizer(self):
        return self.tokenizer

    async def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """vLLM's: forget every cached prefix block; with `reset_running_requests`, the running requests'
        KV too (they are put back in the queue and recompute it, as after a preemption)."""
        def reset() -> None:
            if reset_running_requests:
                self.engine.engine.scheduler.requeue_running(lambda seq: True)
            self.engine.engine.blocks.evict_cached()
        await self.engine.call(reset)
        return True

    def _gate(self) -> asyncio.Event:
        if self._awake is None:
            self._awake = asyncio.Event()
            self._awake.set()
        return self._awake

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """vLLM's: level 0 pauses generation; 1 also gives back the KV pool, 2 the weights too. Requests
        in flight are aborted first ("abort") or finish first ("wait"); requests that arrive while it
        sleeps wait for wake_up, as vLLM queues them. ("keep" is not taken: an engine sleeps idle here.)"""
        if mode not in PAUSE_MODES or mode == "keep":
            raise ValueError(f"mode must be one of ['abort', 'wait'] here (an engine sleeps idle), got {mode!r}")
        if level not in (0, 1, 2) or isinstance(level, bool):
            raise ValueError(f"sleep level must be 0 (a pause), 1 (and the KV cache) or 2 (and the weights), "
                             f"got {level!r}")
        self._gate().clear()
        try:
            await self.engine.pause(abort=mode == "abort", wait=mode == "wait")
            if level:
                await self.engine.sleep(level)
        except BaseException:
            await self._woken()
            raise

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        """vLLM's: take the memory back (`tags`: "weights", "kv_cache"; None: all); once all of it is
        back, generation resumes and the requests that waited start. Whether it is fully awake."""
        await self.engine.wake_up(tags)
        if self.engine.is_sleeping:
            return False
        await self._woken()
        return True

    async def _woken(self) -> None:
        await self.engine.resume()
        self._gate().set()

    async def is_sleeping(self) -> bool:
        """Asleep at any level (level 0: generation paused), from the call to sleep on."""
        return self.engine.is_sleeping or not self._gate().is_set()

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True,
                               wait_for_inflight_requests: bool | None = None) -> None:
        """vLLM's: no new tokens until `resume_generation`. Requests in flight end now ("abort"), finish
        first ("wait"; those that arrive meanwhile start after the resume), or wait with their KV
        ("keep"); with `clear_cache` the prefix cache is emptied. (`wait_for_inflight_requests`: the
        older vLLM's name for "wait" / "abort".)"""
        if wait_for_inflight_requests is not None:
            mode = "wait" if wait_for_inflight_requests else "abort"
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        await self.engine.pause(abort=mode == "abort", wait=mode == "wait")
        if clear_cache:
            await self.reset_prefix_cache()

    async def resume_generation(self) -> None:
        await self.engine.resume()

    async def is_paused(self) -> bool:
        return self.engine.paused

    async def collective_rpc(self, method, timeout: float | None = None, args: tuple = (),
                             kwargs: dict | None = None) -> list:
        """vLLM's: a worker method by name (the worker's, or the engine's `worker_extension_cls`'s) or a
        function taking the worker first, run on the engine's thread between two steps: [its result].
        TimeoutError after `timeout` seconds (a call that has begun still finishes there; one that has not
        is dropped)."""
        call = self.engine.call(lambda: self.engine.engine.collective_rpc(method, None, args, kwargs))
        return await asyncio.wait_for(call, timeout)

    async def apply_model(self, func) -> list:
        return await self.collective_rpc("apply_model", args=(func,))

    async def init_weight_transfer_engine(self, request) -> None:
        """vLLM 0.32's weight transfer (the gloo backend: rollwise.engine.weight_transfer), as `LLM`'s; the
        rendezvous and the receiving run off the engine's thread, which keeps serving."""
        await asyncio.to_thread(self.engine.engine.receiver.init, transfer_field(request, "init_info"))

    async def start_weight_update(self) -> None:
        self.engine.engine.receiver.start()

    async def update_weights(self, request) -> None:
        await asyncio.to_thread(self.engine.engine.receiver.receive, transfer_field(request, "update_info"))

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        engine = self.engine
        await engine.call(lambda: engine.engine.finish_weight_update(weight_version, engine.retracted))

    async def shutdown_weight_transfer_engine(self) -> None:
        self.engine.engine.receiver.shutdown()

    async def update_weight_version(self, new_version: str) -> None:
        """vLLM's: name the weights (CompletionOutput.weight_versions counts tokens under the name)."""
        await self.engine.call(lambda: self.engine.engine.set_weight_version(new_version))

    async def get_weight_version(self) -> str:
        return self.engine.engine.get_weight_version()

    async def check_health(self) -> None:
        """Raises if the engine loop is not running (shut down, or died of a bug)."""
        if not self.engine.is_running:
            raise RuntimeError("the engine is not running (shut down, or its thread died)")

    async def do_log_stats(self) -> None:
        log.info("engine metrics: %s", self.engine.metrics())

    @property
    def is_running(self) -> bool:
        return self.engine.is_running

    @property
    def is_stopped(self) -> bool:
        return not self.engine.is_running

    @property
    def errored(self) -> bool:
        return not self.engine.is_running

    @property
    def dead_error(self) -> BaseException:
        return RuntimeError("the engine is not running (shut down, or its thread died)")

    def shutdown(self, timeout: float | None = None) -> None:
        self.engine.shutdown()


AsyncLLMEngine = AsyncLLM  # vLLM's older name
