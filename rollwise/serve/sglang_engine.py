"""SGLang's offline engine (`sglang.Engine`): its /generate without the HTTP, so that a script or an RL
framework's rollout worker written against it runs as written:

    engine = Engine(model_path=path, mem_fraction_static=0.8, random_seed=0)
    out = engine.generate(input_ids=[[1, 2, 3]], sampling_params={"max_new_tokens": 16}, return_logprob=True)
    out[0]["output_ids"], out[0]["meta_info"]["output_token_logprobs"]

Its arguments are SGLang's (peer_args.sglang_args); its replies are the server's /generate replies
(sglang.py), SGLang's fields beside rollwise's. The work is an AsyncEngine's.
"""
from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing

from pydantic import ValidationError

from rollwise.peer_args import sglang_args
from rollwise.engine.async_engine import AsyncEngine
from rollwise.engine.deltas import deltas
from rollwise.serve.protocol import GenerateRequest
from rollwise.serve.responses import generate_json
from rollwise.serve.sglang import (GroupUpdate, abort_rid, generate_batch, generate_params, generate_samples, is_batch,
                                   server_info, sglang_fields, update_from_group, weights_by_name)
from rollwise.wire import GROUP

UNTAKEN = {"image_data": None, "audio_data": None, "video_data": None, "token_ids_logprob": None,
           "custom_logit_processor": None, "return_hidden_states": False, "session_params": None}  # (what they must be)


class Engine:
    """Engine(model_path=..., **SGLang's ServerArgs). `generate` and the other methods without `async_`
    run on `self.loop` (not from inside a running event loop: there, use the `async_` ones)."""

    def __init__(self, **server_args) -> None:
        adapters = lora_paths(server_args.pop("lora_paths", None))
        model, kwargs = sglang_args(server_args)
        self.engine = AsyncEngine(model, **kwargs)
        self.tokenizer = self.engine.tokenizer
        try:
            self.loop, self._own_loop = asyncio.get_running_loop(), False
        except RuntimeError:
            self.loop, self._own_loop = asyncio.new_event_loop(), True
        self._lora_paths: dict[str, str] = {}  # loaded adapters' paths, by name
        try:
            for name, path in adapters:
                self.engine.engine.add_lora(name, path)  # (the engine thread is idle: nothing has run yet)
                self._lora_paths[name] = path
        except BaseException:
            self.shutdown()
            raise

    def _run(self, coro):
        return self.loop.run_until_complete(coro)

    # generation ------------------------------------------------------------------------------------
    def generate(self, prompt=None, sampling_params=None, input_ids=None, stream: bool = False, **options):
        """SGLang's: the reply dict of one prompt, a list of them for a batch (n each with
        sampling_params.n), or with `stream` an iterator of the output so far (the last one finished)."""
        if not stream:
            return self._run(self.async_generate(prompt, sampling_params, input_ids, **options))
        chunks = self._run(self.async_generate(prompt, sampling_params, input_ids, stream=True, **options))

        def pull() -> Iterator[dict]:
            try:
                while True:
                    try:
                        yield self._run(chunks.__anext__())
                    except StopAsyncIteration:
                        return
            finally:  # a caller that stops reading aborts the request
                self._run(chunks.aclose())
        return pull()

    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None,
                             return_logprob: bool | list[bool] = False,
                             logprob_start_len: int | list[int] | None = None,
                             top_logprobs_num: int | list[int] | None = None, lora_path: str | list | None = None,
                             return_routed_experts: bool = False, stream: bool = False,
                             rid: str | list[str] | None = None, priority: int | None = None,
                             cache_salt: str | None = None, data_parallel_rank: int | None = None, **untaken):
        """`generate` for a running event loop: with `stream`, an async iterator of the output so far. For a
        batch, the logprob options and `lora_path` are one for all prompts or a list, one each."""
        for k, v in untaken.items():
            if k not in UNTAKEN or v != UNTAKEN[k]:
                raise ValueError(f"{k} is not taken here" if k in UNTAKEN else f"unknown generate argument {k!r}")
        if data_parallel_rank not in (None, 0):
            raise ValueError("data_parallel_rank: this engine is one replica (rank 0)")
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt and input_ids")
        try:
            body = GenerateRequest(text=prompt, input_ids=input_ids, sampling_params=sampling_params or {}, rid=rid,
                                   return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                                   top_logprobs_num=top_logprobs_num, lora_path=lora_path, stream=stream,
                                   return_routed_experts=return_routed_experts, priority=priority or 0,
                                   cache_salt=cache_salt)
        except ValidationError as e:
            raise ValueError(f"bad generate arguments: {e}") from None
        given, tok = (prompt if input_ids is None else input_ids), self.tokenizer
        rid = rid or f"engine-{uuid.uuid4().hex[:16]}"
        if is_batch(given):
            return await generate_batch(self.engine, tok, body, given, rid)
        params = generate_params(body)
        if params.n > 1:
            return await generate_samples(self.engine, tok, body, given, params, rid)
        options = {"priority": body.priority, "cache_salt": body.cache_salt}
        if stream:
            return self._stream(given, params, rid, body, options)
        out = await self.engine.generate(given, params, rid, **options)
        return generate_json(out) | sglang_fields(tok, out, body)

    async def _stream(self, prompt, params, rid: str, body, options: dict) -> AsyncIterator[dict]:
        """SGLang's offline stream: the text and output ids so far after each step, the last the whole reply."""
        text, ids = "", []
        async with aclosing(deltas(self.engine, prompt, params, rid, **options)) as pieces:
            async for new, _, _, piece, final in pieces:
                if final is not None:
                    yield generate_json(final) | sglang_fields(self.tokenizer, final, body)
                    return
                text, ids = text + piece, ids + new
                yield {"text": text, "output_ids": ids, "meta_info": {"id": rid, "finish_reason": None,
                                                                      "completion_tokens": len(ids)}}

    # control ---------------------------------------------------------------------------------------
    def abort_request(self, rid: str = "", abort_all: bool = False) -> list[str]:
        """SGLang's (its tokenizer manager's): a request by rid, or every one; the ids aborted."""
        return self._run(abort_rid(self.engine, rid, abort_all))

    def pause_generation(self, mode: str = "abort") -> list[str]:
        """SGLang's modes: "abort" (requests in flight end now), "in_place" (they wait with their KV),
        "retract" (they wait without it; a weight update moves them onto the new weights)."""
        if mode not in ("abort", "in_place", "retract"):
            raise ValueError(f"mode must be one of ['abort', 'in_place', 'retract'], got {mode!r}")
        return self._run(self.engine.pause(abort=mode == "abort", retract=mode == "retract"))

    def continue_generation(self) -> None:
        self._run(self.engine.resume())

    def flush_cache(self) -> bool:
        self._run(self.engine.call(self.engine.engine.blocks.evict_cached))
        return True

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None) -> tuple[bool, str, int]:
        """SGLang's (success, message, paused requests); requests in flight finish under their weights."""
        return self._run(self._update(model_path, load_format))

    def update_weights_from_tensor(self, named_tensors, load_format: str | None = None,
                                   flush_cache: bool = True) -> tuple[bool, str, int]:
        """Tensors by Hugging Face name, all or a bucket of them (a bucket updates the newest weights)."""
        return self._run(self._update(dict(named_tensors), load_format))

    async def _update(self, weights, load_format: str | None) -> tuple[bool, str, int]:
        if load_format not in (None, "auto"):
            return False, f"load_format {load_format!r} is not taken here (None or 'auto')", 0
        try:
            version = await self.engine.update_weights(weights)
        except ValueError as e:
            return False, str(e), 0
        return True, f"Succeeded to update model weights (version {version}).", 0

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = GROUP, backend: str = "gloo") -> tuple[bool, str]:
        """SGLang's: join a trainer's group (rollwise.engine.group_transfer; the trainer in another
        process: torch names a process's groups once). Waits for every rank."""
        try:
            self.engine.engine.group_receiver.init(master_address, master_port, rank_offset, world_size, group_name,
                                                   backend)
        except ValueError as e:
            return False, str(e)
        return True, f"Initialized group {group_name!r} as rank {rank_offset}."

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name: str = GROUP, flush_cache: bool = True,
                                        weight_version: str | None = None, load_format: str | None = None
                                        ) -> tuple[bool, str]:
        """SGLang's: the weights named, as the trainer broadcasts them (dtypes as names or torch dtypes)."""
        try:
            body = GroupUpdate(names=list(names), shapes=[list(s) for s in shapes], group_name=group_name,
                               dtypes=[str(d).removeprefix("torch.") for d in dtypes], flush_cache=flush_cache,
                               weight_version=weight_version, load_format=load_format)
        except ValidationError as e:
            return False, str(e)
        return self._run(update_from_group(self.engine, body))

    def destroy_weights_update_group(self, group_name: str = GROUP) -> tuple[bool, str]:
        try:
            self.engine.engine.group_receiver.destroy(group_name)
        except ValueError as e:
            return False, str(e)
        return True, f"Destroyed group {group_name!r}."

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        return self._run(self.engine.call(lambda: weights_by_name(self.engine, name, truncate_size)))

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """SGLang's: give back the KV pool ("kv_cache") and the weights ("weights"), all by default."""
        self._run(self.engine.release_memory(tags))

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self._run(self.engine.wake_up(tags))

    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> dict:
        """SGLang's: {"success", "error_message", "loaded_adapters": {name: path}}."""
        def load() -> None:
            self.engine.engine.add_lora(lora_name, lora_path)
            self._lora_paths[lora_name] = lora_path
        return self._run(self._lora(load))

    def unload_lora_adapter(self, lora_name: str) -> dict:
        return self._run(self._lora(lambda: self.engine.engine.remove_lora(lora_name)))

    async def _lora(self, fn) -> dict:
        try:
            await self.engine.call(fn)
        except ValueError as e:
            return {"success": False, "error_message": str(e), "loaded_adapters": self._adapters()}
        return {"success": True, "error_message": "", "loaded_adapters": self._adapters()}

    def _adapters(self) -> dict[str, str]:
        return {name: self._lora_paths.get(name, "") for name in self.engine.engine.loras}

    def get_server_info(self) -> dict:
        return server_info(self.engine)

    def shutdown(self) -> None:
        self.engine.shutdown()
        if self._own_loop and not self.loop.is_closed():
            self.loop.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> bool:
        self.shutdown()
        return False


def lora_paths(given) -> list[tuple[str, str]]:
    """SGLang's `lora_paths`: "name=path" strings, paths (named by themselves), {"lora_name", "lora_path"}
    dicts, or a {name: path} mapping."""
    if given is None:
        return []
    if isinstance(given, dict):
        return [(str(k), str(v)) for k, v in given.items()]
    out = []
    for x in given:
        if isinstance(x, dict) and {"lora_name", "lora_path"} <= set(x):
            out.append((str(x["lora_name"]), str(x["lora_path"])))
        elif isinstance(x, str) and x:
            name, _, path = x.partition("=") if "=" in x else (x, "", x)
            out.append((name, path))
        else:
            raise ValueError(f"lora_paths takes 'name=path' strings, paths or {{lora_name, lora_path}} dicts, "
                             f"got {x!r}")
    return out
