"""`LLM`: offline batch generation on the engine."""
from __future__ import annotations

import uuid

from rollwise.config import EngineConfig
from rollwise.engine.llm_engine import LLMEngine
from rollwise.types import RequestOutput, SamplingParams


class LLM:
    """LLM(model_dir, dtype="float32", max_num_seqs=64, enable_prefix_caching=True, seed=0, ...).

    Keyword arguments are the fields of `EngineConfig`.
    """

    def __init__(self, model: str, **kwargs) -> None:
        self.engine = LLMEngine(EngineConfig(model=str(model), **kwargs))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | list[int] | list, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False, group_ids: list[str | None] | None = None, n: int = 1,
                 priority: list[int] | None = None) -> list[RequestOutput]:
        """prompts: strings or token-id lists (one prompt alone is accepted too), or vLLM's prompt dicts
        (`{"prompt": text}` or `{"prompt_token_ids": ids}`, with an optional `cache_salt`); params: one for all
        or one per prompt; group_ids: the prompt group of each (siblings draft from each other).
        n: samples per prompt (a GRPO group): prompt i's come at i*n .. i*n+n-1, sample j seeded
        seed + j (`SamplingParams.for_sample`), its prompt computed once, and they form a group for
        drafting unless `group_ids` names one. priority: one per prompt (vLLM's; the engine's
        scheduling_policy must be "priority" for any but 0). Returns outputs in prompt order."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts, salts = zip(*map(_prompt, prompts)) if prompts else ((), ())
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        groups = group_ids or [None] * len(prompts)
        if len(groups) != len(prompts):
            raise ValueError(f"got {len(groups)} group_ids for {len(prompts)} prompts")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an integer >= 1, got {n!r}")
        prios = [0] * len(prompts) if priority is None else list(priority)
        if len(prios) != len(prompts):
            raise ValueError(f"got {len(prios)} priorities for {len(prompts)} prompts")
        if n > 1:
            groups = [g if g is not None else f"llm-{uuid.uuid4().hex[:12]}" for g in groups]
            prompts, groups = [p for p in prompts for _ in range(n)], [g for g in groups for _ in range(n)]
            prios, salts = [q for q in prios for _ in range(n)], [c for c in salts for _ in range(n)]
            plist = [sp.for_sample(j) for sp in plist for j in range(n)]
        ids: list[str] = []
        try:
            for p, sp, g, q, c in zip(prompts, plist, groups, prios, salts):
                ids.append(self.engine.add_request(p, sp, group_id=g, priority=q, cache_salt=c))
        except ValueError:  # all or nothing: take back the ones already queued
            for rid in ids:
                self.engine.abort(rid)
            raise
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(ids), desc="generate", unit="req")
        try:
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        if bar:
                            bar.update(1)
        except BaseException:
            for rid in ids:
                if rid not in done:
                    self.engine.abort(rid)
            raise
        finally:
            if bar:
                bar.close()
        return [done[r] for r in ids]

    def chat(self, conversations: list[list[dict]], params: SamplingParams | None = None) -> list[RequestOutput]:
        return self.generate([self.tokenizer.encode_chat(c) for c in conversations], params)

    def update_weights(self, weights, partial_rollout: bool = False) -> int:
        return self.engine.update_weights(weights, partial_rollout=partial_rollout)

    def sleep(self, level: int = 1) -> None:
        """vLLM's: give back the KV pool (level 1), and the weights (level 2; load them before generating)."""
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.engine.wake_up(tags)

    def reset_prefix_cache(self) -> bool:
        """vLLM's: forget every cached prefix block no request holds (True: done)."""
        self.engine.blocks.evict_cached()
        return True

    def get_tokenizer(self):
        return self.tokenizer

    def metrics(self) -> dict[str, float]:
        return self.engine.metrics()


PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")


def _prompt(p) -> tuple:
    """(text or token ids, cache salt) of one prompt: as given, or a vLLM prompt dict."""
    if not isinstance(p, dict):
        return p, None
    if set(p) - set(PROMPT_KEYS) or ("prompt" in p) == ("prompt_token_ids" in p):
        raise ValueError(f"a prompt dict takes one of 'prompt' and 'prompt_token_ids', and optionally "
                         f"'cache_salt'; got keys {sorted(p)}")
    return p.get("prompt", p.get("prompt_token_ids")), p.get("cache_salt")
