"""What stop strings cost the engine: the same greedy requests with and without stop strings that
never match (Search-R1's `</search>` and `</answer>`, a ReAct agent's `Observation:`), so both sides
generate the same tokens. Each step checks every running sequence for a stop string ending in its
newest token; the engine decodes a window of the last tokens for that, so a long turn costs no more
per token than a short one (decoding the whole output each step is quadratic in its length).

    python benchmarks/stop_strings.py [--smoke] [--tokens 1000] [--batch 16] [--model DIR] [--json PATH]

Median of `--repeats` runs, the two sides taking turns; reported: tokens/s each and their ratio,
and the tokens the checks decoded per generated token and the time that took.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from rollwise.omp import passive_unless_chosen
passive_unless_chosen()  # before torch loads

from rollwise import LLM, SamplingParams  # noqa: E402

from common import engine_model, write_json  # noqa: E402  (benchmarks/common.py)

STOPS = ["</search>", "</answer>", "Observation:"]


def run(llm: LLM, prompts: list[list[int]], tokens: int, stop: list[str]) -> tuple[float, int, int, float]:
    """Seconds, tokens generated, and the tokens the engine decoded (the stop checks') and the seconds
    that took, in one generate."""
    decode, decoded = llm.engine.tokenizer.decode, [0, 0.0]

    def counting(ids, *a, **kw):
        t0 = time.perf_counter()
        try:
            return decode(ids, *a, **kw)
        finally:
            decoded[0] += len(ids)
            decoded[1] += time.perf_counter() - t0
    llm.engine.tokenizer.decode = counting
    try:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, stop=stop))
        seconds = time.perf_counter() - t0
    finally:
        llm.engine.tokenizer.decode = decode
    assert all(o.finish_reason == "length" for o in outs), "a stop string matched: pick others"
    return seconds, sum(len(o.token_ids) for o in outs), decoded[0], decoded[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="the 2-layer model, short outputs")
    ap.add_argument("--tokens", type=int, default=1000, help="new tokens per request")
    ap.add_argument("--batch", type=int, default=16, help="requests at once")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", help="a model directory (default: the engine benchmarks' model, made once)")
    ap.add_argument("--json")
    args = ap.parse_args()
    tokens = 64 if args.smoke else args.tokens
    llm = LLM(engine_model("smoke" if args.smoke else "bench", args.model), max_num_seqs=args.batch)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 1000) for _ in range(16)] for _ in range(args.batch)]
    run(llm, prompts[:2], 8, [])  # warm-up
    runs: dict[str, list] = {"plain": [], "stop": []}
    for _ in range(args.repeats):
        for name, stop in (("plain", []), ("stop", STOPS)):
            runs[name].append(run(llm, prompts, tokens, stop))
    res = {}
    for name, rs in runs.items():
        secs = statistics.median(r[0] for r in rs)
        res[name] = {"seconds": secs, "tokens": rs[0][1], "tok_s": rs[0][1] / secs,
                     "decoded_per_token": rs[0][2] / rs[0][1], "check_s": statistics.median(r[3] for r in rs)}
    res["ratio"] = res["stop"]["tok_s"] / res["plain"]["tok_s"]
    res["settings"] = {"batch": args.batch, "tokens": tokens, "repeats": args.repeats, "stops": STOPS,
                       "model": "smoke" if args.smoke else "bench"}
    print(f"{args.batch} requests x {tokens} tokens: plain {res['plain']['tok_s']:.1f} tok/s, with stop strings "
          f"{res['stop']['tok_s']:.1f} tok/s ({res['ratio']:.3f}x); the stop checks decoded "
          f"{res['stop']['decoded_per_token']:.1f} tokens per generated token in {res['stop']['check_s']:.2f} s "
          f"({res['stop']['check_s'] / res['stop']['seconds']:.1%} of the run)")
    write_json(args.json, res)


if __name__ == "__main__":
    main()
