"""Frozen, validated configuration: one dataclass per subsystem (vLLM's and SGLang's names for the
engine's settings: rollwise.peer_args)."""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
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
LOAD_FORMATS = ("auto", "dummy", "safetensors")
LOOPBACK = ("127.0.0.1", "localhost", "::1")  # host names of this machine's loopback (and 127.x.y.z)


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
    # vLLM's and SGLang's --load-format: "auto" reads the checkpoint's weights ("safetensors", their only
    # format here, the same); "dummy" reads none (a trainer sends them, as verl's rollouts start): the engine
    # serves once update_weights brought every one
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
    trust_request_chat_template: bool = False  # vLLM's: chat requests may bring their own chat_template
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
        return self.host in LOOPBACK or self.host.startswith("127.")


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
