"""Another server (vLLM, SGLang) as a replica, through its OpenAI-compatible API."""
from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from rollwise.router.replica import HttpReplica
from rollwise.sampling import PENALTIES_OFF
from rollwise.types import GenerateOutput, GenerateRequest, SamplingParams


class OpenAIReplica(HttpReplica):
    """Another server (vLLM, SGLang) through its OpenAI /v1/completions API, token ids in and out:
    the prompt is sent as ids, and `return_tokens_as_token_ids` + `logprobs` (vLLM's extensions)
    bring back the sampled ids and their logprobs (and the top ones when asked; vLLM's include the
    sampled token). Load comes from its Prometheus /metrics."""

    def __init__(self, url: str, model: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        super().__init__(url, api_key, timeout)
        self.model = model

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        r = await self._post("/v1/completions", json=self._body(request))
        self._check(r.status_code, r.text)
        return self._completion(r.json(), request.params)

    async def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        body = self._body(request) | {"stream": True, "stream_options": {"include_usage": True}}
        last = None  # the finishing piece waits for the usage chunk (its cached-token count)
        async for c in self._events("/v1/completions", body):
            if c.get("choices"):
                if last is not None:
                    yield last
                last = self._completion(c, request.params)
            elif last is not None and c.get("usage"):
                last.num_cached_tokens = self._completion(c, request.params).num_cached_tokens
        if last is not None:
            yield last

    def _body(self, request: GenerateRequest) -> dict:
        p = request.params
        if p.prompt_logprobs is not None or p.trace_decode_token_ids is not None:
            raise ValueError("prompt logprobs and trace replay are not asked of OpenAI-API replicas (their "
                             "formats differ, vLLM's API has no trace replay); use rollwise serve replicas")
        # every sampling field, off or on: a server fills those a request leaves out from the model's
        # generation config (vLLM's default, and rollwise serve's), which would change the distribution
        # the trainer's logprobs assume (Qwen3's: top_k 20, top_p 0.95)
        body = {"model": self.model, "prompt": request.prompt_token_ids, "max_tokens": p.max_tokens,
                "temperature": p.temperature, "top_p": p.top_p, "seed": p.seed, "stop": p.stop or None,
                "logprobs": p.logprobs, "return_tokens_as_token_ids": True, "ignore_eos": p.ignore_eos,
                "min_tokens": p.min_tokens, "stop_token_ids": p.stop_token_ids or None,
                "top_k": p.top_k if p.top_k > 0 else -1, "min_p": p.min_p, **PENALTIES_OFF, **p.penalties()}
        if p.logit_bias:
            body["logit_bias"] = {str(t): b for t, b in p.logit_bias.items()}
        body["allowed_token_ids"], body["bad_words"] = p.allowed_token_ids, p.bad_words
        body["structured_outputs"] = p.structured_outputs  # (vLLM's name)
        body["cache_salt"] = request.cache_salt
        if p.repetition_detection is not None:  # (vLLM 0.32's)
            body["repetition_detection"] = dataclasses.asdict(p.repetition_detection)
        body["thinking_token_budget"] = p.thinking_token_budget
        if p.logprob_token_ids:  # (vLLM's: with logprobs on)
            body["logprob_token_ids"], body["logprobs"] = p.logprob_token_ids, len(p.logprob_token_ids)
        return {k: v for k, v in body.items() if v is not None}

    @staticmethod
    def _completion(b: dict, p: SamplingParams) -> GenerateOutput:
        """A completion (or one streamed chunk of it) as token ids: vLLM's `token_id:N` pieces."""
        ch = (b.get("choices") or [{}])[0]
        lp = ch.get("logprobs") or {}
        ids = ch.get("token_ids") or [int(t.split(":", 1)[1]) for t in lp.get("tokens", [])]
        cached = ((b.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        tops = [{int(t.split(":", 1)[1]): float(v) for t, v in top.items()} for top in lp.get("top_logprobs") or []]
        return GenerateOutput(token_ids=ids, logprobs=[float(x) for x in lp.get("token_logprobs", [0.0] * len(ids))],
                              finish_reason=ch.get("finish_reason"), num_cached_tokens=cached,
                              request_id=b.get("id", ""),
                              top_logprobs=tops if p.logprobs or p.logprob_token_ids else [])

    async def add_sequence(self, token_ids: list[int], group_id: str | None, cache_salt: str | None = None) -> None:
        pass  # other servers keep their own drafting state
