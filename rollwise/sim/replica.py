"""A simulated replica: our engine's scheduling (continuous batching, chunked prefill under a token
budget, paged KV with prefix reuse and LRU eviction through the engine's own `BlockManager`,
preemption of the newest sequence when blocks run out) and speculation (the real `SuffixCache`
drafts on the request's real tokens, the real `SpecController` sets each step's draft budget and
learns the simulated step times), with the model forward replaced by a step-cost model and sleep
on the virtual clock. Requests are replayed: a request emits its `forced_output`.

Steps where every sequence decodes one token and nothing can be admitted are run in one stretch up
to the next finish (the batch cannot change before it); an arrival cuts the stretch at the end of
the step in progress, as it would in a real engine loop. It implements the router's `Replica`
protocol (plus `add_sequence` for shared drafting material). The scheduler rules are in `sched.py`.
"""
from __future__ import annotations

import asyncio
import random
from collections import deque

from rollwise.engine.block_manager import BlockManager
from rollwise.engine.spec_controller import SpecController, draft_alpha
from rollwise.router.prefix_index import HashMemo
from rollwise.router.replica import LoadSnapshot, ReplicaError
from rollwise.sim.cost import StepWork, step_work
from rollwise.sim.sched import Scheduling, Seq
from rollwise.spec.replay import accept
from rollwise.spec.suffix_cache import SuffixCache
from rollwise.types import GenerateOutput, GenerateRequest


def _time_up(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(False)


class SimReplica(Scheduling):
    def __init__(self, name: str, cost, *, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 num_kv_blocks: int | None = None, spec: str = "off", spec_max_tokens: int = 16,
                 spec_threshold: int = 16, spec_max_depth: int = 24, spec_tree: bool = False,
                 spec_alpha: float | None = None, spec_min_token_prob: float = 0.1,
                 share_computing_prefix: bool = True) -> None:
        self.name, self.cost = name, cost
        self.share_computing_prefix = share_computing_prefix  # the engine's Scheduler rule (sched.py)
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        num_kv_blocks = num_kv_blocks or cost.default_kv_blocks
        if not num_kv_blocks:
            raise ValueError(f"profile {cost.name!r} has no KV capacity of its own: set num_kv_blocks (kv_blocks)")
        self.blocks = BlockManager(num_kv_blocks, cost.block_size)
        self.bs = cost.block_size
        self.controller = SpecController(spec, spec_max_tokens, spec_threshold)
        self.cache = None if spec == "off" else SuffixCache(
            max_depth=spec_max_depth, max_spec_tokens=spec_max_tokens, alpha=draft_alpha(spec, spec_alpha),
            min_token_prob=spec_min_token_prob, tree=spec_tree)
        if spec == "adaptive":  # as the engine does at start: seed the step-time model
            for n in (1, 4, 16, 64, 256):
                self.controller.observe_step(n, cost.step_s(step_work([(1, 1024, 1)] * n)))
        self.memo = HashMemo(self.bs)
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.alive = True
        self._head_blocked = False  # the first waiting request did not fit; nothing frees blocks until a finish
        self._waker: asyncio.Future | None = None  # what the loop waits on: set by an arrival or a timer
        self._task: asyncio.Task | None = None
        self._ids = 0
        self.tokens_per_s = 0.0
        self.stats = dict.fromkeys(("busy_s", "steps", "prefill_tokens", "decode_tokens", "generated_tokens",
                                    "preemptions", "prefix_queries", "prefix_hits", "spec_steps", "drafted_tokens",
                                    "accepted_tokens", "verifications", "requests"), 0.0)

    # the Replica protocol ---------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        if not self.alive:
            raise ReplicaError(f"{self.name} is down")
        prompt = request.prompt_token_ids
        out = request.forced_output
        if out is None:  # free generation: stand-in tokens of the requested length
            rng = random.Random(f"{request.request_id}/{len(prompt)}")
            out = [rng.randrange(100, 50_000) for _ in range(request.params.max_tokens)]
        out = out[:request.params.max_tokens]
        if not prompt or not out:
            raise ValueError("a simulated request needs a prompt and at least one token to generate")
        if self.blocks.num_blocks_for(len(prompt) + len(out)) > self.blocks.num_blocks:
            raise ValueError(f"{len(prompt) + len(out)} tokens exceed {self.name}'s KV capacity")
        self._ids += 1
        rid = request.request_id or f"{self.name}-{self._ids}"
        seq = Seq(rid, request, prompt + out, len(prompt), self.memo.hashes(prompt, request.trajectory_id),
                   asyncio.get_running_loop().create_future())
        if self.cache is not None:
            self.cache.start_request(rid, prompt, request.group_id, session=request.trajectory_id)
        self.waiting.append(seq)
        self.stats["requests"] += 1
        self._ensure_loop()
        if self._waker is not None and not self._waker.done():
            self._waker.set_result(True)
        try:
            return await seq.future
        except asyncio.CancelledError:
            seq.aborted = True
            raise

    async def abort(self, request_id: str) -> None:
        for s in (*self.running, *self.waiting):
            if s.rid == request_id:
                s.aborted = True

    async def health(self) -> bool:
        return self.alive

    async def load(self) -> LoadSnapshot:
        st = self.stats
        return LoadSnapshot(running=len(self.running), waiting=len(self.waiting), kv_usage=self.blocks.usage,
                            tokens_per_s=self.tokens_per_s,
                            prefix_hit_rate=st["prefix_hits"] / max(st["prefix_queries"], 1), busy_s=st["busy_s"],
                            prefill_tokens=st["prefill_tokens"], decode_tokens=st["decode_tokens"], steps=st["steps"],
                            kv_capacity_tokens=float(self.blocks.num_blocks * self.bs), at=asyncio.get_running_loop().time())

    @property
    def speculates(self) -> bool:
        """Whether shared drafting material is of use here (the router skips replicas that say no)."""
        return self.cache is not None

    async def add_sequence(self, token_ids: list[int], group_id: str | None = None) -> None:
        if self.cache is not None:
            self.cache.add_sequence(token_ids, group_id)

    def kill(self) -> None:
        """The replica dies: what it holds fails (the router retries it elsewhere)."""
        self.alive = False
        for s in (*self.running, *self.waiting):
            if not s.future.done():
                s.future.set_exception(ReplicaError(f"{self.name} died"))
        self.running.clear()
        self.waiting.clear()

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    # the loop -------------------------------------------------------------------------------------
    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        try:
            await self._steps()
        except Exception as e:  # noqa: BLE001 - a bug here must fail the requests, not hang them
            for s in (*self.running, *self.waiting):
                if not s.future.done():
                    s.future.set_exception(e)
            raise

    async def _steps(self) -> None:
        loop = asyncio.get_running_loop()
        while self.alive:
            self._drop_aborted()
            if not self.running and not self.waiting:
                await self._sleep(None)
                continue
            batch, blocked = self._schedule()
            if not batch:
                raise RuntimeError(f"{self.name}: nothing schedulable ({len(self.waiting)} waiting)")
            spec_live = self.cache is not None and self.controller.wants_drafts(len(self.running))
            drafts = self._propose(batch) if spec_live else {}
            work = self._work(batch, drafts)
            dt = self.cost.step_s(work)
            k = 1 if spec_live or not blocked else self._stretch(batch)
            if k > 1:  # a stretch of pure decode steps; the KV read grows by one token per sequence per step
                more = (k - 1) * len(batch)
                grown = StepWork(work.tokens, work.logits, work.seqs, work.kv_read + more, work.attn_pairs + more,
                                 work.kv_padded + more, work.attn_padded + more)
                dt = 0.5 * (dt + self.cost.step_s(grown))
                t0 = loop.time()
                if await self._sleep(k * dt):
                    k = min(k, int((loop.time() - t0) / dt) + 1)  # an arrival: finish the step in progress
                    await asyncio.sleep(max(t0 + k * dt - loop.time(), 0.0))
            else:
                await asyncio.sleep(dt)
            if self.cache is not None:
                self.controller.observe_step(work.tokens, dt)
            self._apply(batch, drafts, k, dt)

    async def _sleep(self, delay: float | None) -> bool:
        """Sleep `delay` virtual seconds (None: until an arrival); True if an arrival came first.
        (A future and a timer rather than wait_for on an Event: no task per stretch.)"""
        loop = asyncio.get_running_loop()
        self._waker = fut = loop.create_future()
        timer = None if delay is None else loop.call_later(delay, _time_up, fut)
        try:
            return await fut
        finally:
            self._waker = None
            if timer is not None:
                timer.cancel()

    def _propose(self, batch) -> dict[Seq, tuple[list[int], list[int], str, float]]:
        cands = [s for s, n in batch if s.decodes(n)]
        if not cands:
            return {}
        drafts = self.cache.speculate_batch([s.rid for s in cands])
        plan = self.controller.plan(drafts, sum(n for _, n in batch),
                                    sum(1 for s, n in batch if s.computed + n == s.num_tokens))
        room, out = self.max_num_batched_tokens - sum(n for _, n in batch), {}
        for s, d, k in zip(cands, drafts, plan):
            k = min(k, s.out_len - s.emitted - 1, room)
            if k <= 0:
                continue
            need = self.blocks.num_blocks_for(s.computed + 1 + k) - len(s.table)
            if need > 0:
                if not self.blocks.can_allocate(need):
                    continue
                self.blocks.allocate(s.table, need)
            d = d.truncated(k)
            out[s] = (d.token_ids, d.parents, d.source, d.score)
            room -= k
        return out

    def _work(self, batch, drafts) -> StepWork:
        # logits as our engine computes them: the last position of a sequence's tokens (a prefill
        # chunk that ends its prompt needs one, not one per token), plus each draft token's
        if not drafts:
            return step_work([(n, s.computed, 1 if s.computed + n == s.num_tokens else 0) for s, n in batch])
        entries = []
        for s, n in batch:
            k = len(drafts[s][0]) if s in drafts else 0
            entries.append((n + k, s.computed, 1 + k if s.computed + n == s.num_tokens else 0))
        return step_work(entries)

    def _apply(self, batch, drafts, k: int, dt: float) -> None:
        st, bs, cache = self.stats, self.bs, self.cache
        appended, finished, emitted_total, prefill, decoded = {}, [], 0, 0, 0
        for s, n in batch:
            if s.aborted or s.future.done():
                continue
            c, before = s.computed, s.num_tokens
            if c + n != before:  # a prefill chunk short of the prompt's end: nothing sampled
                prefill += n
                s.computed = c + n
            elif not drafts and n == 1 and c >= s.prompt_len:  # a plain decode (most of them): k tokens
                s.computed, s.num_tokens = c + k, before + k
                s.emitted += k
                decoded += k
                emitted_total += k
                if cache is not None:
                    appended[s.rid] = s.full[before:before + k]
            else:
                new, d = k, drafts.get(s) if drafts else None
                if d is not None:
                    toks, parents, source, score = d
                    a = accept(toks, parents, s.full[before:before + len(toks)])
                    st["spec_steps"] += 1
                    st["verifications"] += 1
                    st["drafted_tokens"] += len(toks)
                    st["accepted_tokens"] += a
                    st["decode_tokens"] += len(toks)
                    self.controller.observe_acceptance(source, score, a)
                    new = 1 + a
                if n == 1 and c >= s.prompt_len:  # a decode (s.decodes(n))
                    decoded += k
                    s.computed = before - 1 + new
                else:
                    prefill += n
                    s.computed = c + n
                s.emitted, s.num_tokens = s.emitted + new, before + new
                emitted_total += new
                if cache is not None:
                    appended[s.rid] = s.full[before:before + new]
                if d is not None:
                    self.blocks.truncate(s.table, self.blocks.num_blocks_for(s.num_tokens))
            if s.computed // bs > s.registered:
                self._register(s)
            if s.emitted >= s.out_len:
                finished.append(s)
        if appended:
            cache.append_batch(appended)
        for s in finished:
            self._finish(s)
        st["busy_s"] += k * dt
        st["steps"] += k
        st["prefill_tokens"] += prefill
        st["decode_tokens"] += decoded
        st["generated_tokens"] += emitted_total
        rate = emitted_total / max(k * dt, 1e-9)
        self.tokens_per_s = rate if self.tokens_per_s == 0 else 0.9 * self.tokens_per_s + 0.1 * rate

    # finishing -----------------------------------------------------------------------------------
    def _finish(self, s: Seq) -> None:
        self._head_blocked = False
        self.running.remove(s)
        self.blocks.free_table(s.table)
        if self.cache is not None:
            self.cache.stop_request(s.rid)
        if not s.future.done():
            s.future.set_result(GenerateOutput(token_ids=s.full[s.prompt_len:], logprobs=[0.0] * s.out_len,
                                               finish_reason="length", num_cached_tokens=max(s.cached, 0),
                                               request_id=s.rid))

    def _drop_aborted(self) -> None:
        for s in [s for s in self.running if s.aborted]:
            self._head_blocked = False
            self.running.remove(s)
            self.blocks.free_table(s.table)
            if self.cache is not None:
                self.cache.stop_request(s.rid)
        for s in [s for s in self.waiting if s.aborted]:
            self.waiting.remove(s)
            if self.cache is not None:
                self.cache.stop_request(s.rid)

    def metrics(self) -> dict[str, float]:
        st = dict(self.stats)
        st["acceptance_rate"] = st["accepted_tokens"] / max(st["drafted_tokens"], 1)
        st["accepted_per_verification"] = st["accepted_tokens"] / max(st["verifications"], 1)
        st["prefix_hit_rate"] = st["prefix_hits"] / max(st["prefix_queries"], 1)
        st["evictions"] = float(self.blocks.num_evictions)
        return st
