"""Shared vocabulary of rollwise: request outputs, drafts, episodes (`SamplingParams` is in
rollwise.sampling and named here too).

Imports no torch: the control plane (router, rollout, spec) uses these types too.
"""
from __future__ import annotations

import functools
import os
from itertools import chain, repeat
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from rollwise.sampling import SamplingParams
from rollwise.wire import decode_routing

FINISH_REASONS = ("stop", "length", "abort", "repetition")


class TopLogprobs(dict):
    """One output position's most likely {token id: logprob}, best first (or the ids a request named),
    and `rank`: the emitted token's rank in the whole vocabulary, as vLLM counts it (how many tokens
    are at least as likely, itself included); None where it is not known."""
    __slots__ = ("rank",)

    def __init__(self, items=(), rank: int | None = None) -> None:
        super().__init__(items)
        self.rank = rank

    def __reduce__(self):
        return TopLogprobs, (dict(self), self.rank)


def tops_from_json(tops: list | None, ranks: list | None) -> list[TopLogprobs]:
    """The inverse of `/generate`'s `top_logprobs` ([[id, logprob], ...] per token) and
    `top_logprob_ranks` (one per token; absent from older servers)."""
    tops = tops or []
    return [TopLogprobs(((t, lp) for t, lp in top), r) for top, r in zip(tops, ranks or [None] * len(tops))]


@dataclass(slots=True, kw_only=True)
class RequestOutput:
    """The state of one request: cumulative while streaming, final when `finished`."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # with SamplingParams.logprobs = k: per output token, the k most likely {token id: logprob}, best first
    # (TopLogprobs: with the token's rank in the vocabulary where the engine knows it)
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
    # most likely tokens at its position ({token id: logprob}; None for the first, {} with k = 0);
    # `prompt_logprobs` gives them as vLLM does
    prompt_token_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None  # each one's rank: how many are at least as likely
    # with SamplingParams.prompt_logprob_token_ids, once finished: float32 numpy [rows, ids], row i the
    # logprobs of its ids as prompt token prompt_logprob_start + i + 1 (-inf where -1 padded), as vLLM's
    prompt_token_id_logprobs: object | None = None
    flat_logprobs: bool = False  # SamplingParams.flat_logprobs: the vLLM views below as FlatLogprobs
    # with SamplingParams.return_routed_experts, once finished: int32 numpy [num_tokens - 1, layers, k],
    # the experts each token of prompt + output but the last was routed to in each decoder layer
    # (-1 in a layer without experts), as SGLang and vLLM return them
    routed_experts: object | None = None
    # vLLM's, once finished: the spans of output tokens sampled under each weights label (the label
    # `LLM.update_weight_version` or `finish_weight_update` gave the weights; "default" before any)
    weight_versions: list[WeightVersionSpan] | None = None
    index: int = 0  # its number among its prompt's samples (vLLM's CompletionOutput.index)
    prompt: str | None = None  # vLLM's: the prompt's text, when LLM.generate was given text
    # from LLM.generate with SamplingParams.n: the prompt's samples (this output is the first of them)
    samples: list[RequestOutput] | None = None
    # the engine's tokenizer, which spells the Logprobs' decoded_token in the vLLM views below (None
    # with SamplingParams.detokenize False, as vLLM leaves them)
    tokenizer: object | None = field(default=None, repr=False, compare=False)

    @property
    def outputs(self) -> list[CompletionOutput]:
        """vLLM's: the prompt's completions, as vLLM's CompletionOutput (made at each call); one unless
        SamplingParams.n asked for more (`samples` holds them as RequestOutputs)."""
        return [CompletionOutput.of(o) for o in ([self] if self.samples is None else self.samples)]

    @property
    def prompt_logprobs(self) -> list[dict[int, Logprob] | None] | None:
        """vLLM's (made at each call): per prompt token (None for the first), {token id: Logprob} for
        the token (with its rank in the vocabulary), then the SamplingParams.prompt_logprobs most likely
        (ranked 1..k); None unless prompt logprobs were asked for."""
        lps = self.prompt_token_logprobs
        if lps is None:
            return None
        tops = self.prompt_top_logprobs or [None] * len(lps)
        ranks = self.prompt_logprob_ranks or [None] * len(lps)
        ids = self.prompt_token_ids
        got = [None if lp is None else _position(self.tokenizer, t, lp, rank, top or {}, ids[max(1, i - 4):i])
               for i, (t, lp, rank, top) in enumerate(zip(ids, lps, ranks, tops))]
        return FlatLogprobs.of(got) if self.flat_logprobs else got


@dataclass(slots=True, frozen=True)
class Logprob:
    """vLLM's: a token's logprob, with its rank (how many tokens are at least as likely) where known, and
    its text alone (vLLM's decode of [token id]) where the output knows its tokenizer."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class FlatLogprobs(Sequence):
    """vLLM's flat form of per-position logprobs (SamplingParams.flat_logprobs): every position's
    entries in flat lists (position i's are [start_indices[i], end_indices[i])). Reads as the list of
    {token id: Logprob} it stands for (a position with none: {}). vLLM builds it to spare the garbage
    collector a dict per token; here it is made from those dicts, for code that reads vLLM's form."""
    start_indices: list[int] = field(default_factory=list)
    end_indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)
    decoded_tokens: list[str | None] = field(default_factory=list)

    @classmethod
    def of(cls, positions) -> FlatLogprobs:
        out = cls()
        for pos in positions:
            out.start_indices.append(len(out.token_ids))
            for t, p in (pos or {}).items():
                out.token_ids.append(t)
                out.logprobs.append(p.logprob)
                out.ranks.append(p.rank)
                out.decoded_tokens.append(p.decoded_token)
            out.end_indices.append(len(out.token_ids))
        return out

    def __len__(self) -> int:
        return len(self.start_indices)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return FlatLogprobs.of([self[j] for j in range(*i.indices(len(self)))])
        return {self.token_ids[k]: Logprob(self.logprobs[k], self.ranks[k], self.decoded_tokens[k])
                for k in range(self.start_indices[i], self.end_indices[i])}


@dataclass(slots=True, frozen=True)
class WeightVersionSpan:
    """vLLM's: output tokens [start, end) were sampled by the weights labelled `version`."""
    version: str
    start: int
    end: int


@dataclass(slots=True, kw_only=True)
class CompletionOutput:
    """vLLM's view of one sample. `logprobs`: per output position {token id: Logprob}, the sampled
    token first, then with SamplingParams.logprobs = k the k most likely (ranked 1..k)."""
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float
    logprobs: list[dict[int, Logprob]]
    finish_reason: str | None
    stop_reason: str | int | None
    routed_experts: object | None = None  # as in RequestOutput (vLLM's [tokens, layers, k])
    weight_versions: list[WeightVersionSpan] | None = None  # as in RequestOutput

    @classmethod
    def of(cls, out: RequestOutput) -> CompletionOutput:
        ids, tops = out.token_ids, out.top_logprobs
        logprobs = [_position(out.tokenizer, t, lp, getattr(top, "rank", None), top or {}, ids[max(0, i - 4):i])
                    for i, (t, lp, top) in enumerate(zip(ids, out.logprobs, chain(tops, repeat(None))))]
        logprobs = FlatLogprobs.of(logprobs) if out.flat_logprobs else logprobs
        return cls(index=out.index, text=out.text, token_ids=list(out.token_ids),
                   cumulative_logprob=float(sum(out.logprobs)), logprobs=logprobs, finish_reason=out.finish_reason,
                   stop_reason=out.stop_reason, routed_experts=out.routed_experts,
                   weight_versions=out.weight_versions)


def _position(tok, t: int, lp: float, rank: int | None, top: dict[int, float], context: list[int]
              ) -> dict[int, Logprob]:
    """One position's {token id: Logprob}: the token first, then the most likely ones (ranked 1..k;
    the token's own rank is its place among them when it is one). `context`: the tokens before it."""
    ranks = {k: r for r, k in enumerate(top, 1)}
    first = {t: Logprob(lp, ranks.get(t, rank), _decoded(tok, t, context))}
    return first | {k: Logprob(top[k], r, _decoded(tok, k, context)) for k, r in ranks.items() if k != t}


def _decoded(tok, t: int, context: list[int]) -> str | None:
    """vLLM's decoded_token: the token's text alone (a special token's too); a token ending inside a
    UTF-8 character (a byte-level piece, U+FFFD alone) gets the text it completes after up to 4 tokens
    before it, or "" where the character is still incomplete, as vLLM 0.32 corrects it. None without
    a tokenizer."""
    text = _piece(tok, t)
    if text is None or not text.endswith("\ufffd"):
        return text
    for n in range(1, min(len(context), 4) + 1):
        ctx = context[-n:]
        whole = tok.decode(ctx + [t], skip_special_tokens=False)
        if whole.endswith("\ufffd"):
            continue
        clean = len(ctx)  # the context tokens before the incomplete ones: their text is not this token's
        while clean and _piece(tok, ctx[clean - 1]).endswith("\ufffd"):
            clean -= 1
        prefix = tok.decode(ctx[:clean], skip_special_tokens=False) if clean else ""
        return whole[len(os.path.commonprefix([prefix, whole])):]
    return ""


@functools.lru_cache(maxsize=1 << 16)
def _piece(tok, t: int) -> str | None:
    return None if tok is None else tok.decode([t], skip_special_tokens=False)


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

    def __post_init__(self) -> None:
        if getattr(self.params, "n", 1) != 1:
            raise ValueError(f"a GenerateRequest is one sample: params.n must be 1, got {self.params.n} "
                             "(n samples: n requests with one group_id)")


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
    prompt_token_logprobs: list[float | None] | None = None  # as in RequestOutput
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None
    routed_experts: object | None = None  # as in RequestOutput (numpy [num_tokens - 1, layers, k])
    stop_reason: str | int | None = None  # as in RequestOutput
    prompt_token_id_logprobs: object | None = None  # as in RequestOutput

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
