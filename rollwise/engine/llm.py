"""`LLM`: offline batch generation on the engine."""
from __future__ import annotations

import dataclasses
import itertools
import uuid

from rollwise.config import EngineConfig
from rollwise.peer_args import engine_args
from rollwise.engine.llm_engine import LLMEngine
from rollwise.engine.lora import adapter_name
from rollwise.sampling import prompt_parts
from rollwise.types import RequestOutput, SamplingParams


class LLM:
    """LLM(model_dir, dtype="float32", max_num_seqs=64, enable_prefix_caching=True, seed=0, ...).

    Keyword arguments are the fields of `EngineConfig`, and vLLM's engine arguments that agree with
    this engine (`rollwise.peer_args.VLLM_ARGS`), so that a vLLM script's `LLM(...)` runs as written.
    """

    def __init__(self, model: str, **kwargs) -> None:
        self.engine = LLMEngine(EngineConfig(model=str(model), **engine_args(kwargs, model)))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | list[int] | list,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = False,
                 group_ids: list[str | None] | None = None, n: int = 1,
                 priority: int | list[int] | None = None, lora_request=None, tokenization_kwargs: dict | None = None,
                 mm_processor_kwargs: dict | None = None) -> list[RequestOutput]:
        """prompts: strings or token-id lists (one prompt alone is accepted too), or vLLM's prompt dicts
        (`{"prompt": text}` or `{"prompt_token_ids": ids}`, with an optional `cache_salt`); sampling_params:
        one for all or one per prompt; group_ids: the prompt group of each (siblings draft from each other).
        Samples of one prompt (a GRPO group) are seeded seed + j (`SamplingParams.for_sample`), its prompt
        computed once, and draft from each other unless `group_ids` names their group. Asked as
        `SamplingParams.n` (vLLM's), the result is vLLM's: one output per prompt, its samples in
        `.samples` (and in `.outputs` as vLLM's CompletionOutputs); asked as `n` here, it is flat: prompt
        i's samples at i*n .. i*n+n-1. priority: one for all or one per prompt (vLLM's; the engine's
        scheduling_policy must be "priority" for any but 0). lora_request:
        vLLM's `LoRARequest` (anything with `lora_name` and `lora_path`), one for all or one per prompt
        (None: the base weights), its adapter loaded the first time; the same as `SamplingParams.lora`.
        Returns outputs in prompt order. (vLLM's tokenization_kwargs and mm_processor_kwargs: None only.)"""
        none_only(tokenization_kwargs=tokenization_kwargs, mm_processor_kwargs=mm_processor_kwargs)
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts, salts = zip(*map(prompt_parts, prompts)) if prompts else ((), ())
        params = sampling_params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        groups = group_ids or [None] * len(prompts)
        if len(groups) != len(prompts):
            raise ValueError(f"got {len(groups)} group_ids for {len(prompts)} prompts")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an integer >= 1, got {n!r}")
        prios = [priority or 0] * len(prompts) if priority is None or isinstance(priority, int) else list(priority)
        if len(prios) != len(prompts):
            raise ValueError(f"got {len(prios)} priorities for {len(prompts)} prompts")
        if not all(isinstance(sp, SamplingParams) for sp in plist):
            raise ValueError("sampling_params must be SamplingParams or a list of them, one per prompt")
        if lora_request is not None:
            loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(loras)} lora_requests for {len(prompts)} prompts")
            plist = [sp if r is None else dataclasses.replace(sp, lora=adapter_name(self.engine, r))
                     for sp, r in zip(plist, loras)]
        counts = [sp.n for sp in plist]
        nested = any(k > 1 for k in counts)
        if nested and n > 1:
            raise ValueError("give the samples per prompt as SamplingParams.n (vLLM's, outputs per prompt) or "
                             "as generate's n (flat outputs), not both")
        counts = [n] * len(prompts) if n > 1 else counts
        groups = [g if g is not None or k == 1 else f"llm-{uuid.uuid4().hex[:12]}" for g, k in zip(groups, counts)]
        requests = [(p, g, q, c, sp.for_sample(j), j) for p, g, q, c, sp, k in zip(prompts, groups, prios, salts,
                                                                                plist, counts) for j in range(k)]
        ids: list[str] = []
        try:
            for p, g, q, c, sp, _ in requests:
                ids.append(self.engine.add_request(p, sp, group_id=g, priority=q, cache_salt=c))
        except ValueError:  # all or nothing: take back the ones already queued
            for rid in ids:
                self.engine.abort(rid)
            raise
        done = self._run(ids, use_tqdm)
        outs = [done[r] for r in ids]
        for out, x in zip(outs, requests):
            out.index, out.prompt = x[-1], x[0] if isinstance(x[0], str) else None
        if not nested:
            return outs
        firsts = list(itertools.accumulate(counts, initial=0))
        return [dataclasses.replace(outs[a], samples=outs[a:b]) for a, b in zip(firsts, firsts[1:])]

    def _run(self, ids: list[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        """Step the engine until these requests finish (aborting them if interrupted): their outputs."""
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(ids), desc="generate", unit="req")
        try:
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        if bar:
                            bar.update(1)
        except BaseException:
            for rid in ids:
                if rid not in done:
                    self.engine.abort(rid)
            raise
        finally:
            if bar:
                bar.close()
        return done

    def chat(self, messages: list[list[dict]] | list[dict],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = False,
             lora_request=None, priority: int | list[int] | None = None, chat_template: str | None = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, tokenization_kwargs: dict | None = None,
             mm_processor_kwargs: dict | None = None) -> list[RequestOutput]:
        """vLLM's (its arguments in its order): a conversation (a list of messages) or a list of them,
        each rendered by the model's chat template, or `chat_template` (a Jinja template) in its place,
        with `tools` and `chat_template_kwargs` such as `enable_thinking`, and answered. The messages go
        to the template as given (chat_template_content_format "auto" only)."""
        if chat_template_content_format != "auto":
            raise ValueError(f"chat_template_content_format: only 'auto' here, got {chat_template_content_format!r}")
        none_only(tokenization_kwargs=tokenization_kwargs, mm_processor_kwargs=mm_processor_kwargs)
        tok = self.tokenizer if chat_template is None else self.tokenizer.with_chat_template(chat_template)
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        ids = [tok.encode_chat(c, add_generation_prompt, tools, continue_final_message, **(chat_template_kwargs or {}))
               for c in convs]
        return self.generate(ids, sampling_params, use_tqdm, lora_request=lora_request, priority=priority)

    def update_weights(self, weights, partial_rollout: bool = False) -> int | None:
        """New weights (a state dict or a model directory): the new policy version. Or vLLM 0.32's
        weight transfer's chunk (`{"update_info": {names, dtype_names, shapes}}`, or an object with
        `.update_info`): those weights received from the trainer's broadcast, taken at
        `finish_weight_update`."""
        info = transfer_field(weights, "update_info")
        if info is not None:
            self.engine.receiver.receive(info)
            return None
        return self.engine.update_weights(weights, partial_rollout=partial_rollout)

    def init_weight_transfer_engine(self, request) -> None:
        """vLLM 0.32's: join the trainer's weight transfer (`{"init_info": {master_address, master_port,
        rank_offset, world_size}}`; the gloo backend, rollwise.engine.weight_transfer)."""
        self.engine.receiver.init(transfer_field(request, "init_info"))

    def start_weight_update(self) -> None:
        self.engine.receiver.start()

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.engine.finish_weight_update(weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self.engine.receiver.shutdown()

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's name for the engine: RL code reaches the model through it
        (`llm_engine.model_executor.driver_worker.model_runner.model`, rollwise.engine.worker)."""
        return self.engine

    def collective_rpc(self, method, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None
                       ) -> list:
        """vLLM's: a worker method by name (the worker's, or its `worker_extension_cls`'s) or a
        function taking the worker first, run on each worker (one here): [its result]."""
        return self.engine.collective_rpc(method, timeout, args, kwargs)

    def apply_model(self, func) -> list:
        """vLLM's: [func(model)], the model as a trainer sees it (its load_weights writes the weights)."""
        return self.engine.apply_model(func)

    def update_weight_version(self, new_version: str) -> None:
        """vLLM's: name the weights (CompletionOutput.weight_versions counts tokens under the name)."""
        self.engine.set_weight_version(new_version)

    def get_weight_version(self) -> str:
        return self.engine.get_weight_version()

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """vLLM's: give back the KV pool (level 1), and the weights (level 2; load them before generating).
        (`mode` says what becomes of requests in flight; between two `generate` calls there are none.)"""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        self.engine.wake_up(tags)
        return True

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """vLLM's: forget every cached prefix block no request holds (True: done). (Between two `generate`
        calls no request runs, and there is no KV connector.)"""
        self.engine.blocks.evict_cached()
        return True

    def get_tokenizer(self):
        return self.tokenizer

    def metrics(self) -> dict[str, float]:
        return self.engine.metrics()


PAUSE_MODES = ("abort", "wait", "keep")  # vLLM's: what a pause (or a sleep) does to requests in flight


def transfer_field(request, name: str):
    """vLLM's weight transfer requests: `request[name]` of a dict, `request.name` of its request
    objects; None for anything else (a state dict, a directory)."""
    if isinstance(request, dict):
        return request.get(name) if set(request) == {name} else None
    return getattr(request, name, None) if not isinstance(request, (str, bytes)) else None


def none_only(**given) -> None:
    """vLLM's arguments for what this engine does not have (multimodal inputs, tokenizer options): None only."""
    for k, v in given.items():
        if v is not None:
            raise ValueError(f"{k} is not taken here (None only)")
