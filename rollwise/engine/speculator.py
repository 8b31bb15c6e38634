"""Speculation on one replica: draft (SuffixCache, or NgramCache's prompt lookup), budget (controller),
verify, roll back.

The engine calls `propose` after scheduling (drafts for decoding sequences, KV reserved for them),
`verify` per speculating sequence after the forward, and `record` once tokens are emitted.
Request lifetime is explicit: `start` when a request is added, `stop` when it finishes or aborts.
"""
from __future__ import annotations

import time

import torch

from rollwise.config import EngineConfig
from rollwise.engine.scheduler import Scheduler, ScheduledSeq
from rollwise.engine.sequence import check_cache_salt
from rollwise.engine.spec_controller import SpecController, draft_alpha
from rollwise.engine.verification import Verdict, verify
from rollwise.spec import ngram
from rollwise.spec.suffix_cache import SOURCES, SuffixCache


class Speculator:
    def __init__(self, cfg: EngineConfig, runner, sampler) -> None:
        self.runner, self.sampler = runner, sampler
        self.tree = cfg.spec_tree
        if cfg.speculative == "ngram":
            lo, hi = cfg.lookup_range
            self.cache = ngram.NgramCache(min_n=lo, max_n=hi, max_spec_tokens=cfg.spec_max_tokens)
            sources = ngram.SOURCES
        else:
            self.cache, sources = SuffixCache(
                max_depth=cfg.spec_max_depth, max_spec_tokens=cfg.spec_max_tokens,
                alpha=draft_alpha(cfg.spec_controller, cfg.spec_alpha), offset=cfg.spec_offset,
                min_token_prob=cfg.spec_min_token_prob, max_cached_requests=cfg.spec_max_cached_requests,
                eviction=cfg.spec_eviction, tree=cfg.spec_tree), SOURCES
        self.shares_drafts = cfg.speculative != "ngram"  # (other requests' text: prompt lookup takes none)
        self.controller = SpecController(cfg.spec_controller, cfg.spec_max_tokens, cfg.spec_threshold)
        self.stats = {"spec_steps": 0, "spec_drafted_tokens": 0, "spec_accepted_tokens": 0, "spec_draft_time_s": 0.0,
                      "spec_kv_moves": 0, "spec_verifications": 0,
                      **{f"spec_drafted_{s}": 0 for s in sources}, **{f"spec_accepted_{s}": 0 for s in sources}}
        if cfg.spec_controller == "adaptive":
            self.calibrate()

    def calibrate(self, sizes: tuple[int, ...] = (1, 4, 16, 64, 256)) -> None:
        """Seed the step-time model with a few forwards before any request arrives."""
        for n in sizes:
            self.controller.observe_step(n, self.runner.time_forward(n))

    # lifecycle -----------------------------------------------------------------------------------
    def start(self, request_id: str, prompt: list[int], group_id: str | None, session: str | None = None,
              cache_salt: str | None = None) -> None:
        """A salted request drafts only from its salt's requests (its own context, its group and its
        session, named within the salt, and the salt's own global tree) and feeds no tree shared
        beyond it: an accepted draft is a timing channel, as a prefix-cache hit is."""
        group_id, session = _within(cache_salt, group_id), _within(cache_salt, session)
        self.cache.start_request(request_id, prompt, group_id, session=session, scope=cache_salt)

    def add_sequence(self, token_ids: list[int], group_id: str | None = None, cache_salt: str | None = None) -> None:
        """Drafting material from elsewhere (a turn another replica served): a salted one joins its
        salt's trees only, as the salt's own requests do."""
        check_cache_salt(cache_salt)
        self.cache.add_sequence(token_ids, _within(cache_salt, group_id), scope=cache_salt)

    def stop(self, request_id: str) -> None:
        self.cache.stop_request(request_id)

    # the step ------------------------------------------------------------------------------------
    def propose(self, batch: list[ScheduledSeq], scheduler: Scheduler, token_budget: int, max_model_len: int) -> None:
        cands = [s for s in batch if s.is_decode and s.seq.num_output_tokens >= s.seq.params.min_tokens
                 and s.seq.grammar is None and not s.seq.bad_words]  # (their masks are known a token at a time)
        if not cands or not self.controller.wants_drafts(len(scheduler.running)):
            return
        t0 = time.perf_counter()
        drafts = self.cache.speculate_batch([s.seq.request_id for s in cands], tree=self.tree)
        self.stats["spec_draft_time_s"] += time.perf_counter() - t0
        base = sum(s.num_new_tokens for s in batch)
        plan = self.controller.plan(drafts, base, sum(1 for s in batch if s.samples))
        room = token_budget - base
        for s, d, k in zip(cands, drafts, plan):
            seq = s.seq
            # the bonus token always comes on top: never draft past max_tokens or the model length
            left = min(seq.params.max_tokens - seq.num_output_tokens, max_model_len - seq.num_tokens,
                       seq.think_room()) - 1  # (nor past a thinking budget: the token after it is forced)
            k = min(k, left, room)
            if k <= 0 or not scheduler.reserve(seq, seq.num_tokens + k):
                continue
            s.draft = d.truncated(k)
            room -= k

    def verify(self, s: ScheduledSeq, logits: torch.Tensor) -> Verdict:
        seq, d = s.seq, s.draft
        v = verify(logits.float().cpu(), d, seq.params, seq.num_output_tokens, seq.forced,
                   self.sampler.generator_for(seq.params, seq.num_output_tokens), seq.token_ids,
                   self.sampler.logprobs_mode)
        # accepted tree nodes move into place after the last token (a chain is already there)
        root = s.num_computed_before + s.num_new_tokens - 1
        src = [root + 1 + i for i in v.accepted]
        dst = [root + 1 + j for j in range(len(v.accepted))]
        if src != dst:
            self.runner.move_kv(seq.block_table, src, dst)
            self.stats["spec_kv_moves"] += 1
        st = self.stats
        st["spec_verifications"] += 1
        st["spec_drafted_tokens"] += len(d)
        st["spec_accepted_tokens"] += len(v.accepted)
        st[f"spec_drafted_{d.source}"] += len(d)
        st[f"spec_accepted_{d.source}"] += len(v.accepted)
        self.controller.observe_acceptance(d.source, d.score, len(v.accepted))
        return v

    def record(self, new_tokens: dict[str, list[int]], num_tokens: int, seconds: float) -> None:
        """Tokens emitted this step go into the trees; the step's cost into the step-time model."""
        if new_tokens:
            self.cache.append_batch(new_tokens)
        self.controller.observe_step(num_tokens, seconds)

    def metrics(self) -> dict[str, float]:
        st = {k: float(v) for k, v in self.stats.items()}
        st["spec_acceptance_rate"] = st["spec_accepted_tokens"] / st["spec_drafted_tokens"] if st["spec_drafted_tokens"] else 0.0
        return {**st, **self.cache.metrics()}


def _within(salt: str | None, key: str | None) -> str | None:
    """A group or session name taken within a cache salt (another salt's same name is another tree)."""
    return key if salt is None or key is None else f"{salt}\0{key}"
