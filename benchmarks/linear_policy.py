"""Which kernel takes a linear's rows, side by side in one run: the policy measured on this machine
against the two fixed ones (rollwise/engine/models/linear.py).

    python benchmarks/linear_policy.py [--smoke] [--json PATH]

"mkl": MKL below 4 rows, every product on all threads (the engine's policy before 2026-12-03);
"onednn": oneDNN from 2 rows, and for one row from 2^18 weight entries, products under 16 MFLOP on
one thread (2026-12-03 to 2026-12-05, fixed from one machine's timings); "measured": timed on this
machine once and cached (the default since 2026-12-05). Decode tokens/s, greedy, 48 new tokens a
request, at batch 1, 2, 3, 8 and 32, on the engine benchmark's model (llama, 8 layers, hidden 512)
and the RL demo's (qwen3, 2 layers, hidden 128); the policies take turns within every repetition
(median of 3), on the same engine, and give the same tokens or nearly (their kernels round apart).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from rollwise.omp import passive_unless_chosen
passive_unless_chosen()  # before torch loads

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import engine_model, write_json  # noqa: E402

from rollwise import LLM, SamplingParams  # noqa: E402
from rollwise.engine.models import linear  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    from rollwise.cli import demo_model
    models = [engine_model("smoke" if args.smoke else "bench"), demo_model()]
    new, reps = (8, 2) if args.smoke else (48, 4)
    policies = {**linear.FIXED, "measured": linear.policy()}
    out: dict = {"policies": policies, "models": {}}
    print(f"measured on this machine: {policies['measured']}")
    print("| model | batch | tokens | mkl tok/s | onednn tok/s | measured tok/s | measured / mkl "
          "| measured / onednn |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
    for m in models:
        llm = LLM(m, max_num_seqs=64, enable_prefix_caching=False, kv_cache_gb=0.25)
        for b in (1, 2, 3, 8, 32):
            prompts = [[7 + i, 300 + i, 42, 99] * 4 for i in range(b)]
            sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
            times: dict[str, list[float]] = {k: [] for k in policies}
            for rep in range(reps):
                for name, knobs in policies.items():
                    linear._policy = knobs
                    t0 = time.perf_counter()
                    llm.generate(prompts, sp)
                    if rep:  # the first round warms up
                        times[name].append(time.perf_counter() - t0)
            tps = {k: b * new / statistics.median(v) for k, v in times.items()}
            r = {k: tps["measured"] / tps[k] for k in linear.FIXED}
            out["models"].setdefault(m, {})[b] = {"tokens": b * new, "tok_s": tps, "measured_over": r}
            print(f"| {Path(m).name} | {b} | {b * new} | {tps['mkl']:.0f} | {tps['onednn']:.0f} | "
                  f"{tps['measured']:.0f} | {r['mkl']:.2f}x | {r['onednn']:.2f}x |", flush=True)
    linear._policy = policies["measured"]
    write_json(args.json, out)


if __name__ == "__main__":
    main()
