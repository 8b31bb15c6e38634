"""rollwise: fast agentic RL rollouts."""
from __future__ import annotations

from rollwise.sampling import LoRARequest, RepetitionDetectionParams, RequestOutputKind, TextPrompt, TokensPrompt
from rollwise.types import Logprob, RequestOutput, SamplingParams

__all__ = ["LLM", "AsyncEngine", "AsyncLLM", "AsyncLLMEngine", "AsyncEngineArgs", "EngineArgs", "SamplingParams",
           "RequestOutput", "RequestOutputKind", "LoRARequest", "TextPrompt", "TokensPrompt", "SGLangEngine",
           "RepetitionDetectionParams", "Logprob"]
_ASYNC_LLM = ("AsyncLLM", "AsyncLLMEngine", "AsyncEngineArgs", "EngineArgs")  # vLLM's names (engine/async_llm.py)
__version__ = "0.1.0"


def __getattr__(name: str):
    # torch-backed classes load lazily so that control-plane imports stay light
    if name == "LLM":
        from rollwise.engine.llm import LLM
        return LLM
    if name == "AsyncEngine":
        from rollwise.engine.async_engine import AsyncEngine
        return AsyncEngine
    if name in _ASYNC_LLM:
        from rollwise.engine import async_llm
        return getattr(async_llm, name)
    if name == "SGLangEngine":  # SGLang's offline `sglang.Engine`
        from rollwise.serve.sglang_engine import Engine
        return Engine
    raise AttributeError(f"module 'rollwise' has no attribute {name!r}")
