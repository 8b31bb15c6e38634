"""A rollout worker written against vLLM's async engine (`AsyncLLM`, as verl's and Trinity's are) that
runs on rollwise by its import alone: episodes as concurrent coroutines, each turn a token-in request
whose final output a trainer reads (tokens and per-token logprobs, as vLLM gives them), a LoRA adapter
by LoRARequest, one reply streamed by deltas, and a drain around a weight update.

    python examples/vllm_async.py MODEL_DIR [PEFT_ADAPTER_DIR]
"""
from __future__ import annotations

import asyncio
import sys

try:
    from vllm import SamplingParams, TokensPrompt
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM
except ImportError:  # the same script on rollwise
    from rollwise import AsyncEngineArgs, AsyncLLM, LoRARequest, RequestOutputKind, SamplingParams, TokensPrompt


async def episode(engine, tokenizer, i: int, lora) -> tuple[int, float]:
    """Two turns: the model's reply, then a tool's output appended to the same token sequence."""
    ids, total = tokenizer.encode(f"Task {i}: list the files."), 0.0
    for turn in range(2):
        params = SamplingParams(temperature=1.0, max_tokens=12, seed=i, logprobs=0,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        async for out in engine.generate(TokensPrompt(prompt_token_ids=ids), params, f"ep{i}-turn{turn}",
                                         lora_request=lora if i % 2 else None):
            final = out
        c = final.outputs[0]
        total += sum(lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs))  # what a trainer keeps
        ids = ids + list(c.token_ids) + tokenizer.encode(" tool: a.py b.py")
    return len(ids), total


async def main(model: str, adapter: str | None = None) -> None:
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model, enable_prefix_caching=True, enforce_eager=True,
                                                       enable_lora=adapter is not None, max_model_len=512))
    tokenizer = engine.get_tokenizer()
    lora = LoRARequest("adapter", 1, adapter) if adapter else None
    for n, logp in await asyncio.gather(*(episode(engine, tokenizer, i, lora) for i in range(4))):
        print(f"episode: {n} tokens, logprob {logp:.2f}")
    pieces = []
    streamed = SamplingParams(temperature=0, max_tokens=8, output_kind=RequestOutputKind.DELTA)
    async for out in engine.generate("Stream this:", streamed, "stream-1"):
        pieces.append(out.outputs[0].text)
    print(f"streamed {len(pieces)} pieces: {''.join(pieces)!r}")
    await engine.pause_generation(mode="wait")  # a trainer would send new weights now
    await engine.resume_generation()
    engine.shutdown()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:3]))
