"""Request bodies of the HTTP API. Unknown fields and wrong types are rejected (HTTP 400)."""
from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rollwise.sampling import MAX_N, SamplingParams


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _OpenAISampling(_Strict):
    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0  # vLLM's extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(1, ge=1, le=MAX_N)  # samples per prompt: a group (sample j seeded seed + j)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's extension
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's keys) -> bias
    allowed_token_ids: list[int] | None = None  # vLLM's extension
    bad_words: list[str] | None = None  # vLLM's: words the reply may not contain
    skip_special_tokens: bool = True  # vLLM's: special tokens' text left out of the reply
    spaces_between_special_tokens: bool = True  # vLLM's: no effect with a fast tokenizer, there as here
    include_stop_str_in_output: bool = False  # vLLM's: the stop string (or stop token) that ended it kept
    # structured outputs: OpenAI's response_format ({"type": "json_object"}, {"type": "json_schema",
    # "json_schema": {"schema": ...}}), vLLM's structured_outputs ({"json" | "regex" | "choice" |
    # "grammar" | "json_object": ...}) or its older guided_* fields
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    user: str | None = None
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids (token-in-token-out RL)
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob, and this many top ones (0-20)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # vLLM's: the prompt's last k tokens (-1: model length)
    priority: int = 0  # vLLM's: lower is served first (a server started with --scheduling-policy priority)
    cache_salt: str | None = None  # vLLM's: prefix-cache KV (and drafts) shared only within the salt
    # vLLM's: end a reply caught in a loop ({"max_pattern_size", "min_pattern_size", "min_count"})
    repetition_detection: dict[str, int] | None = None
    thinking_token_budget: int | None = None  # vLLM's: a think block this long is closed (-1: no limit)
    logprob_token_ids: list[int] | None = None  # vLLM's: these tokens' logprobs in place of the top ones
    # vLLM's: the reply's id is the endpoint's prefix and this (the X-Request-Id header's, if sent, first)
    request_id: str | None = None
    add_special_tokens: bool | None = None  # vLLM's: a text prompt's BOS and the like (default: completions only)
    truncation_side: Literal["left", "right"] = "left"  # vLLM's: the end truncate_prompt_tokens cuts
    stream_interval: int | None = None  # vLLM's: a stream's chunks every this many tokens (the first at once)
    # vLLM's: values for custom extensions, as SamplingParams.extra_args (carried; this engine has none)
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    # SGLang's OpenAI fields, which sglang-router sets on every request it passes on: no_stop_trim keeps
    # the stop string (as include_stop_str_in_output); hidden states are not returned here (false only)
    no_stop_trim: bool = False
    return_hidden_states: bool = False
    # session metadata for schedulers (trajectory, group, turn)
    trajectory_id: str | None = None
    group_id: str | None = None
    turn: int | None = None

    @field_validator("return_hidden_states")
    @classmethod
    def _no_hidden_states(cls, v: bool) -> bool:
        if v:
            raise ValueError("return_hidden_states: this server returns no hidden states (SGLang's field: false only)")
        return v

    def sampling(self, max_tokens: int, top_logprobs: int = 0, tokenizer=None, parser=None,
                 defaults: dict | None = None) -> SamplingParams:
        """The request's sampling; `defaults` (field -> value: the model's generation config) for the
        fields it does not set."""
        if self.logprob_token_ids and not getattr(self, "logprobs", None):
            raise ValueError("logprob_token_ids needs logprobs (true on chat, a number on completions), as in vLLM")
        given = {k: v for k, v in (defaults or {}).items() if k not in self.model_fields_set and k != "max_tokens"}
        pick = lambda k: given.get(k, getattr(self, k))  # noqa: E731
        return SamplingParams(temperature=pick("temperature"), top_p=pick("top_p"), top_k=pick("top_k"),
                              min_p=pick("min_p"), seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens,
                              stop=[] if self.stop is None else self.stop, stop_token_ids=self.stop_token_ids or [],
                              ignore_eos=self.ignore_eos, logprobs=top_logprobs,
                              logprob_token_ids=self.logprob_token_ids,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              repetition_penalty=pick("repetition_penalty"), logit_bias=self.logit_bias,
                              allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
                              skip_special_tokens=self.skip_special_tokens,
                              spaces_between_special_tokens=self.spaces_between_special_tokens,
                              prompt_logprobs=self.prompt_logprobs,
                              include_stop_str_in_output=self.include_stop_str_in_output or self.no_stop_trim,
                              structured_outputs=self.structured(tokenizer, parser),
                              repetition_detection=self.repetition_detection,
                              thinking_token_budget=self.thinking_token_budget, stream_interval=self.stream_interval,
                              extra_args=self.vllm_xargs)

    def truncated(self, ids: list[int], max_model_len: int | None) -> list[int]:
        """The prompt's ids cut to their last `truncate_prompt_tokens`, as vLLM cuts them: -1 is the
        model's length, more than it an error. `max_model_len` None (a router): -1 leaves the ids."""
        k = self.truncate_prompt_tokens
        if k is None:
            return ids
        if k == 0:
            raise ValueError("truncate_prompt_tokens must be -1 (the model's length) or at least 1")
        if max_model_len is not None and k > max_model_len:
            raise ValueError(f"truncate_prompt_tokens ({k}) is more than the model's length ({max_model_len})")
        k = (max_model_len or len(ids)) if k == -1 else k
        return ids[:k] if self.truncation_side == "right" else ids[-k:]

    def reply_ids(self, prefix: str, headers) -> tuple[str, str]:
        """(the reply's id, the engine's): vLLM's `prefix-` and the X-Request-Id header, else
        `request_id`, else a new id; the engine's is that, made unique when the client named it
        (vLLM runs several requests under one id at once)."""
        named = headers.get("x-request-id") or self.request_id
        rid = f"{prefix}-{named or uuid.uuid4().hex[:16]}"
        return rid, f"{rid}-{uuid.uuid4().hex[:8]}" if named else rid

    def structured(self, tokenizer=None, parser=None) -> dict | None:
        """The request's structured-output spec, from whichever of its fields names one (one at most)."""
        given = {k: v for k, v in (("structured_outputs", self.structured_outputs), ("guided_json", self.guided_json),
                                   ("guided_regex", self.guided_regex), ("guided_choice", self.guided_choice),
                                   ("guided_grammar", self.guided_grammar)) if v is not None}
        rf = self.response_format
        if rf is not None and rf.get("type") != "text":
            kind = rf.get("type")
            if kind == "json_object":
                given["response_format"] = {"json_object": True}
            elif kind == "json_schema":
                schema = (rf.get("json_schema") or {}).get("schema")
                if not isinstance(schema, dict):
                    raise ValueError("response_format json_schema needs json_schema.schema (an object)")
                given["response_format"] = {"json": schema}
            else:
                raise ValueError(f"response_format type {kind!r}: valid are 'text', 'json_object', 'json_schema'")
        if len(given) > 1:
            raise ValueError(f"give one way of structuring the output, got {sorted(given)}")
        if not given:
            return None
        (name, v), = given.items()
        return v if name in ("structured_outputs", "response_format") else {name.removeprefix("guided_"): v}


class CompletionRequest(_OpenAISampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # (null: as not given, vLLM's)
    logprobs: int | None = None  # the sampled token's logprob, and this many top logprobs (0-20)
    echo: bool = False  # the prompt before the completion (with logprobs: the prompt tokens' too, the first None)
    return_tokens_as_token_ids: bool = False  # vLLM's extension: logprobs.tokens as "token_id:N"

    def prompt_only(self) -> bool:
        """echo with max_tokens 0: the reply is the prompt alone (a prompt scored; vLLM's, OpenAI's legacy)."""
        return self.echo and self.max_tokens == 0


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str | dict[str, Any]  # OpenAI's: a JSON string (templates take an object too)


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    """A chat message as the chat template takes it: text `content` (a list of text parts, OpenAI's
    `[{"type": "text", "text": ...}]`, joined with newlines, as vLLM joins them), `developer` (OpenAI's
    name for the system prompt of newer models) as `system`, tool calls checked for the fields the
    template reads. Other fields (name, tool_call_id, reasoning_content) pass through."""
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's

    @model_validator(mode="after")
    def _as_template_takes_it(self) -> ChatMessage:
        if self.role == "developer":
            self.role = "system"
        if isinstance(self.content, list):
            if not all(p.get("type") == "text" and isinstance(p.get("text"), str) for p in self.content):
                raise ValueError("content must be a string or a list of text parts ({'type': 'text', 'text': "
                                 "...}): the model reads text only")
            self.content = "\n".join(p["text"] for p in self.content)
        return self


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True  # false: a reply's first tool call only
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # vLLM's: in place of the server's (needs --trust-request-chat-template)
    echo: bool = False  # vLLM's: the reply's content begins with the last message's, where that is in its role
    documents: list[dict[str, str]] | None = None  # vLLM's: for a template that reads them (RAG), as `documents`
    # vLLM's: the reply opens a new assistant turn, or (with add_generation_prompt false) goes on
    # writing the last, an assistant's message (a prefill)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs' tokens as "token_id:N"
    include_reasoning: bool = True  # vLLM's: false leaves a thinking model's reasoning out of the reply
    # SGLang's: false leaves the reasoning in the content, tags and all (no split); stream_reasoning false
    # streams it as one delta, once it ends
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    # OpenAI's fields that change nothing here, taken (as vLLM takes them) so that the clients
    # which send them work: effort (a template that reads it gets it as chat_template_kwargs),
    # storage, tiers, cache keys, user ids, verbosity
    reasoning_effort: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    verbosity: str | None = None

    @field_validator("tools")
    @classmethod
    def _function_tools(cls, tools: list[dict] | None) -> list[dict] | None:
        """A function tool (type "function", the default) needs its function as an object with a name
        (what the chat template and tool_choice read); tools of other types pass as they are."""
        for t in tools or []:
            fn = t.get("function")
            if t.get("type", "function") == "function" and not (isinstance(fn, dict) and isinstance(fn.get("name"), str)
                                                               and isinstance(fn.get("parameters", {}), dict)):
                raise ValueError('a function tool is {"type": "function", "function": {"name": ..., "parameters": '
                                 '{...}}}')
        return tools

    def sampling(self, max_tokens: int, top_logprobs: int = 0, tokenizer=None, parser=None,
                 defaults: dict | None = None) -> SamplingParams:
        """As a completion's (top_logprobs left out with logprob_token_ids, as vLLM's chat does); and with
        tools offered to a `parser` whose markup is special tokens (Kimi-K2's, DeepSeek's), their text
        is kept, as vLLM's parsers ask."""
        top = 0 if self.logprob_token_ids else top_logprobs
        params = super().sampling(max_tokens, top, tokenizer, parser, defaults)
        if self.tools and self.tool_choice != "none" and getattr(parser, "special_tokens", False):
            params.skip_special_tokens = False
        return params

    def asked_tokens(self, default: int) -> int:
        """max_completion_tokens, else max_tokens (OpenAI's newer name first, as vLLM), else `default`;
        0 is asked for, and refused as vLLM refuses it (it was taken for neither: a reply to the end)."""
        return next((x for x in (self.max_completion_tokens, self.max_tokens) if x is not None), default)

    def echoed(self) -> str:
        """vLLM's `echo`: what each reply's content begins with, the last message's text where that
        message is in the reply's role (the assistant's; with add_generation_prompt false, as vLLM
        has it, the last message's own), else nothing."""
        last = self.messages[-1]
        same_role = not self.add_generation_prompt or last.role == "assistant"
        return (last.content or "") if self.echo and same_role else ""

    def structured(self, tokenizer=None, parser=None) -> dict | None:
        """tool_choice "required" or a named function holds the reply to tool calls of the offered
        functions (their parameters' schemas) in the `parser`'s format (default Hermes), as vLLM
        does; else the request's own spec. `tokenizer`: the model's, whose own tokens for the
        format's tags (Qwen's `<tool_call>`) the grammar then uses."""
        from rollwise.agent.parsing import HermesParser, forced_tool_calls
        spec = super().structured()
        ids = {t: tokenizer.added_token_id(t) for t in getattr(parser, "tags", HermesParser.tags)} if tokenizer else {}
        tags = ids if ids and None not in ids.values() else False  # (the grammar names them by id)
        forced = forced_tool_calls(self.tools or [], self.tool_choice, tags, parser) if self.tools else None
        if forced is not None and spec is not None:
            raise ValueError("tool_choice 'required' or a named function already structures the reply; "
                             "drop response_format / structured_outputs")
        if forced is None and self.tool_choice not in (None, "auto", "none") and not self.tools:
            raise ValueError("tool_choice asks for a tool call, but no tools are offered")
        return forced or spec


class GenerateRequest(_Strict):
    """Token-level generation: ids in, ids + logprobs out. SGLang's batch form too: a list of prompts,
    with `sampling_params` one for all or a list, one each, and `rid` a list, one each."""
    input_ids: list[int] | list[list[int]] | None = None
    prompt: str | list[str] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] = Field(default_factory=dict)
    request_id: str | None = None
    stream: bool = False
    trajectory_id: str | None = None
    group_id: str | None = None
    turn: int | None = None
    forced_output: list[int] | None = None  # trace replay: emit these tokens (the forward still runs)
    policy_version: int | None = None  # run under these weights (held by this server); default: the newest
    priority: int = 0  # lower is served first (a server started with --scheduling-policy priority)
    cache_salt: str | None = None  # vLLM's: prefix-cache KV (and drafts) shared only within the salt
    # SGLang's names and logprob options (its clients, e.g. AReaL's and slime's): the reply
    # also carries SGLang's `output_ids` and `meta_info`
    text: str | list[str] | None = None  # = prompt
    rid: str | list[str] | None = None  # = request_id
    # (these four: one for all prompts of a batch, or a list, one each)
    return_logprob: bool | list[bool] = False  # meta_info.output_token_logprobs: [[logprob, id, text or None], ...]
    top_logprobs_num: int | list[int] | None = None  # meta_info.output_top_logprobs (and input_top_logprobs)
    # >= 0 with return_logprob: meta_info.input_token_logprobs from there
    logprob_start_len: int | list[int] | None = None
    return_routed_experts: bool = False  # MoE: meta_info.routed_experts (base64 int32 [tokens - 1, layers, k])
    lora_path: str | list[str | None] | None = None  # SGLang's: the loaded LoRA adapter to use (by name)
    # fields SGLang's router adds when it forwards /generate; accepted and ignored
    model: str | None = None
    background: bool | None = None
    log_metrics: bool | None = None
    no_logs: bool | None = None
    return_bytes: bool | None = None
    return_entropy: bool | None = None
    return_hidden_states: bool | None = None
    return_text_in_logprobs: bool | None = None


class AbortRequest(_Strict):
    """SGLang's /abort_request: one request by id, or every one in flight (e.g. an RL step that has
    its groups stops the rest); each returns what it has, finish reason "abort"."""
    rid: str | None = None
    abort_all: bool = False

    @model_validator(mode="after")
    def _one(self) -> AbortRequest:
        if self.abort_all == (self.rid is not None):
            raise ValueError("give either rid or abort_all: true")
        return self


class AddSequenceRequest(_Strict):
    """Drafting material for this replica's suffix cache (e.g. a trajectory finished elsewhere)."""
    token_ids: list[int] = Field(min_length=1)
    group_id: str | None = None
    cache_salt: str | None = None  # the salt whose requests alone may draft from it


class UpdateWeightsRequest(_Strict):
    model_dir: str  # a directory with *.safetensors (the format `save_model` writes)
    policy_version: int | None = None  # the trainer's version; default: the next one
    # requests in flight: finish under the old weights (false) or continue under the new ones (true)
    partial_rollout: bool = False
