"""What SHA-256 prefix-cache keys cost (vLLM's --prefix-caching-hash-algo) against Python's hash.

Two measurements, both algorithms in the same run, alternating:
1. The hash functions alone on token ids (rollwise/engine/block_manager.py): microseconds per 1,000
   tokens, hashed in one call as a prompt's blocks are.
2. The engine on a prefill-heavy load: G groups of S requests sharing a long prompt prefix, each with
   its own tail, few output tokens; every request is hashed block by block as it is admitted and as
   it grows. The same requests under both algorithms: the same tokens and cached-token counts, the
   wall time of the step loop compared.

    python benchmarks/prefix_hash.py [--smoke] --json results/prefix_hash.json
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

from rollwise.omp import passive_unless_chosen
passive_unless_chosen()  # before torch loads

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import engine_model, write_json  # noqa: E402

from rollwise import LLM, SamplingParams  # noqa: E402
from rollwise.engine.block_manager import CHAINS, HASH_ALGOS  # noqa: E402


def hash_speed(tokens: int, reps: int) -> dict[str, float]:
    """Median microseconds per 1,000 tokens of each chain function on `tokens` random ids."""
    ids = [random.Random(0).randrange(150_000) for _ in range(tokens)]
    times: dict[str, list[float]] = {a: [] for a in HASH_ALGOS}
    for _ in range(reps):
        for algo in HASH_ALGOS:
            t = time.perf_counter()
            CHAINS[algo](ids, 16)
            times[algo].append((time.perf_counter() - t) * 1e6 * 1000 / tokens)
    return {a: statistics.median(v) for a, v in times.items()}


def engine_run(llm: LLM, args, seed: int) -> dict:
    rng = random.Random(seed)
    vocab = llm.engine.vocab_size
    prompts = []
    for _ in range(args.groups):
        head = [rng.randrange(10, vocab) for _ in range(args.shared)]
        prompts += [head + [rng.randrange(10, vocab) for _ in range(args.tail)] for _ in range(args.per_group)]
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    llm.reset_prefix_cache()
    before = llm.metrics()
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t
    after = llm.metrics()
    return {"wall_s": wall, "tokens": [o.token_ids for o in outs], "cached": [o.num_cached_tokens for o in outs],
            "prefill_tokens": after["prefill_tokens"] - before["prefill_tokens"],
            "prompt_tokens": sum(map(len, prompts)), "generated_tokens": sum(len(o.token_ids) for o in outs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a model directory (default: the engine benchmarks' bench model)")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--per-group", type=int, default=8)
    ap.add_argument("--shared", type=int, default=1024, help="prefix tokens a group's requests share")
    ap.add_argument("--tail", type=int, default=128, help="tokens of each request's own")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="the smoke model and a small load (for the tests)")
    args = ap.parse_args()
    if args.smoke:
        args.groups, args.per_group, args.shared, args.tail, args.repeats = 2, 3, 64, 16, 1
    speed = hash_speed(4096, 50 if args.smoke else 400)
    print("hash functions alone: " + ", ".join(f"{a} {us:.1f} us per 1k tokens" for a, us in speed.items())
          + f" (sha256 / builtin {speed['sha256'] / speed['builtin']:.2f}x)")
    model = engine_model("smoke" if args.smoke else "bench", args.model)
    llms = {a: LLM(model, max_num_seqs=64, max_num_batched_tokens=2048, prefix_caching_hash_algo=a) for a in HASH_ALGOS}
    runs: dict[str, list[dict]] = {a: [] for a in HASH_ALGOS}
    for rep in range(args.repeats + 1):  # the first round warms both engines up and is not counted
        for algo in (HASH_ALGOS if rep % 2 else HASH_ALGOS[::-1]):
            r = engine_run(llms[algo], args, seed=rep)
            if rep:
                runs[algo].append(r)
    a, b = runs["sha256"], runs["builtin"]
    same = all(x["tokens"] == y["tokens"] and x["cached"] == y["cached"] for x, y in zip(a, b))
    out = {"config": vars(args), "hash_us_per_1k_tokens": speed, "same_tokens_and_hits": same, "engine": {}}
    for algo, rs in runs.items():
        out["engine"][algo] = {"wall_s_median": statistics.median(r["wall_s"] for r in rs),
                               "wall_s": [r["wall_s"] for r in rs], "prompt_tokens": rs[0]["prompt_tokens"],
                               "prefill_tokens": rs[0]["prefill_tokens"], "cached_tokens": sum(rs[0]["cached"]),
                               "generated_tokens": rs[0]["generated_tokens"]}
    e = out["engine"]
    out["wall_ratio_sha256_over_builtin"] = e["sha256"]["wall_s_median"] / e["builtin"]["wall_s_median"]
    for algo, o in e.items():
        print(f"{algo:8s} engine {o['wall_s_median']:.3f} s (median of {args.repeats}): {o['prompt_tokens']} prompt "
              f"tokens ({o['cached_tokens']} cached, {o['prefill_tokens']:.0f} computed), "
              f"{o['generated_tokens']} generated")
    print(f"engine wall sha256 / builtin {out['wall_ratio_sha256_over_builtin']:.3f}; same tokens and hits: {same}")
    write_json(args.json, out)


if __name__ == "__main__":
    main()
