"""The engine loop: schedule -> propose -> run -> verify -> postprocess, one step at a time.

`LLMEngine` is synchronous and single-threaded; `LLM` drives it to completion for a batch of
prompts, `AsyncEngine` drives it from a background thread for asyncio callers.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import time
from pathlib import Path

from rollwise.config import EngineConfig
from rollwise.engine.block_manager import BlockManager
from rollwise.engine.model_runner import ModelRunner
from rollwise.engine import grammar
from rollwise.engine.isolation import Isolation
from rollwise.engine.request_stats import RequestStats
from rollwise.engine.sampler import Sampler, SampleRow
from rollwise.engine.scheduler import Scheduler
from rollwise.engine.sequence import Sequence, check_cache_salt
from rollwise.engine.sleep import SleepMode
from rollwise.engine.weights import WeightVersions
from rollwise.engine.worker import make_worker
from rollwise.engine.tokenizer import Tokenizer, eos_ids
from rollwise.types import RequestOutput, SamplingParams, WeightsNotHeld


class LLMEngine(WeightVersions, SleepMode):
    def __init__(self, cfg: EngineConfig) -> None:
        self.config = cfg
        self.tokenizer = Tokenizer(cfg.model)
        hf = json.loads((Path(cfg.model) / "config.json").read_text())
        model_max = hf.get("max_position_embeddings", 4096)
        self.max_model_len = min(cfg.max_model_len or model_max, model_max)
        self.runner = ModelRunner(cfg, self.max_model_len)
        self.vocab_size = self.runner.model.config.vocab_size
        self.eos_token_ids = eos_ids(cfg.model, self.runner.model.config.eos_token_ids, self.tokenizer)
        ends = (cfg.reasoning_start_str, cfg.reasoning_end_str)  # think blocks (Sequence.thought)
        self.think = [self.tokenizer.encode(s, add_special_tokens=False) for s in ends]
        self.grammars = grammar.Grammars(cfg.model, self.vocab_size, self.eos_token_ids)  # (built when first used)
        self.blocks = BlockManager(self.runner.num_blocks, cfg.block_size, cfg.enable_prefix_caching,
                                   cfg.prefix_caching_hash_algo)
        self.scheduler = Scheduler(self.blocks, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.scheduling_policy)
        self.sampler = Sampler(cfg.seed, cfg.logprobs_mode)
        self.isolation = Isolation(self)  # a failed step fails the request that caused it (isolation.py)
        self.request_stats = RequestStats(self.max_model_len)  # vLLM's latency histograms (request_stats.py)
        self.spec = None
        if cfg.speculative is not None:
            from rollwise.engine.speculator import Speculator
            self.spec = Speculator(cfg, self.runner, self.sampler)
        self.seqs: dict[str, Sequence] = {}
        self.streaming: dict[str, int] = {}  # requests that want an output after every step -> tokens sent
        self.policy_version = 0  # a label: the trainer's version of the newest weights given
        self.weight_updates = 0
        self._loaded = [0]  # weight versions held, oldest first (the last is the newest)
        self._roots = {0: 0}  # version -> salt of its KV block hashes
        self.loras: dict[str, object] = {}  # LoRA adapters by name (rollwise.engine.lora.Adapter)
        self._adapters: dict[int, object] = {}  # versions that are the weights plus a LoRA adapter: theirs
        self._lora_uids = itertools.count(1)
        self._ids, self._arrivals = itertools.count(), itertools.count()
        self.asleep: set[str] = set()  # sleep mode (sleep.py): "kv_cache" / "weights" given back
        self.weights_missing = set(self.runner.model.hf_tensors()) if cfg.load_format == "dummy" else set()  # sleep.py
        self.stats = dict.fromkeys(("num_steps", "prompt_tokens", "prefill_tokens", "decode_tokens", "generated_tokens",
                                    "step_time_s", "num_finished", "num_aborted", "num_interrupted",
                                    "num_failed_steps"), 0)
        # $ROLLWISE_STEP_TRACE=DIR: each step's shape and seconds to DIR/steps-PID.jsonl (the simulator fits its costs)
        trace = os.environ.get("ROLLWISE_STEP_TRACE")
        self._trace = open(Path(trace) / f"steps-{os.getpid()}.jsonl", "a", buffering=1) if trace else None
        self.worker = make_worker(self)  # vLLM's worker, for RL code's collective_rpc (worker.py)

    # requests ------------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    stream: bool = False, group_id: str | None = None,
                    forced_output: list[int] | None = None, session: str | None = None,
                    policy_version: int | None = None, priority: int = 0, cache_salt: str | None = None) -> str:
        """Validate and queue a request; raises ValueError for input the engine cannot serve.
        `stream`: step() reports it after every token, not only when it finishes. `group_id`: its
        prompt group (siblings draft from each other). `forced_output`: trace replay — the model
        runs for real but these tokens are emitted (and max_tokens is their number). `session`: the
        trajectory, whose next request's drafting tree extends this one's. `policy_version`: run
        under that version's weights (held: the newest `keep_weight_versions`, and any a request
        still runs on) instead of the newest. `priority`: under the "priority" scheduling policy,
        lower is admitted first and preempted last (vLLM's). `cache_salt` (vLLM's): its KV is shared
        only with requests of the same salt, and it drafts only from them (a tenant's secret)."""
        if not isinstance(params, SamplingParams) or params.n != 1:  # (n samples: n requests, as LLM.generate makes)
            raise ValueError("params must be SamplingParams of one sample (n = 1), got " + (
                f"n = {params.n}" if isinstance(params, SamplingParams) else type(params).__name__))
        self._check_awake()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        if not isinstance(ids, list) or not ids:
            raise ValueError("prompt must be a non-empty string or a non-empty list of token ids")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        named = [*(params.logit_bias or ()), *(params.allowed_token_ids or ()), *params.stop_token_ids,
                 *(params.logprob_token_ids or ())]
        if any(t >= self.vocab_size for t in named):
            raise ValueError("logit_bias, allowed_token_ids, stop_token_ids and logprob_token_ids take token ids "
                             f"in [0, {self.vocab_size})")
        params.check_prompt_scoring(len(ids), self.vocab_size)
        if params.return_routed_experts and self.runner.routing is None:
            raise ValueError("return_routed_experts needs a model with experts (qwen3_moe) served with "
                             "enable_return_routed_experts (--enable-return-routed-experts)")
        if params.routed_experts_prompt_start > len(ids):
            raise ValueError(f"routed_experts_prompt_start must be <= the prompt's {len(ids)} tokens")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len} "
                             "(the prompt plus at least one generated token must fit)")
        if params.trace_decode_token_ids is not None:  # (vLLM's trace replay: up to max_tokens and the model length)
            if forced_output is not None:
                raise ValueError("give trace_decode_token_ids or forced_output, not both")
            forced_output = params.trace_decode_token_ids[:min(params.max_tokens, self.max_model_len - len(ids))]
        if forced_output is not None:
            if not forced_output or not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in forced_output):
                raise ValueError(f"forced_output must be a non-empty list of token ids in [0, {self.vocab_size})")
            params = dataclasses.replace(params, max_tokens=len(forced_output), min_tokens=0, ignore_eos=True,
                                         stop=[], stop_token_ids=[])
        total = min(len(ids) + params.max_tokens, self.max_model_len)
        if self.blocks.num_blocks_for(total) > self.blocks.num_blocks:
            raise ValueError(f"request needs {total} tokens of KV; the cache holds "
                             f"{self.blocks.num_blocks * self.blocks.block_size}")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.seqs:
            raise ValueError(f"request_id {rid!r} is already in flight")
        if isinstance(priority, bool) or not isinstance(priority, int) or (
                priority and self.config.scheduling_policy != "priority"):
            raise ValueError(f"priority {priority!r}: an integer, and other than 0 only under scheduling_policy "
                             f"'priority' (this engine's is {self.config.scheduling_policy!r})")
        check_cache_salt(cache_salt)
        seq = Sequence(rid, list(ids), params, forced=list(forced_output) if forced_output else None, priority=priority,
                       arrival=next(self._arrivals), t_arrival=time.monotonic(), cache_salt=cache_salt)
        seq.thought(*self.think, prompt=True)  # (a think block the prompt opened: thinking_token_budget)
        if params.bad_words:
            seq.bad_words = self.tokenizer.bad_word_ids(params.bad_words)
        if params.structured_outputs is not None:
            if forced_output is not None:
                raise ValueError("structured_outputs and forced_output cannot go together")
            seq.grammar = self.grammars.matcher(params.structured_outputs)
        v = self.policy_version if policy_version is None else policy_version
        if v not in self._roots:
            raise WeightsNotHeld(f"weights of policy version {v} are not held (held: {self._loaded}); keep more "
                                 "with keep_weight_versions")
        seq.policy_version = seq.weights_version = v
        if params.lora is not None:
            if params.lora not in self.loras:
                raise ValueError(f"unknown LoRA adapter {params.lora!r}; loaded: {sorted(self.loras)}")
            seq.adapter = self.loras[params.lora]
        else:
            seq.adapter = self._adapters.get(v)  # the version's own adapter, if it is one
        seq.pinned, seq.hash_root = policy_version is not None, self._root(seq, v)
        self.seqs[rid] = seq
        if self.spec is not None:
            self.spec.start(rid, seq.prompt_token_ids, group_id, session, cache_salt)
        self.stats["prompt_tokens"] += len(ids)
        if stream:
            self.streaming[rid] = 0
        self.scheduler.add(seq)
        return rid

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.seqs.pop(request_id, None)
        self.streaming.pop(request_id, None)
        if seq is None:
            return None
        self._read_routing(seq)
        self.scheduler.finish(seq)
        if self.spec is not None:
            self.spec.stop(request_id)
        seq.finish_reason = "abort"
        self.stats["num_aborted"] += 1
        self.request_stats.ended(seq, time.monotonic())
        self._drop_unused()
        return self._output(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    # the loop ------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """schedule -> propose -> run -> verify -> postprocess. Returns the outputs of requests that
        finished, and the current output of streaming requests that got new tokens."""
        t_sched = time.perf_counter()
        batch = self.isolation.schedule()  # (after a failed step: its requests one at a time)
        if not batch:
            return []
        t0 = time.perf_counter()
        if self.spec is not None:
            self.spec.propose(batch, self.scheduler, self.config.max_num_batched_tokens, self.max_model_len)
        decode = sum(1 + (len(s.draft) if s.draft is not None else 0) for s in batch if s.is_decode)
        computed = sum(s.num_new_tokens + (len(s.draft) if s.draft is not None else 0) for s in batch)
        shape = None if self._trace is None else [
            [s.num_new_tokens + (len(s.draft) if s.draft is not None else 0), s.num_computed_before,
             (1 + (len(s.draft) if s.draft is not None else 0)) if s.samples else 0] for s in batch]
        logits, starts, prompt_lps = self.runner.run(batch)
        for b, got in prompt_lps.items():
            batch[b].seq.prompt_logprobs.extend(got)
        appended: dict[str, list[int]] = {}
        for s, (toks, lps, tops) in self._sample(batch, logits, starts).items():
            seq = s.seq
            before = seq.num_tokens
            if toks:
                self.request_stats.emitted(seq, time.monotonic())
            for tok, lp, top in zip(toks, lps, tops):
                seq.token_ids.append(tok)
                seq.thought(*self.think)
                seq.logprobs.append(lp)
                if top is not None:
                    seq.top_logprobs.append(top)
                if seq.grammar is not None and not seq.grammar.consume_token(tok):  # (only a forced token could)
                    seq.finish_reason = "stop"
                    seq.stop_reason = seq.stop_reason or "structured output rejected the token"
                    break
                self._check_stop(seq, tok)
                if seq.finish_reason is not None:
                    break
            appended[seq.request_id] = seq.token_ids[before:]
            s.num_new_tokens = min(s.num_new_tokens, seq.num_tokens - s.num_computed_before)  # valid KV
        self.scheduler.after_step(batch)
        seconds = time.perf_counter() - t0
        if self.spec is not None:
            self.spec.record(appended, computed, seconds)
        outputs = []
        for s in batch:
            seq = s.seq
            if seq.request_id not in appended:
                continue
            if seq.finish_reason is not None:
                self._finish(seq)
                outputs.append(self._output(seq))
            else:
                if s.draft is not None:
                    self.scheduler.release_unused(seq)
                sent = self.streaming.get(seq.request_id)  # (vLLM's stream_interval: the first output at once)
                if sent is not None and (sent == 0 or seq.num_output_tokens - sent >= max(
                        seq.params.stream_interval or 1, self.config.stream_interval)):
                    outputs.append(self._progress(seq))
        st = self.stats
        st["num_steps"] += 1
        if self.spec is not None and any(s.draft is not None for s in batch):
            self.spec.stats["spec_steps"] += 1  # counted with num_steps, once the step has run
        st["decode_tokens"] += decode  # verification computes every draft token
        st["prefill_tokens"] += computed - decode  # includes recompute after preemption
        st["generated_tokens"] += sum(len(t) for t in appended.values())
        st["step_time_s"] += seconds
        if shape is not None:
            self._trace.write(json.dumps({"e": shape, "s": time.perf_counter() - t_sched}) + "\n")
        if outputs and len(self._loaded) > 1:
            self._drop_unused()
        self.isolation.passed(batch)
        return outputs

    def _sample(self, batch, logits, starts) -> dict:
        """Emitted tokens, logprobs and top logprobs per scheduled sequence: sampled, or verified
        drafts + one."""
        emitted = {}
        plain = [b for b, s in enumerate(batch) if s.samples and s.draft is None]
        if plain:
            rows = [self._row(batch[b].seq) for b in plain]
            self._constrain(rows, [batch[b].seq for b in plain])
            at = [starts[b] for b in plain]
            # a decode batch samples every row in order: no copy of a [B, V] block
            toks, lps, tops = self.sampler(logits if at == list(range(len(logits))) else logits[at], rows)
            emitted = {batch[b]: ([t], [lp], [top]) for b, t, lp, top in zip(plain, toks, lps, tops)}
        for b, s in enumerate(batch):
            if s.draft is not None:
                v = self.spec.verify(s, logits[starts[b]:starts[b] + 1 + len(s.draft)])
                s.num_new_tokens += len(v.accepted)
                emitted[s] = (v.tokens, v.logprobs, v.top)
        return emitted

    def _constrain(self, rows: list[SampleRow], seqs: list[Sequence]) -> None:
        """Structured outputs: each constrained row's allowed tokens (the batch's masks at once)."""
        held = [(r, s) for r, s in zip(rows, seqs) if s.grammar is not None]
        if not held:
            return
        for (r, seq), m in zip(held, grammar.allowed([s.grammar for _, s in held], self.vocab_size,
                                                     self.grammars.special)):
            if not m.any():  # a grammar this tokenizer cannot spell: the output ends
                m[sorted(self.eos_token_ids)] = True
                seq.stop_reason = "structured output: no token can continue it"
            r.allowed = m

    def _row(self, seq: Sequence) -> SampleRow:
        n = seq.num_output_tokens
        forced = seq.forced[n] if seq.forced else seq.forced_next(self.think[1])
        return SampleRow(seq.params, n, self._banned(seq), forced, seq.token_ids)

    def _finish(self, seq: Sequence) -> None:
        self.request_stats.ended(seq, time.monotonic())
        self._read_routing(seq)
        self.scheduler.finish(seq)
        del self.seqs[seq.request_id]
        self.streaming.pop(seq.request_id, None)
        if self.spec is not None:
            self.spec.stop(seq.request_id)
        self.stats["num_finished"] += 1

    def _read_routing(self, seq: Sequence) -> None:
        """Its tokens' experts, from their KV slots, before the blocks are released."""
        if seq.params.return_routed_experts:
            got = self.runner.routed_experts(seq.block_table, seq.num_computed_tokens, seq.num_tokens)
            seq.routed_experts = got[seq.params.routed_experts_prompt_start:]

    def _banned(self, seq: Sequence) -> tuple[int, ...]:
        """The tokens it may not sample next: EOS and stop tokens before min_tokens, and the last token
        of a bad word whose other tokens the output ends with (vLLM's rule)."""
        p, n = seq.params, seq.num_output_tokens
        if n >= p.min_tokens and not seq.bad_words:
            return ()
        out = set() if n >= p.min_tokens else (set() if p.ignore_eos else self.eos_token_ids) | set(p.stop_token_ids)
        for ids in seq.bad_words or ():
            k = len(ids) - 1
            if n >= k and (not k or seq.token_ids[len(seq.token_ids) - k:] == ids[:-1]):
                out.add(ids[-1])
        return tuple(sorted(out))

    def _check_stop(self, seq: Sequence, tok: int) -> None:
        p = seq.params
        n = seq.num_output_tokens
        if n >= p.min_tokens:
            if (not p.ignore_eos and tok in self.eos_token_ids) or tok in p.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", tok
                return
            if p.stop:
                # a stop string ends in this token's text: look in the last few tokens' text only (a
                # token is at least a quarter of a character), the whole output's once one is there
                longest = max(map(len, p.stop))
                tail = len(self.tokenizer.decode([tok], p.skip_special_tokens)) + longest
                window = self.tokenizer.decode(seq.output_token_ids[-(4 * tail + 8):], p.skip_special_tokens)
                for s in p.stop:
                    if window.find(s, max(0, len(window) - tail)) < 0:
                        continue
                    text = self.tokenizer.decode(seq.output_token_ids, p.skip_special_tokens)
                    at = text.find(s, max(0, len(text) - tail))
                    if at >= 0:
                        seq.finish_reason, seq.stop_reason = "stop", s
                        seq.text = text[:at + (len(s) if p.include_stop_str_in_output else 0)]
                        return
        if n >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
        elif (rep := p.repetition_detection) and n >= p.min_tokens and rep.found(seq.token_ids, seq.prompt_len):
            seq.finish_reason, seq.stop_reason = "repetition", "repetition_detected"

    def _progress(self, seq: Sequence) -> RequestOutput:
        """A streaming request's tokens since its last output, and their logprobs (AsyncEngine adds
        them up): a step costs what it adds, where a copy of the whole output each step cost 70 us
        per stream at 8,000 tokens, on the engine's thread."""
        sent, n = self.streaming[seq.request_id], seq.num_output_tokens
        self.streaming[seq.request_id] = n
        return RequestOutput(request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids,
                             token_ids=seq.token_ids[seq.prompt_len + sent:], logprobs=seq.logprobs[sent:n],
                             top_logprobs=seq.top_logprobs[sent:n], policy_version=seq.policy_version,
                             flat_logprobs=seq.params.flat_logprobs)

    def _output(self, seq: Sequence) -> RequestOutput:
        finished = seq.finish_reason is not None
        text = ""
        if finished and seq.params.detokenize:
            text = seq.text if seq.text is not None else self.tokenizer.decode(seq.params.text_ids(
                seq.output_token_ids, seq.finish_reason, self.eos_token_ids), seq.params.skip_special_tokens)
            text = text.rstrip("\ufffd")  # (an incomplete last character is held back, as vLLM holds it)
        return RequestOutput(
            request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.output_token_ids, logprobs=list(seq.logprobs), top_logprobs=list(seq.top_logprobs),
            text=text, finished=finished,
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
            num_cached_tokens=max(seq.num_cached_tokens, 0), policy_version=seq.policy_version,
            version_segments=list(seq.version_segments), routed_experts=seq.routed_experts,
            weight_versions=self.weight_spans(seq) if finished else None,
            tokenizer=self.tokenizer if seq.params.detokenize else None, flat_logprobs=seq.params.flat_logprobs,
            prompt_token_id_logprobs=seq.prompt_id_scores if finished else None,
            **({} if seq.params.prompt_logprobs is None else {
                "prompt_token_logprobs": [x and x[0] for x in seq.prompt_logprobs],
                "prompt_top_logprobs": [x and x[1] for x in seq.prompt_logprobs],
                "prompt_logprob_ranks": [x and x[2] for x in seq.prompt_logprobs]}))

    # metrics -------------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        s, sch = self.stats, self.scheduler
        return {
            **{k: float(v) for k, v in s.items()},
            "num_running": float(len(sch.running)),
            "num_waiting": float(len(sch.waiting) + len(sch.held)),
            "kv_usage": self.blocks.usage,
            "num_kv_blocks": float(self.blocks.num_blocks),
            "kv_capacity_tokens": float(self.blocks.num_blocks * self.blocks.block_size),
            "prefix_queries": float(sch.prefix_queries),
            "prefix_hits": float(sch.prefix_hits),
            "prefix_hit_rate": sch.prefix_hits / sch.prefix_queries if sch.prefix_queries else 0.0,
            "num_preemptions": float(sch.num_preemptions),
            "num_evictions": float(self.blocks.num_evictions),
            "policy_version": float(self.policy_version),
            "weight_versions": float(len(self._loaded)),  # held at once (each a copy of the weights)
            "is_sleeping": float(self.is_sleeping),
            **(self.spec.metrics() if self.spec is not None else {}),
        }
