"""A script written against vLLM's offline API that runs on rollwise by its import alone: GRPO-style
sampling (n samples per prompt), each sample's tokens and logprobs read as vLLM gives them, a LoRA
adapter by LoRARequest, sleep / wake_up as around a weight update, a chat, a looping reply ended by
repetition_detection, lm-eval's loglikelihood scoring (prompt_logprobs, detokenize=False), a
thinking budget, and chosen tokens' logprobs (logprob_token_ids).

    python examples/vllm_offline.py MODEL_DIR [PEFT_ADAPTER_DIR]
"""
from __future__ import annotations

import gc
import sys

try:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import RepetitionDetectionParams
except ImportError:  # the same script on rollwise
    from rollwise import LLM, LoRARequest, RepetitionDetectionParams, SamplingParams


def main(model: str, adapter: str | None = None) -> None:
    llm = LLM(model=model, dtype="auto", enforce_eager=True, gpu_memory_utilization=0.5, seed=0,
              enable_lora=adapter is not None, max_model_len=512, reasoning_parser="qwen3")
    prompts = ["The capital of France is", "Two plus two is"]
    params = SamplingParams(n=4, temperature=1.0, top_p=0.95, max_tokens=16, seed=1, logprobs=0)
    for out in llm.generate(prompts, params, use_tqdm=False):
        for c in out.outputs:  # a GRPO group: the prompt's 4 samples
            sampled = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]  # what a trainer keeps
            assert abs(sum(sampled) - c.cumulative_logprob) < 1e-3
            print(f"{out.prompt!r} sample {c.index}: {len(c.token_ids)} tokens, logprob {c.cumulative_logprob:.2f}")
    greedy = SamplingParams(temperature=0, max_tokens=8)
    if adapter is not None:
        out = llm.generate(prompts[:1], greedy, lora_request=LoRARequest("adapter", 1, adapter))[0]
        print(f"with the adapter: {out.outputs[0].token_ids}")
    llm.sleep(level=1)  # the KV cache given back, e.g. while a trainer runs
    llm.wake_up()
    reply = llm.chat([{"role": "user", "content": "hi"}], greedy)[0]
    print(f"chat: {list(reply.outputs[0].token_ids)}")
    loop = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True,
                          repetition_detection=RepetitionDetectionParams(max_pattern_size=8, min_count=3))
    c = llm.generate(["hello world"], loop, use_tqdm=False)[0].outputs[0]
    print(f"looping reply: {c.finish_reason} after {len(c.token_ids)} tokens")
    # lm-eval's loglikelihood: the continuation's prompt logprobs, {token id: Logprob} per position
    text = "x naïve 世界, Ünïcödé"
    for detokenize in (False, True):
        score = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1, detokenize=detokenize)
        out = llm.generate([text], score, use_tqdm=False)[0]
        pieces = [p[t].decoded_token for t, p in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])]
        print(f"scored with detokenize={detokenize}: {len(out.prompt_logprobs)} positions, first "
              f"{out.prompt_logprobs[0]}, reply text {out.outputs[0].text!r}, "
              f"prompt pieces {pieces}")
    # a thinking budget: a think block the prompt opened is closed after that many tokens, counting its own
    tok = llm.get_tokenizer()
    think, end = tok.encode("question <think> x y", add_special_tokens=False), tok.encode("</think>")[-1]
    for budget in (6, 2):
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, thinking_token_budget=budget)
        c = llm.generate([{"prompt_token_ids": think}], params, use_tqdm=False)[0].outputs[0]
        print(f"thinking budget {budget}: '</think>' at output index {list(c.token_ids).index(end)}")
    # a judge's reading: chosen tokens' logprobs at every position, ranked in the order asked
    judge = SamplingParams(temperature=0, max_tokens=2, logprob_token_ids=[40, 41])
    c = llm.generate(["Is it right?"], judge, use_tqdm=False)[0].outputs[0]
    print(f"logprob_token_ids: {[[(k, p[k].rank) for k in (40, 41)] for p in c.logprobs]}")
    del llm  # the engine shut down here: vLLM 0.32 on the CPU aborted at interpreter exit in 3 of 4 runs otherwise
    gc.collect()


if __name__ == "__main__":
    main(*sys.argv[1:3])
