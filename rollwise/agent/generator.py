"""Generators that are not engines: a scripted one (instant, for tests and for measuring the loop's
own overhead) and a recorder that keeps every call (for checking token-in-token-out)."""
from __future__ import annotations

import asyncio
from collections.abc import Callable

from rollwise.types import GenerateOutput, GenerateRequest


class ScriptedGenerator:
    """Answers each request with `policy(request)` (text), tokenized, plus EOS; logprobs are 0.
    A text with one of the request's stop strings ends after the first of them, without EOS, as
    an engine's output would. `delay` seconds of simulated generation time per call."""

    def __init__(self, tokenizer, policy: Callable[[GenerateRequest], str], delay: float = 0.0) -> None:
        self.tokenizer, self.policy, self.delay = tokenizer, policy, delay
        self.num_calls = 0
        self.in_flight = self.max_in_flight = 0

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        self.num_calls += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.delay:
                await asyncio.sleep(self.delay)
            text, stop = self.policy(request), None
            hits = [(at, s) for s in request.params.stop if (at := text.find(s)) >= 0]
            if hits:
                at, stop = min(hits)
                text = text[:at + len(stop)]
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if stop is None:
                ids.append(self.tokenizer.eos_token_id)
            reason = "stop"
            if len(ids) > request.params.max_tokens:  # honour max_tokens as an engine would
                ids, reason = ids[:request.params.max_tokens], "length"
            return GenerateOutput(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason=reason)
        finally:
            self.in_flight -= 1


class ForcedGenerator:
    """A real generator teacher-forced to emit `policy(request)` (plus EOS): the forward passes,
    logprobs and timing are real, the text is scripted (e.g. an expert's), so episodes keep a
    realistic multi-turn shape on an untrained model."""

    def __init__(self, inner, policy: Callable[[GenerateRequest], str]) -> None:
        self.inner, self.policy, self.tokenizer = inner, policy, inner.tokenizer

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        ids = self.tokenizer.encode(self.policy(request), add_special_tokens=False)
        request.forced_output = ids + [self.tokenizer.eos_token_id]
        return await self.inner.generate(request)


class RecordingGenerator:
    """Wraps a generator and keeps (request, output) of every call."""

    def __init__(self, inner) -> None:
        self.inner, self.tokenizer = inner, inner.tokenizer
        self.calls: list[tuple[GenerateRequest, GenerateOutput]] = []

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        out = await self.inner.generate(request)
        self.calls.append((request, out))
        return out


def expert_policy(env_factory, tasks: list[dict]) -> Callable[[GenerateRequest], str]:
    """A policy that replays each task's scripted expert: turn k of an episode in group (task id) g
    gets the k-th message of g's expert script."""
    by_id = {str(t["id"]): t for t in tasks}
    scripts: dict[str, list[str]] = {}

    def policy(req: GenerateRequest) -> str:
        gid = req.group_id
        if gid not in scripts:
            scripts[gid] = env_factory().expert(by_id[gid])
        script = scripts[gid]
        return script[min(req.turn, len(script) - 1)]
    return policy
