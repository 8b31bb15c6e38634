"""`SamplingParams`: how to sample one request (vLLM's names and rules), with its checks.

Imports no torch: the control plane (router, rollout, spec) uses it too.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from enum import IntEnum
from typing import TypedDict

MAX_LOGPROBS = 20  # top logprobs per output token at most (vLLM's default max_logprobs)
MAX_LOGPROB_TOKEN_IDS = 128  # vLLM's bound on logprob_token_ids
PENALTIES_OFF = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
MAX_N = 128  # samples of one prompt in one call (a bigger group: several calls, one group_id)


class RequestOutputKind(IntEnum):
    """vLLM's: what `AsyncLLM.generate` yields while a request runs: the output so far (CUMULATIVE),
    only what each step added (DELTA), or nothing until the final output (FINAL_ONLY)."""
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(frozen=True)
class RepetitionDetectionParams:
    """vLLM's: end the output (finish_reason "repetition", stop_reason "repetition_detected") once
    its last L tokens, for some L in [min_pattern_size or 1, max_pattern_size], came min_count times
    in a row: a sampler caught in a loop (common early in RL) stops, where it would run to max_tokens.
    max_pattern_size 0: off."""
    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0

    def __post_init__(self) -> None:
        for name in ("max_pattern_size", "min_pattern_size", "min_count"):
            _check_int(f"repetition_detection.{name}", getattr(self, name), lo=0)
        if self.min_pattern_size > self.max_pattern_size:
            raise ValueError("repetition_detection: min_pattern_size must be <= max_pattern_size "
                             "(both 0: off)")
        if self.max_pattern_size > 0 and self.min_count < 2:
            raise ValueError(f"repetition_detection.min_count must be >= 2 with a max_pattern_size, "
                             f"got {self.min_count}")

    def found(self, ids: list[int], start: int = 0) -> bool:
        """Whether ids[start:] (the output so far) ends in a pattern repeated min_count times."""
        end = len(ids)
        for size in range(max(self.min_pattern_size, 1), self.max_pattern_size + 1):
            if size * self.min_count > end - start:
                return False
            if ids[end - 1] != ids[end - 1 - size]:  # (most sizes fail here: no slices made for them)
                continue
            tail = ids[end - size:]
            if all(ids[end - size * (m + 1):end - size * m] == tail for m in range(1, self.min_count)):
                return True
        return False


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    """How to sample one request. `temperature == 0` means greedy.

    Logprobs of sampled tokens are always returned: they are taken under the distribution at the
    request's temperature, before top-k/top-p truncation (raw log-softmax when greedy). `logprobs=k`
    adds, for every output position, the k most likely tokens under that same distribution.

    Penalties follow vLLM and act on the logits before temperature, so the logprobs above include
    them: `repetition_penalty` r divides a positive logit by r and multiplies a negative one by r
    for every token seen in the prompt or the output so far; then each token's logit loses
    `frequency_penalty` times its count in the output and `presence_penalty` once if it occurs
    there. Speculation stays lossless: each drafted position is penalized with the drafts before it.
    """

    # vLLM's: samples of the prompt. `LLM.generate` and the servers make n requests of it (sample j
    # seeded seed + j, the n drafting from each other); an engine request is one sample (n = 1)
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0  # drop tokens below min_p x the most likely one's probability; 0: disabled
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's: read by its slow detokenizer only; its fast one (tokenizers' DecodeStream, as this engine's)
    # leaves it be, so here as there it changes nothing
    spaces_between_special_tokens: bool = True
    logprobs: int = 0  # also the k most likely tokens per output position, with their logprobs (None: 0)
    # vLLM's: instead of the k most likely, these tokens' logprobs at every output position, in this
    # order (a judge's "Yes" / "No"); `logprobs` is then 0 or their number
    logprob_token_ids: list[int] | None = None
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    repetition_penalty: float = 1.0  # (0, 10]; 1: off
    # None: off; k: each prompt token's logprob (and the k most likely at its position), under the
    # same distribution as the sampled tokens' logprobs (the request's temperature, no penalties)
    prompt_logprobs: int | None = None
    # vLLM 0.32's scoring of given tokens at each prompt row (a teacher's logprobs of a student's
    # candidates): row i holds the ids scored as prompt token prompt_logprob_start + i + 1 (one row per
    # prompt token after the start but the first; -1 pads a row). RequestOutput.prompt_token_id_logprobs
    prompt_logprob_token_ids: list[list[int]] | None = None
    prompt_logprob_start: int | None = None
    logit_bias: dict[int, float] | None = None  # added to those tokens' logits ([-100, 100]), before penalties
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # vLLM's: words not to write (a token completing one is banned; no drafts)
    # the output held to one of: {"json": schema}, {"json_object": true}, {"regex": r}, {"choice": [s, ...]},
    # {"grammar": lark} (vLLM's names; rollwise.engine.grammar); no speculation for such a request
    structured_outputs: dict | None = None
    # MoE: the experts each token of the request was routed to (RequestOutput.routed_experts); needs
    # an engine with `enable_return_routed_experts`
    return_routed_experts: bool = False
    routed_experts_prompt_start: int = 0  # vLLM's: leave out the first this many prompt tokens' experts
    # the LoRA adapter to sample with (a name loaded into the engine: `LLMEngine.add_lora`, `rollwise
    # serve --lora-modules`); None: the base weights. (vLLM's LoRARequest beside the params: `LLM.generate`'s
    # lora_request.)
    lora: str | None = None
    # vLLM's: what AsyncLLM.generate yields per step (LLM.generate, AsyncEngine.generate and the
    # servers give the final output, and stream by their own rules)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    detokenize: bool = True  # vLLM's: False gives no text (token ids only; no stop strings then)
    # vLLM's: compute the prompt even where the prefix cache holds it; None: only for prompt_logprobs
    skip_reading_prefix_cache: bool | None = None
    repetition_detection: RepetitionDetectionParams | None = None  # (or a dict of its fields)
    # vLLM's: a think block (the engine's reasoning_start_str ... reasoning_end_str, opened in the
    # prompt or the output) of this many tokens is closed: the end string's tokens are forced next.
    # None (or -1): no limit
    thinking_token_budget: int | None = None
    # vLLM's: a stream's outputs carry at least this many new tokens each (the first and the last go
    # out at once); raised to the engine's stream_interval. None: the engine's
    stream_interval: int | None = None
    flat_logprobs: bool = False  # vLLM's: the outputs' vLLM views give logprobs as FlatLogprobs (rollwise.types)
    extra_args: dict | None = None  # vLLM's: for plugins; carried, not read by this engine
    # vLLM's trace replay: emit these tokens (up to max_tokens) whatever is sampled, their logprobs the
    # model's (the engine's forced_output)
    trace_decode_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        self.stop = [self.stop] if isinstance(self.stop, str) else self.stop or []  # (checked and listed below)
        self.stop_token_ids = self.stop_token_ids or []
        self.logprobs = 0 if self.logprobs is None else self.logprobs  # (vLLM's default: no top logprobs)
        _check_int("n", self.n, lo=1, hi=MAX_N)
        if self.output_kind not in tuple(RequestOutputKind) or isinstance(self.output_kind, bool):
            raise ValueError(f"output_kind must be one of {[k.name for k in RequestOutputKind]} (0, 1, 2), "
                             f"got {self.output_kind!r}")
        self.output_kind = RequestOutputKind(self.output_kind)
        _check_number("temperature", self.temperature, lo=0.0, hi=100.0)
        if self.lora is not None and (not isinstance(self.lora, str) or not self.lora):
            raise ValueError(f"lora must be the name of a loaded LoRA adapter, got {self.lora!r}")
        _check_int("routed_experts_prompt_start", self.routed_experts_prompt_start, lo=0)
        if not isinstance(self.return_routed_experts, bool):
            raise ValueError(f"return_routed_experts must be true or false, got {self.return_routed_experts!r}")
        _check_number("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _check_int("top_k", self.top_k, lo=-1)
        _check_number("min_p", self.min_p, lo=0.0, hi=1.0)
        _check_int("max_tokens", self.max_tokens, lo=1)
        _check_int("min_tokens", self.min_tokens, lo=0)
        _check_int("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS)
        if self.stream_interval is not None:
            _check_int("stream_interval", self.stream_interval, lo=1)
        if self.logprob_token_ids is not None:
            ids = self.logprob_token_ids
            if not isinstance(ids, list) or not 0 < len(ids) <= MAX_LOGPROB_TOKEN_IDS:
                raise ValueError(f"logprob_token_ids must be a list of 1 to {MAX_LOGPROB_TOKEN_IDS} token ids")
            self.logprob_token_ids = [_token_id("logprob_token_ids", t) for t in ids]
            if self.logprobs not in (0, len(ids)):
                raise ValueError(f"with logprob_token_ids, logprobs must be 0 or their number ({len(ids)}), "
                                 f"got {self.logprobs}")
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, lo=0, hi=MAX_LOGPROBS)
        self._check_prompt_token_ids()
        _check_number("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _check_number("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _check_number("repetition_penalty", self.repetition_penalty, lo=0.0, hi=10.0, lo_open=True)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError("logit_bias must be a mapping of token id to bias")
            self.logit_bias = {_token_id("logit_bias", t): v for t, v in self.logit_bias.items()}
            for v in self.logit_bias.values():
                _check_number("logit_bias", v, lo=-100.0, hi=100.0)
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must be a non-empty list of token ids")
            self.allowed_token_ids = [_token_id("allowed_token_ids", t) for t in self.allowed_token_ids]
        if self.structured_outputs is not None:
            self.structured_outputs = check_structured(self.structured_outputs)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.seed is not None:
            _check_int("seed", self.seed, lo=-(2**63), hi=2**63 - 1)
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}")
        self.stop, self.stop_token_ids = list(self.stop), list(self.stop_token_ids)
        for name in ("detokenize", "flat_logprobs", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.skip_reading_prefix_cache, (bool, type(None))):
            raise ValueError(f"skip_reading_prefix_cache must be true or false, got {self.skip_reading_prefix_cache!r}")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (the text they are found in)")
        if self.skip_reading_prefix_cache is None:
            self.skip_reading_prefix_cache = self.scores_prompt
        if isinstance(self.repetition_detection, dict):
            names = [f.name for f in fields(RepetitionDetectionParams)]
            if set(self.repetition_detection) - set(names):
                raise ValueError(f"repetition_detection takes {names}, got {sorted(self.repetition_detection)}")
            self.repetition_detection = RepetitionDetectionParams(**self.repetition_detection)
        if self.repetition_detection is not None and not isinstance(self.repetition_detection,
                                                                    RepetitionDetectionParams):
            raise ValueError("repetition_detection must be a RepetitionDetectionParams or a dict of "
                             "max_pattern_size, min_pattern_size, min_count")
        if self.thinking_token_budget == -1:
            self.thinking_token_budget = None
        if self.thinking_token_budget is not None:
            _check_int("thinking_token_budget", self.thinking_token_budget, lo=0)
        if self.trace_decode_token_ids is not None:
            if not isinstance(self.trace_decode_token_ids, list) or not self.trace_decode_token_ids:
                raise ValueError("trace_decode_token_ids must be a non-empty list of token ids")
            self.trace_decode_token_ids = [_token_id("trace_decode_token_ids", t) for t in self.trace_decode_token_ids]
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a dict, got {type(self.extra_args).__name__}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_logit_rules(self) -> bool:
        """logit_bias or allowed_token_ids: the same change to every position's logits."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None

    @property
    def has_penalties(self) -> bool:
        return bool(self.penalties())

    def text_ids(self, token_ids: list[int], finish_reason: str | None, eos_ids=()) -> list[int]:
        """The output ids its text is decoded from: all but the stop token that ended it (an EOS
        or one of `stop_token_ids`), unless `include_stop_str_in_output`, as vLLM does, so that
        with `skip_special_tokens=False` the end-of-turn token's text is not in the reply."""
        last = token_ids[-1] if token_ids else None
        if finish_reason == "stop" and not self.include_stop_str_in_output and (
                last in self.stop_token_ids or (not self.ignore_eos and last in eos_ids)):
            return token_ids[:-1]
        return token_ids

    def penalties(self) -> dict[str, float]:
        """The penalties that are on, by field name (what a client forwards)."""
        return {k: getattr(self, k) for k, off in PENALTIES_OFF.items() if getattr(self, k) != off}

    @property
    def scores_prompt(self) -> bool:
        """Its prompt's rows are scored (prompt_logprobs, or prompt_logprob_token_ids)."""
        return self.prompt_logprobs is not None or self.prompt_logprob_token_ids is not None

    def _check_prompt_token_ids(self) -> None:
        """prompt_logprob_token_ids as vLLM takes them (nested lists or an integer array, -1 padding
        the shorter rows), kept as equal rows; its start only with them."""
        ids = self.prompt_logprob_token_ids
        if ids is None:
            if self.prompt_logprob_start is not None:
                raise ValueError("prompt_logprob_start needs prompt_logprob_token_ids")
            return
        if hasattr(ids, "tolist"):  # (a numpy array)
            ids = ids.tolist()
        if not isinstance(ids, list) or not ids or not all(isinstance(r, list) and r for r in ids):
            raise ValueError("prompt_logprob_token_ids must be a non-empty list of non-empty lists of token ids "
                             "(one row per scored prompt row)")
        width = max(map(len, ids))
        if width > MAX_LOGPROBS:
            raise ValueError(f"prompt_logprob_token_ids has {width} ids in a row; at most {MAX_LOGPROBS}")
        for r in ids:
            for t in r:
                if isinstance(t, bool) or not isinstance(t, int) or t < -1:
                    raise ValueError(f"prompt_logprob_token_ids: token ids must be integers >= 0 (-1 pads), got {t!r}")
        self.prompt_logprob_token_ids = [r + [-1] * (width - len(r)) for r in ids]
        if self.prompt_logprob_start is not None:
            _check_int("prompt_logprob_start", self.prompt_logprob_start, lo=0, hi=2**31)

    def check_prompt_scoring(self, prompt_len: int, vocab_size: int) -> None:
        """prompt_logprob_token_ids against the prompt: one row per scored prompt row (vLLM's count),
        ids in the vocabulary."""
        ids = self.prompt_logprob_token_ids
        if ids is None:
            return
        rows = max(prompt_len - 1 - (self.prompt_logprob_start or 0), 0)
        if len(ids) != rows:
            raise ValueError(f"prompt_logprob_token_ids has {len(ids)} rows, but the prompt has {rows} scored rows "
                             "(prompt_len - 1 - prompt_logprob_start)")
        if any(t >= vocab_size for r in ids for t in r):
            raise ValueError(f"prompt_logprob_token_ids take token ids in [0, {vocab_size}) (-1 pads)")

    def for_sample(self, j: int) -> SamplingParams:
        """The params of sample j of n from one prompt, one sample (n = 1): seeded ones get seed + j
        (vLLM's rule), so the samples differ and each is reproducible on its own."""
        seed = self.seed if self.seed is None or j == 0 else (self.seed + j + 2**63) % 2**64 - 2**63  # (int64)
        return self if (self.n, seed) == (1, self.seed) else replace(self, n=1, seed=seed)

    @classmethod
    def from_dict(cls, d: dict) -> SamplingParams:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown sampling fields {unknown}; valid: {sorted(names)}")
        return cls(**d)


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
_EXPECTED = {"json": "a JSON schema (an object, or a string of one)", "json_object": "true", "regex": "a string",
             "grammar": "a Lark grammar (a string)", "choice": "a non-empty list of strings"}


def check_structured(spec) -> dict:
    """`structured_outputs` checked: exactly one of STRUCTURED_KINDS, with a value of its type (a
    schema given as a string is parsed); ValueError naming the valid ones otherwise."""
    if not isinstance(spec, dict):
        raise ValueError(f"structured_outputs must be an object with one of {list(STRUCTURED_KINDS)}")
    given = [k for k in STRUCTURED_KINDS if spec.get(k) not in (None, False)]
    unknown = sorted(set(spec) - set(STRUCTURED_KINDS))
    if unknown or len(given) != 1:
        raise ValueError(f"structured_outputs takes exactly one of {list(STRUCTURED_KINDS)}, got {sorted(spec)}")
    kind, value = given[0], spec[given[0]]
    if kind == "json" and isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"structured_outputs.json: not a JSON schema: {e}") from None
    ok = {"json": isinstance(value, dict), "json_object": value is True, "regex": isinstance(value, str),
          "grammar": isinstance(value, str),
          "choice": isinstance(value, list) and bool(value) and all(isinstance(c, str) for c in value)}[kind]
    if not ok:
        raise ValueError(f"structured_outputs.{kind}: expected {_EXPECTED[kind]}")
    return {kind: value}


def _token_id(name: str, t) -> int:
    """A token id given as an int or, as OpenAI's JSON keys are, a string of one."""
    if isinstance(t, str) and t.strip().isdigit():
        t = int(t)
    if isinstance(t, bool) or not isinstance(t, int) or t < 0:
        raise ValueError(f"{name}: token ids must be non-negative integers, got {t!r}")
    return t


def _check_number(name: str, v, *, lo: float, hi: float, lo_open: bool = False) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{name} must be a number, got {type(v).__name__}")
    if v != v or v > hi or v < lo or (lo_open and v == lo):
        rng = f"{'(' if lo_open else '['}{lo}, {hi}]"
        raise ValueError(f"{name} must be in {rng}, got {v}")


def _check_int(name: str, v, *, lo: int, hi: int | None = None) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{name} must be an integer, got {type(v).__name__}")
    if v < lo or (hi is not None and v > hi):
        raise ValueError(f"{name} must be >= {lo}" + (f" and <= {hi}" if hi is not None else "") + f", got {v}")


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's: a LoRA adapter to sample with, loaded from `lora_path` (peft's directory) the first time
    its name is asked for (`LLM.generate(..., lora_request=...)`); `lora_int_id` is vLLM's id, kept."""

    lora_name: str
    lora_int_id: int = 1
    lora_path: str = ""


class TextPrompt(TypedDict, total=False):
    """vLLM's prompt dict of text (a dict: `TextPrompt(prompt="...")`), optionally with a cache salt."""
    prompt: str
    cache_salt: str


class TokensPrompt(TypedDict, total=False):
    """vLLM's prompt dict of token ids (`TokensPrompt(prompt_token_ids=[...])`), optionally with a cache salt."""
    prompt_token_ids: list[int]
    cache_salt: str


PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")


def prompt_parts(p) -> tuple:
    """(text or token ids, cache salt) of one prompt: as given, or a vLLM prompt dict."""
    if not isinstance(p, dict):
        return p, None
    if set(p) - set(PROMPT_KEYS) or ("prompt" in p) == ("prompt_token_ids" in p):
        raise ValueError(f"a prompt dict takes one of 'prompt' and 'prompt_token_ids', and optionally "
                         f"'cache_salt'; got keys {sorted(p)}")
    return p.get("prompt", p.get("prompt_token_ids")), p.get("cache_salt")
