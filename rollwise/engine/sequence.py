"""One request's state inside the engine: its tokens, KV blocks and progress. Imports no torch."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from rollwise.engine.block_manager import chain_hashes
from rollwise.types import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # with params.logprobs > 0
    # with params.prompt_logprobs: per prompt token so far, (its logprob, the top ones, its rank); the first has none
    prompt_logprobs: list[tuple[float, dict[int, float], int] | None] | None = None
    # with params.prompt_logprob_token_ids: numpy [rows, ids], filled as the prompt's rows are computed
    prompt_id_scores: object | None = None
    status: Status = Status.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # of full blocks of token_ids
    hash_root: int = 0  # salt of its block hashes: its weights', adapter's and cache_salt's (weights.py)
    cache_salt: str | None = None  # vLLM's: its KV matches only requests of the same salt
    num_registered_blocks: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first admission; -1 until admitted
    num_preemptions: int = 0
    priority: int = 0  # under the "priority" scheduling policy: lower runs first (vLLM's)
    arrival: int = 0  # its place in the order requests were added (ties of priority)
    # time.monotonic() when it was added, first admitted (-1: not yet), emitted its first and its last tokens
    t_arrival: float = 0.0  # (request_stats.py)
    t_scheduled: float = -1.0
    t_first_token: float = -1.0
    t_last_token: float = -1.0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text: str | None = None  # set when a stop string truncates the output
    forced: list[int] | None = None  # trace replay: the output tokens to emit
    grammar: object | None = None  # structured outputs: its llguidance matcher (rollwise.engine.grammar)
    bad_words: list[list[int]] | None = None  # params.bad_words' token ids, as written and after a space
    policy_version: int = 0  # weights version of its first token (the oldest)
    weights_version: int = 0  # the weights it runs under now
    pinned: bool = False  # the caller chose weights_version: a partial-rollout update leaves it there
    # (first output index, version) for each weights version its tokens came from, once the weights
    # changed under it (partial rollout); empty: every token at policy_version
    version_segments: list[tuple[int, int]] = field(default_factory=list)
    routed_experts: object | None = None  # with params.return_routed_experts, read when it finishes
    adapter: object | None = None  # params.lora's adapter as loaded when it was admitted (rollwise.engine.lora)
    # with params.thinking_token_budget: tokens of the open think block (None: none open), and how many
    # of the end string's tokens were forced so far
    think_count: int | None = None
    think_forced: int = 0
    # (weights label, first output index) from each relabel of the weights while it was live, after the
    # label it began with; empty: all under the label at its end (WeightVersions.set_weight_version)
    label_starts: list[tuple[str, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.params.scores_prompt and self.prompt_logprobs is None:  # (the rows computed so far)
            self.prompt_logprobs = [None]
        ids = self.params.prompt_logprob_token_ids
        if ids is not None and self.prompt_id_scores is None:
            self.prompt_id_scores = np.full((len(ids), len(ids[0])), -np.inf, dtype=np.float32)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all known: its prompt must be computed, not taken
        from the prefix cache (a cached block has no logits)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def thought(self, start: list[int], end: list[int], prompt: bool = False) -> None:
        """Thinking budget bookkeeping (params.thinking_token_budget, vLLM's), after the prompt or
        after each output token: a block opens where `start`'s tokens end and closes where `end`'s
        do, written or forced; one that reached the budget gets `end` forced (`forced_next`)."""
        budget = self.params.thinking_token_budget
        if budget is None:
            return
        ids = self.token_ids
        if prompt:  # a block opened in the prompt and not closed there counts its tokens
            opened, closed = _last(ids, start), _last(ids, end)
            self.think_count = len(ids) - opened - len(start) if opened > closed else None
        elif self.think_count is None:
            self.think_count = 0 if ids[-len(start):] == start else None
        elif self.think_forced or self.think_count >= budget:  # (the token just emitted was forced)
            self.think_forced += 1
            if self.think_forced == len(end):
                self.think_count, self.think_forced = None, 0
        elif ids[-len(end):] == end:
            self.think_count = None
        else:
            self.think_count += 1

    def forced_next(self, end: list[int]) -> int | None:
        """The token to emit next whatever is sampled: the end string's next one, once the open think
        block reached the budget."""
        budget, n = self.params.thinking_token_budget, self.think_count
        return end[self.think_forced] if budget is not None and n is not None and n >= budget else None

    def think_room(self) -> int:
        """Tokens it may emit in one step with no forced token among them (its drafts' bound)."""
        budget = self.params.thinking_token_budget
        if budget is None:
            return 1 << 30
        return budget if self.think_count is None else budget - self.think_count

    def full_block_hashes(self, block_size: int, chain=chain_hashes) -> list[int]:
        """Chained hashes of all full blocks, extended incrementally as tokens arrive (`chain`: the
        block manager's hash function)."""
        n_full = len(self.token_ids) // block_size
        if len(self.block_hashes) < n_full:
            done = len(self.block_hashes)
            root = self.block_hashes[-1] if done else self.hash_root
            self.block_hashes.extend(chain(self.token_ids[done * block_size:n_full * block_size], block_size, root))
        return self.block_hashes[:n_full]


def _last(ids: list[int], pattern: list[int]) -> int:
    """Where `pattern` last begins in ids (-1: nowhere)."""
    for i in range(len(ids) - len(pattern), -1, -1):
        if ids[i:i + len(pattern)] == pattern:
            return i
    return -1


def check_cache_salt(salt) -> None:
    """vLLM's cache_salt: None, or a non-empty string (else a ValueError naming it)."""
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}")
