"""Frozen, validated configuration: one dataclass per subsystem."""
from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field, fields
from pathlib import Path

from rollwise.agent.parsing import PARSERS
from rollwise.agent.reasoning import REASONING_PARSERS
from rollwise.engine.block_manager import HASH_ALGOS

DTYPES = ("float32", "bfloat16", "float16")
SPECULATIVE = (None, "suffix", "ngram")
LOGPROBS_MODES = (None, "processed_logprobs", "raw_logprobs", "processed_logits", "raw_logits")
SPEC_CONTROLLERS = ("off", "always", "threshold", "adaptive")
DEVICES = ("cpu", "cuda")
SCHEDULING_POLICIES = ("fcfs", "priority")
LOAD_FORMATS = ("auto", "dummy")


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    model: str
    dtype: str = field(default="float32", metadata={"choices": DTYPES})
    device: str = "cpu"
    seed: int = 0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024  # per-step token budget (chunked prefill)
    # vLLM's --scheduling-policy: "priority" admits waiting requests by (priority, arrival), lowest
    # first, and preempts the running one with the highest; "fcfs" takes no priority but 0
    scheduling_policy: str = field(default="fcfs", metadata={"choices": SCHEDULING_POLICIES})
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    block_size: int = 16
    num_kv_blocks: int | None = None  # default: derived from kv_cache_gb
    kv_cache_gb: float = 1.0  # the KV pool (on the CPU its memory is taken page by page as blocks are first used)
    enable_prefix_caching: bool = True
    # vLLM's and SGLang's --load-format: "auto" reads the checkpoint's weights; "dummy" reads none (a
    # trainer sends them, as verl's rollouts start): the engine serves once update_weights brought every one
    load_format: str = field(default="auto", metadata={"choices": LOAD_FORMATS})
    # vLLM's --prefix-caching-hash-algo: how KV blocks are keyed; "sha256" (its default) cannot be made
    # to collide, "builtin" (Python's hash, ~4x faster to compute: benchmarks/prefix_hash.py) can
    prefix_caching_hash_algo: str = field(default="sha256", metadata={"choices": HASH_ALGOS})
    num_threads: int | None = None  # torch intra-op threads; default: torch's choice
    # the native paged attention kernel for every row (CPU, fp32; README "Native kernels"), reproducible bit
    # for bit like the torch path. None: on for head sizes 32, 64 and 128 (its vector kernel), SDPA for others
    # (its loop kernel is slower at long contexts); True: always; False: SDPA
    native_attention: bool | None = None
    # batch invariance (vLLM's VLLM_BATCH_INVARIANT, SGLang's --enable-deterministic-inference): a
    # request's logits, hence its logprobs and seeded tokens, are the same bits whatever shares its
    # batch, however its prompt is chunked or cached and with speculation or without (fp32 on the
    # CPU: every linear through oneDNN's packed GEMM, attention in the native kernel)
    batch_invariant: bool = False
    # weight versions kept for requests pinned to one (an older version is otherwise kept only while
    # requests admitted under it run); each is a full copy of the weights
    keep_weight_versions: int = 1
    # vLLM's --stream-interval: a streamed request's outputs carry at least this many new tokens each
    # (fewer outputs for the server to send; the first and the last go out at once)
    stream_interval: int = 1
    # MoE models: keep every computed token's experts (layer by layer, beside its KV) so a request
    # with `return_routed_experts` gets them (Rollout Routing Replay); SGLang's and vLLM's flag
    enable_return_routed_experts: bool = False
    # LoRA adapters served beside the base weights (vLLM's flags): requests name one (SamplingParams.lora)
    enable_lora: bool = False
    max_loras: int = 8  # adapters loaded at once
    max_lora_rank: int = 64
    # thinking models (vLLM's reasoning config): what opens a think block, and what a request's
    # thinking_token_budget forces once its block has that many tokens
    reasoning_start_str: str = "<think>"
    reasoning_end_str: str = "</think>"
    # vLLM's: a class ("package.module.Class") whose methods are mixed into the worker, for
    # collective_rpc by name (a trainer's weight sync: rollwise.engine.worker)
    worker_extension_cls: str | None = None
    # what outputs carry as logprobs (vLLM's logprobs_mode, rollwise.engine.sampler.shown_logprobs); None: the
    # sampled distribution's before top-k / top-p, at the request's temperature (what a trainer recomputes)
    logprobs_mode: str | None = field(default=None, metadata={"choices": LOGPROBS_MODES[1:]})
    # speculation: "suffix" (SuffixDecoding: drafts from suffix trees) or "ngram" (vLLM's prompt lookup:
    # rollwise.spec.ngram), verified in the same forward
    speculative: str | None = field(default=None, metadata={"choices": SPECULATIVE[1:]})
    spec_controller: str = field(default="adaptive", metadata={"choices": SPEC_CONTROLLERS})
    spec_threshold: int = 16  # threshold mode: speculate while at most this many sequences run
    spec_max_tokens: int = 16  # draft tokens per sequence per step, at most
    spec_tree: bool = False  # tree drafts (several branches verified at once) instead of chains
    spec_max_depth: int = 24
    spec_alpha: float | None = None  # draft budget = alpha * match length + offset (None: 2 under adaptive, else 1)
    spec_offset: float = 0.0
    spec_min_token_prob: float = 0.1
    spec_max_cached_requests: int = 10000
    spec_eviction: str = field(default="fifo", metadata={"choices": ("fifo", "lru")})
    # "ngram": the n-gram lengths matched (vLLM's prompt_lookup_min / _max; neither: 5 and 5; one: both that)
    spec_lookup_min: int | None = None
    spec_lookup_max: int | None = None

    def __post_init__(self) -> None:
        if self.speculative not in SPECULATIVE:
            raise ValueError(f"speculative must be one of {SPECULATIVE}, got {self.speculative!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        if self.spec_controller not in SPEC_CONTROLLERS:
            raise ValueError(f"spec_controller must be one of {SPEC_CONTROLLERS}, got {self.spec_controller!r}")
        if self.spec_max_tokens < 0 or self.spec_threshold < 0:
            raise ValueError("spec_max_tokens and spec_threshold must be >= 0")
        lo, hi = self.lookup_range
        if lo < 1 or lo > hi:
            raise ValueError(f"need 1 <= spec_lookup_min <= spec_lookup_max, got {lo} and {hi}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        if self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {HASH_ALGOS}, "
                             f"got {self.prefix_caching_hash_algo!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device.split(":")[0] not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES} (optionally 'cuda:N'), got {self.device!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "keep_weight_versions", "stream_interval"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.kv_cache_gb <= 0:
            raise ValueError(f"kv_cache_gb must be > 0, got {self.kv_cache_gb}")
        if not self.reasoning_start_str or not self.reasoning_end_str:
            raise ValueError("reasoning_start_str and reasoning_end_str must be non-empty")
        if self.worker_extension_cls:
            extension_class(self.worker_extension_cls)

    @property
    def lookup_range(self) -> tuple[int, int]:
        """The n-gram lengths "ngram" speculation matches, filled in as vLLM fills them."""
        lo, hi = self.spec_lookup_min, self.spec_lookup_max
        lo = lo if lo is not None else hi if hi is not None else 5
        return lo, hi if hi is not None else lo


def extension_class(name: str) -> type:
    """A class from its qualified name ("package.module.Class"); ValueError when it cannot be found."""
    module, _, cls = str(name).rpartition(".")
    if not module:
        raise ValueError(f"worker_extension_cls must be a qualified name (package.module.Class), got {name!r}")
    try:
        found = getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"worker_extension_cls {name!r} cannot be imported: {e}") from e
    if not isinstance(found, type):
        raise ValueError(f"worker_extension_cls {name!r} is not a class")
    return found


# vLLM's engine arguments with no work to do here, and the values that agree with this engine: no CUDA graphs
# (always eager), known architectures only (no remote code), one process (no tensor or pipeline parallelism),
# prefill always chunked, sleep mode on, statistics kept, trace replay taken, the token-in-token-out API served
VLLM_ARGS = {"enforce_eager": (True, False), "trust_remote_code": (True, False), "enable_sleep_mode": (True, False),
             "disable_log_stats": (True, False), "enable_chunked_prefill": (True, None), "tensor_parallel_size": (1,),
             "pipeline_parallel_size": (1,), "disable_custom_all_reduce": (True, False),
             "skip_tokenizer_init": (False,), "enable_trace_replay": (True, False),
             "enable_scale_out": (True, False)}  # (vLLM's switch for /inference/v1/generate: always served here)


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
            sglang = sorted([*SGLANG_NAMES, *SGLANG_ARGS, "disable_radix_cache", "speculative_algorithm"])
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


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model_name: str | None = None  # served model id; default: the model directory's name
    # the format of the model's tool calls in chat replies (vLLM's --tool-call-parser names)
    tool_call_parser: str = field(default="hermes", metadata={"choices": sorted(PARSERS)})
    # a thinking model's <think> reasoning apart from its reply (vLLM's --reasoning-parser names)
    reasoning_parser: str | None = field(default=None, metadata={"choices": REASONING_PARSERS})
    # vLLM's: the chat template (a file, or the template) in place of the tokenizer's; keyword arguments
    # for it as a JSON object, under each request's chat_template_kwargs; and where requests' missing
    # sampling fields come from ("auto": the model's generation_config.json; "vllm": none; or a folder)
    chat_template: str | None = None
    default_chat_template_kwargs: str | None = None
    generation_config: str = "auto"

    def __post_init__(self) -> None:
        if self.tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser must be one of {sorted(PARSERS)}, got {self.tool_call_parser!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS}, got {self.reasoning_parser!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        from rollwise.serve.defaults import template_kwargs, template_text
        template_kwargs(self.default_chat_template_kwargs)
        if self.chat_template is not None:
            template_text(self.chat_template)
        if self.generation_config not in ("auto", "vllm") and not Path(self.generation_config).is_dir():
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder, got {self.generation_config!r}")

    @property
    def is_loopback(self) -> bool:
        return self.host in ("127.0.0.1", "localhost", "::1") or self.host.startswith("127.")


def read_toml(path: str | Path) -> dict:
    """A TOML config file's keys; ValueError (not a traceback) for a file that is missing or not TOML."""
    import tomllib
    try:
        return tomllib.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"cannot read config file {path}: {e.strerror or e}") from e
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {path} is not TOML: {e}") from e


def check_field_types(cls, values: dict, what: str = "config") -> None:
    """Each of `values` (a config file's or `--set`'s, by field name of dataclass `cls`) of its field's
    annotated type (int, float, str, bool, dict, list / tuple, a union or Optional of them): a
    ValueError naming the key, what it takes and what it got, before anything runs (a learning rate
    of "abc" used to be found after the warm start, a float step count never)."""
    import typing
    hints = typing.get_type_hints(cls)
    for k, v in values.items():
        if k in hints and not _fits(v, hints[k]):
            raise ValueError(f"{what} key {k!r} takes {_type_name(hints[k])}, got {v!r}")


def _fits(v, t) -> bool:
    import types
    import typing
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(v, a) for a in args)
    if origin is typing.Literal:
        return v in args
    if t is type(None):
        return v is None
    if t is bool:
        return isinstance(v, bool)
    if t is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if t is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if origin in (list, tuple) or t in (list, tuple):  # (TOML has arrays only)
        if not isinstance(v, (list, tuple)):
            return False
        each = args[0] if args and (origin is list or args[-1] is Ellipsis) else None
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(v) == len(args) and all(_fits(x, a) for x, a in zip(v, args))
        return each is None or all(_fits(x, each) for x in v)
    if origin is dict or t is dict:
        return isinstance(v, dict)
    return not isinstance(t, type) or isinstance(v, t)  # (Any and the like: not checked)


def _type_name(t) -> str:
    import typing
    if typing.get_origin(t) is typing.Literal:
        return " or ".join(repr(a) for a in typing.get_args(t))
    return str(t).replace("typing.", "").replace("<class '", "").replace("'>", "").replace("NoneType", "None")
