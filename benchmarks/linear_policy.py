"""Which kernel takes a linear's rows, side by side in one run: the engine's policy against the one
before 2026-12-03 (oneDNN from 4 rows, MKL below, every product on all threads).

    python benchmarks/linear_policy.py [--smoke] [--json PATH]

Now: oneDNN from 2 rows, and for one row once the weight has 2^18 entries (MKL's GEMV below);
products under 16 MFLOP on one thread (rollwise/engine/models/linear.py). Decode tokens/s, greedy,
48 new tokens a request, at batch 1, 2, 3, 8 and 32, on the engine benchmark's model (llama, 8
layers, hidden 512) and the RL demo's (qwen3, 2 layers, hidden 128); the two policies take turns
within every repetition (median of 3), on the same engine.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from rollwise.omp import passive_unless_chosen
passive_unless_chosen()  # before torch loads

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import engine_model  # noqa: E402

from rollwise import LLM, SamplingParams  # noqa: E402
from rollwise.engine.models import linear  # noqa: E402

POLICIES = {"before": dict(GEMM_MIN_ROWS=4, GEMV_MAX_WEIGHTS=float("inf"), SERIAL_FLOPS=0),
            "now": {k: getattr(linear, k) for k in ("GEMM_MIN_ROWS", "GEMV_MAX_WEIGHTS", "SERIAL_FLOPS")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    from rollwise.cli import demo_model
    models = [engine_model("smoke" if args.smoke else "bench"), demo_model()]
    new, reps = (8, 2) if args.smoke else (48, 4)
    out: dict = {}
    print("| model | batch | tokens | before tok/s | now tok/s | speedup |\n| --- | --- | --- | --- | --- | --- |")
    for m in models:
        llm = LLM(m, max_num_seqs=64, enable_prefix_caching=False, kv_cache_gb=0.25)
        for b in (1, 2, 3, 8, 32):
            prompts = [[7 + i, 300 + i, 42, 99] * 4 for i in range(b)]
            sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
            times: dict[str, list[float]] = {k: [] for k in POLICIES}
            for rep in range(reps):
                for name, knobs in POLICIES.items():
                    for k, v in knobs.items():
                        setattr(linear, k, v)
                    t0 = time.perf_counter()
                    llm.generate(prompts, sp)
                    if rep:  # the first round warms up
                        times[name].append(time.perf_counter() - t0)
            tps = {k: b * new / statistics.median(v) for k, v in times.items()}
            out.setdefault(m, {})[b] = {"tokens": b * new, "tok_s": tps, "speedup": tps["now"] / tps["before"]}
            print(f"| {Path(m).name} | {b} | {b * new} | {tps['before']:.0f} | {tps['now']:.0f} | "
                  f"{tps['now'] / tps['before']:.2f}x |", flush=True)
    for k, v in POLICIES["now"].items():
        setattr(linear, k, v)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
