"""What vLLM's `repetition_detection` saves an RL rollout, and what its check costs: the same seeded,
sampled requests (a GRPO batch: prompts x samples) with and without the rule. A sample caught in a
loop ends at the token that completes the pattern (finish_reason "repetition") instead of running to
max_tokens; the others are the same tokens both ways. The check runs after every token of every
request that sets the rule; its time is measured inside the run.

    python benchmarks/repetition.py [--smoke] [--prompts 8] [--samples 8] [--tokens 512]
                                    [--temperature 0.7] [--model DIR] [--json PATH]

Median of `--repeats` runs, the two sides taking turns; reported: seconds and tokens each, the
samples the rule ended, and the check's share of the run. What it saves depends on how often the
model loops: an untrained or small model loops far more than a trained one, so read the tokens
saved as this model's, and the check's cost as the figure that carries over.
"""
from __future__ import annotations

import argparse
import statistics
import time

from rollwise.omp import passive_unless_chosen
passive_unless_chosen()  # before torch loads

from rollwise import LLM, RepetitionDetectionParams, SamplingParams  # noqa: E402

from common import engine_model, rand_prompts, write_json  # noqa: E402  (benchmarks/common.py)

RULE = {"max_pattern_size": 16, "min_count": 4}  # a phrase of up to 16 tokens four times in a row


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams, samples: int) -> dict:
    """One generate of every prompt's `samples` samples: seconds, outputs, and the check's calls and seconds."""
    found, spent = RepetitionDetectionParams.found, [0, 0.0]

    def timed(self, ids, start=0):
        t0 = time.perf_counter()
        try:
            return found(self, ids, start)
        finally:
            spent[0] += 1
            spent[1] += time.perf_counter() - t0
    RepetitionDetectionParams.found = timed
    try:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, n=samples)
        seconds = time.perf_counter() - t0
    finally:
        RepetitionDetectionParams.found = found
    return {"seconds": seconds, "outs": outs, "checks": spent[0], "check_s": spent[1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="the 2-layer model, short outputs")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt (a GRPO group)")
    ap.add_argument("--tokens", type=int, default=512, help="max new tokens per sample")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", help="a model directory (default: the engine benchmarks' model, made once)")
    ap.add_argument("--json")
    args = ap.parse_args()
    tokens = 64 if args.smoke else args.tokens
    llm = LLM(engine_model("smoke" if args.smoke else "bench", args.model), max_num_seqs=args.prompts * args.samples)
    prompts = rand_prompts(args.prompts, 32, 1000, seed=0)
    plain = SamplingParams(temperature=args.temperature, max_tokens=tokens, ignore_eos=True, seed=11)
    sides = {"plain": plain, "rule": SamplingParams(temperature=args.temperature, max_tokens=tokens, ignore_eos=True,
                                                    seed=11, repetition_detection=RULE)}
    run(llm, prompts[:1], SamplingParams(max_tokens=4), 1)  # warm-up
    runs: dict[str, list] = {name: [] for name in sides}
    for _ in range(args.repeats):
        for name, params in sides.items():
            runs[name].append(run(llm, prompts, params, args.samples))
    res: dict = {}
    for name, rs in runs.items():
        outs = rs[0]["outs"]
        res[name] = {"seconds": statistics.median(r["seconds"] for r in rs),
                     "tokens": sum(len(o.token_ids) for o in outs),
                     "ended_by_rule": sum(o.finish_reason == "repetition" for o in outs),
                     "checks": rs[0]["checks"], "check_s": statistics.median(r["check_s"] for r in rs)}
    a, b = runs["plain"][0]["outs"], runs["rule"][0]["outs"]
    res["same_tokens_up_to_the_cut"] = sum(o.token_ids[:len(c.token_ids)] == c.token_ids for o, c in zip(a, b))
    res["speedup"] = res["plain"]["seconds"] / res["rule"]["seconds"]
    res["tokens_ratio"] = res["plain"]["tokens"] / res["rule"]["tokens"]
    res["check_share"] = res["rule"]["check_s"] / res["rule"]["seconds"]
    res["check_us_per_token"] = 1e6 * res["rule"]["check_s"] / max(res["rule"]["checks"], 1)
    res["settings"] = {"prompts": args.prompts, "samples": args.samples, "tokens": tokens, "rule": RULE,
                       "temperature": args.temperature, "repeats": args.repeats,
                       "model": args.model or ("smoke" if args.smoke else "bench")}
    n = args.prompts * args.samples
    print(f"{args.prompts} prompts x {args.samples} samples, up to {tokens} tokens at temperature {args.temperature}: "
          f"without the rule {res['plain']['seconds']:.2f} s, {res['plain']['tokens']} tokens; with it "
          f"{res['rule']['seconds']:.2f} s, {res['rule']['tokens']} tokens ({res['speedup']:.2f}x faster, "
          f"{res['tokens_ratio']:.2f}x fewer tokens); {res['rule']['ended_by_rule']} of {n} samples ended by "
          f"the rule; {res['same_tokens_up_to_the_cut']} of {n} the same tokens up to the cut; the check "
          f"{res['check_us_per_token']:.1f} us a token, {100 * res['check_share']:.2f}% of the run")
    write_json(args.json, res)


if __name__ == "__main__":
    main()
