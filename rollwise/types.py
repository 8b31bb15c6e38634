"""Shared vocabulary of rollwise: sampling parameters and request outputs.

Imports no torch: the control plane (router, rollout, spec) uses these types too.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace

from rollwise.wire import decode_routing

MAX_LOGPROBS = 20  # top logprobs per output token at most (vLLM's default max_logprobs)
PENALTIES_OFF = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}

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
    logprobs: int = 0  # also the k most likely tokens per output position, with their logprobs
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    repetition_penalty: float = 1.0  # (0, 10]; 1: off
    # None: off; k: each prompt token's logprob (and the k most likely at its position), under the
    # same distribution as the sampled tokens' logprobs (the request's temperature, no penalties)
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None  # added to those tokens' logits ([-100, 100]), before penalties
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # vLLM's: words not to write (a token completing one is banned; no drafts)
    # the output held to one of: {"json": schema}, {"json_object": true}, {"regex": r}, {"choice": [s, ...]},
    # {"grammar": lark} (vLLM's names; rollwise.engine.grammar); no speculation for such a request
    structured_outputs: dict | None = None
    # MoE: the experts each token of the request was routed to (RequestOutput.routed_experts); needs
    # an engine with `enable_return_routed_experts`
    return_routed_experts: bool = False
    # the LoRA adapter to sample with (a name loaded into the engine: `LLMEngine.add_lora`, `rollwise
    # serve --lora-modules`); None: the base weights. (vLLM passes a LoRARequest beside the params.)
    lora: str | None = None

    def __post_init__(self) -> None:
        self.stop = [self.stop] if isinstance(self.stop, str) else self.stop or []  # (checked and listed below)
        self.stop_token_ids = self.stop_token_ids or []
        _check_number("temperature", self.temperature, lo=0.0, hi=100.0)
        if self.lora is not None and (not isinstance(self.lora, str) or not self.lora):
            raise ValueError(f"lora must be the name of a loaded LoRA adapter, got {self.lora!r}")
        if not isinstance(self.return_routed_experts, bool):
            raise ValueError(f"return_routed_experts must be true or false, got {self.return_routed_experts!r}")
        _check_number("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _check_int("top_k", self.top_k, lo=-1)
        _check_number("min_p", self.min_p, lo=0.0, hi=1.0)
        _check_int("max_tokens", self.max_tokens, lo=1)
        _check_int("min_tokens", self.min_tokens, lo=0)
        _check_int("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, lo=0, hi=MAX_LOGPROBS)
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

    def for_sample(self, j: int) -> SamplingParams:
        """The params of sample j of n from one prompt: seeded ones get seed + j (vLLM's rule), so
        the samples differ and each is reproducible on its own; unseeded ones are these params."""
        if self.seed is None or j == 0:
            return self
        return replace(self, seed=(self.seed + j + 2**63) % 2**64 - 2**63)  # wraps within int64

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


FINISH_REASONS = ("stop", "length", "abort")


@dataclass(slots=True, kw_only=True)
class RequestOutput:
    """The state of one request: cumulative while streaming, final when `finished`."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # with SamplingParams.logprobs = k: per output token, the k most likely {token id: logprob}, best first
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None  # one of FINISH_REASONS once finished
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    policy_version: int = 0  # weights version of its first token (the oldest)
    # (first index in token_ids, version) per weights version, when the weights changed mid-request
    # (partial rollout); empty: every token at policy_version
    version_segments: list[tuple[int, int]] = field(default_factory=list)
    # with SamplingParams.prompt_logprobs: each prompt token's logprob (None for the first) and the
    # most likely tokens at its position ({token id: logprob}; None for the first, {} with k = 0)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None  # each one's rank: 1 + how many are likelier
    # with SamplingParams.return_routed_experts, once finished: int32 numpy [num_tokens - 1, layers, k],
    # the experts each token of prompt + output but the last was routed to in each decoder layer
    # (-1 in a layer without experts), as SGLang and vLLM return them
    routed_experts: object | None = None

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(slots=True)
class Draft:
    """Speculated tokens. A chain has parents [-1, 0, 1, ...]; in a tree, token i continues token
    parents[i] (-1: the request's last token). probs[i] is the estimated probability of the path to
    token i; score = sum(probs) = expected number of accepted tokens."""

    token_ids: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0
    source: str = ""  # which tree it came from: "request", "group" or "global"

    def __len__(self) -> int:
        return len(self.token_ids)

    def truncated(self, n: int) -> Draft:
        """The first n tokens (drafts list parents before children, so a prefix is a valid tree)."""
        if n >= len(self.token_ids):
            return self
        probs = self.probs[:n]
        return Draft(self.token_ids[:n], self.parents[:n], probs, sum(probs), self.match_len, self.source)


class WeightsNotHeld(ValueError):
    """A request pinned to a weights version its replica does not hold (another replica may)."""


@dataclass(slots=True, kw_only=True)
class GenerateRequest:
    """One generation call of an episode: token ids in, with the session metadata schedulers use."""
    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str | None = None
    trajectory_id: str | None = None
    group_id: str | None = None
    turn: int = 0
    forced_output: list[int] | None = None  # trace replay: emit these tokens (the forward still runs)
    policy_version: int | None = None  # run under these weights (a replica must hold them); None: the newest
    priority: int = 0  # a replica's scheduling priority (its "priority" policy; lower first)
    cache_salt: str | None = None  # vLLM's: KV (and drafts) shared only with requests of the same salt


@dataclass(slots=True, kw_only=True)
class GenerateOutput:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    num_cached_tokens: int = 0
    policy_version: int = 0
    request_id: str = ""
    replica: str = ""  # set by a router: which replica served it
    version_segments: list[tuple[int, int]] = field(default_factory=list)  # as in RequestOutput
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # as in RequestOutput
    prompt_logprobs: list[float | None] | None = None  # as in RequestOutput
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None
    routed_experts: object | None = None  # as in RequestOutput (numpy [num_tokens - 1, layers, k])
    stop_reason: str | int | None = None  # as in RequestOutput

    @classmethod
    def of(cls, out: RequestOutput, start: int = 0) -> GenerateOutput:
        """An engine's output from its `start`-th token on (a streamed piece: the tokens since the last):
        every field the two share, the per-token ones sliced."""
        shared = {f.name: getattr(out, f.name) for f in fields(cls) if hasattr(out, f.name)}
        return cls(**{**shared, **{k: getattr(out, k)[start:] for k in ("token_ids", "logprobs", "top_logprobs")}})


TRAJECTORY_STATUSES = ("done", "max_turns", "max_context", "timeout", "error")
CUT_OFF = TRAJECTORY_STATUSES[1:]  # a limit or an error ended the episode, not the policy


def check_cut_off(name: str, statuses) -> None:
    """A ValueError naming the valid ones if `statuses` (the option `name`) holds a status not in CUT_OFF."""
    bad = sorted(set(statuses) - set(CUT_OFF))
    if bad:
        raise ValueError(f"{name} {bad}: valid statuses are {list(CUT_OFF)}")


@dataclass(slots=True, kw_only=True)
class TurnRecord:
    start: int  # index in Trajectory.token_ids where this turn's generated tokens begin
    num_generated: int
    num_observation: int  # tokens of the observation delta appended after them (0 on the last turn)
    finish_reason: str | None
    policy_version: int
    num_cached_tokens: int
    generation_s: float
    tool_s: float
    replica: str = ""  # which replica served the turn (set when a router placed it)
    reward: float = 0.0  # what the env's step gave for this turn (the episode's reward is their sum)
    state: str | None = None  # the env's `state_key()` before the turn, if it has one (GiGPO's anchor)
    # (first generated token's offset in the turn, version) when the weights changed mid-turn
    # (partial rollout); empty: all at policy_version
    version_segments: list[tuple[int, int]] = field(default_factory=list)

    def token_versions(self) -> list[int]:
        """The policy version of each generated token of the turn."""
        out = [self.policy_version] * self.num_generated
        for (at, v), nxt in zip(self.version_segments, [s[0] for s in self.version_segments[1:]] + [self.num_generated]):
            out[at:nxt] = [v] * (nxt - at)
        return out


@dataclass(slots=True, kw_only=True)
class Trajectory:
    """One episode, token-in-token-out: token_ids is exactly the first prompt, then per turn the
    generated ids and the tokenized observation delta; loss_mask is 1 on generated ids only and
    logprobs holds their sampling logprobs (0 elsewhere).

    An episode whose environment started a new context (an agent that summarised or trimmed its
    history, or ran a sub-agent: `NewContext`) is several token sequences: `earlier` holds the others,
    each a Trajectory of its own tokens, turns and messages; the fields here are the one read last.
    `sequences()` lists them all: the trainer trains each with the episode's advantage."""

    trajectory_id: str
    group_id: str | None
    task: dict
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[TurnRecord] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # readable transcript
    reward: float = 0.0
    status: str = "done"
    error: str | None = None
    generation_s: float = 0.0
    tool_s: float = 0.0
    total_s: float = 0.0
    earlier: list[Trajectory] = field(default_factory=list)  # the other contexts, in the order they were left
    retried: list[str] = field(default_factory=list)  # why each earlier attempt was dropped (`run_attempts`)
    # the numbers in the env's step infos, summed over the episode (tool calls, errors, searches): each
    # step's metrics average them as env_<key>
    env_stats: dict[str, float] = field(default_factory=dict)
    # MoE rollouts asked for routing (Rollout Routing Replay): the experts of token_ids[:n] per layer,
    # {"shape": [n, layers, k], "data": rollwise.wire.encode_routing(...)}, from the last turn that returned them
    # (the turn's numpy array while the episode runs)
    routed_experts: dict | object | None = None
    baseline: float | None = None  # ReMax: the reward of its group's greedy episode (not trained on)

    def sequences(self) -> list[Trajectory]:
        """The episode's token sequences, one per context, in order (just this one, usually)."""
        return [*self.earlier, self]

    @property
    def num_generated(self) -> int:
        return sum(sum(s.loss_mask) for s in self.sequences())

    @property
    def num_turns(self) -> int:
        return sum(len(s.turns) for s in self.sequences())

    @property
    def policy_versions(self) -> list[int]:
        return [t.policy_version for s in self.sequences() for t in s.turns]

    def routing(self):
        """`routed_experts` as int32 numpy [n, layers, k], or None."""
        r = self.routed_experts
        return None if r is None else decode_routing(r["data"], r["shape"])

    @classmethod
    def from_dict(cls, d: dict) -> Trajectory:
        """The inverse of dataclasses.asdict (a rollout log's line)."""
        return cls(**{**d, "turns": [TurnRecord(**r) for r in d["turns"]],
                      "earlier": [cls.from_dict(e) for e in d.get("earlier", [])]})
