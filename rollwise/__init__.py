"""rollwise: fast agentic RL rollouts."""
from __future__ import annotations

from rollwise.sampling import LoRARequest
from rollwise.types import RequestOutput, SamplingParams

__all__ = ["LLM", "AsyncEngine", "SamplingParams", "RequestOutput", "LoRARequest"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # torch-backed classes load lazily so that control-plane imports stay light
    if name == "LLM":
        from rollwise.engine.llm import LLM
        return LLM
    if name == "AsyncEngine":
        from rollwise.engine.async_engine import AsyncEngine
        return AsyncEngine
    raise AttributeError(f"module 'rollwise' has no attribute {name!r}")
