"""What vLLM's and SGLang's scripts and launch lines pass for EngineConfig's settings, in their names:
`engine_args` (`LLM(...)`'s keyword arguments, `vllm serve`'s flags), `speculative_args` (vLLM's
speculative_config) and `sglang_args` (SGLang's ServerArgs): renamed where a setting is ours, checked and
dropped where it asks for what this engine always does, a ValueError naming the valid values otherwise."""
from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

from rollwise.agent.reasoning import REASONING_PARSERS
from rollwise.config import SPECULATIVE, EngineConfig

# vLLM's engine arguments with no work to do here, and the values that agree with this engine: no CUDA graphs
# (always eager), known architectures only (no remote code), one process (no tensor, pipeline, data or expert
# parallelism; the engine runs in the caller's process, as verl's and TRL's colocated "external_launcher"
# asks), this engine's own model code, prefill always chunked, sleep mode on, statistics kept, trace replay
# taken, the token-in-token-out API served, text models (no multimodal cache)
VLLM_ARGS = {"enforce_eager": (True, False), "trust_remote_code": (True, False), "enable_sleep_mode": (True, False),
             "disable_log_stats": (True, False), "enable_chunked_prefill": (True, None), "tensor_parallel_size": (1,),
             "pipeline_parallel_size": (1,), "data_parallel_size": (1,), "disable_custom_all_reduce": (True, False),
             "skip_tokenizer_init": (False,), "enable_trace_replay": (True, False),
             "enable_scale_out": (True, False),  # (vLLM's switch for /inference/v1/generate: always served here)
             "distributed_executor_backend": (None, "external_launcher", "uni", "mp"), "model_impl": ("auto", "vllm"),
             "enable_expert_parallel": (True, False), "disable_mm_preprocessor_cache": (True, False)}
VLLM_ANY = ("compilation_config", "limit_mm_per_prompt")  # and these, any value: CUDA graphs' sizes, image limits


WEIGHT_TRANSFER_BACKENDS = ("gloo",)  # vLLM 0.32's weight transfer, here (rollwise.engine.weight_transfer)
# vLLM's speculative_config keys, as EngineConfig's fields (its methods that need no draft model)
SPECULATIVE_CONFIG = {"num_speculative_tokens": "spec_max_tokens", "prompt_lookup_min": "spec_lookup_min",
                      "prompt_lookup_max": "spec_lookup_max", "suffix_decoding_max_tree_depth": "spec_max_depth",
                      "suffix_decoding_max_cached_requests": "spec_max_cached_requests",
                      "suffix_decoding_max_spec_factor": "spec_alpha",
                      "suffix_decoding_min_token_prob": "spec_min_token_prob"}


def speculative_args(sc: dict | None) -> dict:
    """vLLM's `speculative_config` as EngineConfig's fields: method "suffix" or "ngram" (or model
    "ngram", as vLLM reads it); a draft model, EAGLE, Medusa or MTP is a ValueError. As in vLLM a
    suffix config's num_speculative_tokens defaults to its tree depth. The controller stays
    spec_controller's (vLLM verifies every draft token: spec_controller="always")."""
    if sc is None:
        return {}
    if not isinstance(sc, dict):
        raise ValueError(f"speculative_config must be a dict (JSON object), got {type(sc).__name__}")
    method, model = sc.get("method"), sc.get("model")
    method = "ngram" if method == "[ngram]" or method is None and model in ("ngram", "[ngram]") else method
    if method not in SPECULATIVE[1:]:
        raise ValueError(f"speculative_config method must be one of {list(SPECULATIVE[1:])} here (no draft model, "
                         f"EAGLE, Medusa or MTP), got {method!r}")
    if model is not None and ("ngram" if model == "[ngram]" else model) != method:
        raise ValueError(f"speculative_config's model {model!r} and method {method!r} disagree "
                         f"({method} takes no model)")
    unknown = sorted(set(sc) - {"method", "model", *SPECULATIVE_CONFIG})
    if unknown:
        raise ValueError(f"unknown speculative_config keys {unknown}; valid: {['method', *SPECULATIVE_CONFIG]}")
    out = {"speculative": method, **{SPECULATIVE_CONFIG[k]: v for k, v in sc.items() if k in SPECULATIVE_CONFIG}}
    if method == "suffix" and "spec_max_tokens" not in out:
        out["spec_max_tokens"] = out.get("spec_max_depth", 24)
    return out


def engine_args(kwargs: dict, model) -> dict:
    """`LLM`'s keyword arguments as EngineConfig's: vLLM's checked against VLLM_ARGS and dropped;
    vLLM's dtype names ("auto": the checkpoint's, "half", "float"); `gpu_memory_utilization` taken on
    the CPU, where the KV pool is `kv_cache_gb` (as vLLM's CPU backend sizes its KV space apart from
    it), refused on a GPU."""
    out, valid = dict(kwargs), {f.name for f in fields(EngineConfig)} - {"model"}
    if out.get("dtype") == "auto":
        cfg = Path(model) / "config.json"
        if not cfg.is_file():
            raise ValueError(f"dtype 'auto' reads the checkpoint's dtype from {cfg}, which does not exist")
        hf = json.loads(cfg.read_text())
        out["dtype"] = str(hf.get("torch_dtype") or hf.get("dtype") or "float32")
    if out.get("dtype") in ("half", "float"):
        out["dtype"] = {"half": "float16", "float": "float32"}[out["dtype"]]
    for name, ok in VLLM_ARGS.items():
        if name in out and out.pop(name) not in ok:
            raise ValueError(f"{name} must be one of {list(ok)} here, got {kwargs[name]!r}")
    for name in VLLM_ANY:
        out.pop(name, None)
    reasoning = out.pop("reasoning_config", None)  # vLLM's: its strings (a parser's are <think> and </think>)
    if reasoning is not None:
        got = reasoning if isinstance(reasoning, dict) else vars(reasoning)
        if not isinstance(got, dict) or set(got) - {"reasoning_parser", "reasoning_start_str", "reasoning_end_str"}:
            raise ValueError("reasoning_config takes reasoning_parser, reasoning_start_str and reasoning_end_str")
        out.update({k: v for k, v in got.items() if k != "reasoning_parser" and v})
        reasoning = got.get("reasoning_parser") or None
    parser = out.pop("reasoning_parser", None) or reasoning  # (both use <think> and </think>; parsing is a server's)
    if parser is not None and parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS}, got {parser!r}")
    transfer = out.pop("weight_transfer_config", None)  # vLLM 0.32's; here every engine takes the gloo backend's
    if transfer is not None:
        backend = transfer.get("backend") if isinstance(transfer, dict) else getattr(transfer, "backend", None)
        if backend not in WEIGHT_TRANSFER_BACKENDS:
            raise ValueError(f"weight_transfer_config backend must be one of {list(WEIGHT_TRANSFER_BACKENDS)} here "
                             f"(vLLM's nccl and ipc need GPUs), got {backend!r}")
    spec = speculative_args(out.pop("speculative_config", None))
    clash = [k for k, v in spec.items() if out.get(k, v) != v]
    if clash:
        raise ValueError(f"speculative_config and {clash} disagree; give each once")
    out.update(spec)
    util = out.pop("gpu_memory_utilization", None)
    if util is not None:
        if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util!r}")
        if str(out.get("device", "cpu")).startswith("cuda"):
            raise ValueError("on a GPU give the KV pool's size as kv_cache_gb (GiB) rather than gpu_memory_utilization")
    unknown = sorted(set(out) - valid)
    if unknown:
        raise ValueError(f"unknown LLM arguments {unknown}; valid: {sorted(valid | set(VLLM_ARGS))}, "
                         "gpu_memory_utilization, weight_transfer_config and speculative_config")
    return out


# SGLang's ServerArgs (`sglang.Engine`'s keywords, `sglang.launch_server`'s flags): its names for EngineConfig's
SGLANG_NAMES = {"model_path": "model", "context_length": "max_model_len", "random_seed": "seed",
                "max_running_requests": "max_num_seqs", "chunked_prefill_size": "max_num_batched_tokens",
                "page_size": "block_size", "max_loras_per_batch": "max_loras",
                "enable_deterministic_inference": "batch_invariant", "mem_fraction_static": "gpu_memory_utilization",
                "speculative_num_draft_tokens": "spec_max_tokens", "speculative_ngram_max_trie_depth": "spec_max_depth",
                "speculative_ngram_branch_length": "spec_max_depth"}  # (the trie's depth: its new name, its old)
# and those with no work to do here, with the values that agree with this engine (None: any; a kernel
# backend, a log level and an address choose nothing this engine does differently)
SGLANG_ARGS = {"tp_size": (1,), "dp_size": (1,), "pp_size": (1,), "ep_size": (1,), "nnodes": (1,), "node_rank": (0,),
               "skip_tokenizer_init": (False,), "trust_remote_code": (True, False),
               "enable_memory_saver": (True, False),
               "disable_cuda_graph": (True, False), "log_level": None, "host": None,
               "port": None, "base_gpu_id": None, "gpu_id_step": None, "attention_backend": None,
               "sampling_backend": None,
               # SGLang's NGRAM trie's own knobs (how it matches and lays out a draft): the suffix trees that
               # take its place have none of them
               "speculative_ngram_min_match_window_size": None, "speculative_ngram_max_match_window_size": None,
               "speculative_ngram_min_bfs_breadth": None, "speculative_ngram_max_bfs_breadth": None,
               "speculative_ngram_match_type": None, "speculative_ngram_capacity": None}
# SGLang's speculative algorithms taken here: NGRAM (drafts from a trie over recent requests' tokens, no draft
# model) as the suffix trees, which draft from the same (the request's context, its group, earlier requests)
SGLANG_SPECULATIVE = {"NGRAM": "suffix"}
SGLANG_SPECIAL = ("disable_radix_cache", "speculative_algorithm")  # SGLang's names sglang_args maps by hand


def sglang_args(kwargs: dict) -> tuple[str, dict]:
    """SGLang's ServerArgs as (model, EngineConfig's keyword arguments): its names renamed
    (SGLANG_NAMES), `disable_radix_cache` as prefix caching off, `speculative_algorithm` NGRAM as the
    suffix trees (SGLANG_SPECULATIVE), those of SGLANG_ARGS checked and dropped, EngineConfig's own names
    taken as they are; ValueError for anything else, or a name given twice."""
    out, ours = {}, {f.name for f in fields(EngineConfig)} | {"gpu_memory_utilization"}
    for k, v in kwargs.items():
        if k == "disable_radix_cache":
            if not isinstance(v, bool):
                raise ValueError(f"disable_radix_cache must be true or false, got {v!r}")
            k, v = "enable_prefix_caching", not v
        elif k == "speculative_algorithm":
            if v not in SGLANG_SPECULATIVE:
                raise ValueError(f"speculative_algorithm must be one of {list(SGLANG_SPECULATIVE)} here (no draft "
                                 f"model, EAGLE or MTP), got {v!r}")
            k, v = "speculative", SGLANG_SPECULATIVE[v]
        elif k in SGLANG_ARGS:
            if SGLANG_ARGS[k] is not None and v not in SGLANG_ARGS[k]:
                raise ValueError(f"{k} must be one of {list(SGLANG_ARGS[k])} here, got {v!r}")
            continue
        elif k not in ours and k not in SGLANG_NAMES:
            sglang = sorted([*SGLANG_NAMES, *SGLANG_ARGS, *SGLANG_SPECIAL])
            raise ValueError(f"unknown engine arguments [{k!r}]; valid: SGLang's {sglang} and rollwise's "
                             f"{sorted(ours)}")
        k = SGLANG_NAMES.get(k, k)
        if k in out:
            raise ValueError(f"{k} is given twice (once by its SGLang name)")
        out[k] = v
    model = out.pop("model", None)
    if not model:
        raise ValueError("give the model as model_path")
    return str(model), engine_args(out, model)
