"""When the native attention splits a call across threads, side by side in one run: from the
machine's own threshold (`attention.parallel_pairs()`, derived from the measured linear policy)
against the fixed 65,536 (key, query head) pairs it had before 2026-12-05.

    python benchmarks/attention_threads.py [--smoke] [--json PATH]

Decode tokens/s, greedy, on the engine benchmark's model (llama, 8 layers, hidden 512, 8 query and
4 kv heads of 64), at batch 1 / 4 / 16 / 32 / 64 with prompts of 32 tokens and batch 1 / 4 / 16
with 512 (past that both split); the two take turns within every repetition on the same engine
(median of 5 after a warm-up round) and must give the same tokens (the kernel's bits do not depend
on its threads). Where both sides run the same path (batch 1 and 4 at 32 tokens: under either
threshold; batch 16 at 512: over both) the ratio is the machine's noise.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rollwise.omp import passive_unless_chosen
passive_unless_chosen()  # before torch loads

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import decode_prompts, engine_model, paired, write_json  # noqa: E402

from rollwise import LLM, SamplingParams  # noqa: E402
from rollwise.engine import attention  # noqa: E402

OLD = 65536  # the fixed threshold before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    model = engine_model("smoke" if args.smoke else "bench")
    new, reps = (4, 1) if args.smoke else (48, 5)
    cases = [(16, 1), (16, 4)] if args.smoke else [(32, b) for b in (1, 4, 16, 32, 64)] + [(512, b) for b in (1, 4, 16)]
    measured = attention.parallel_pairs
    sides = {"machine": measured, "fixed_65536": lambda: OLD}
    llm = LLM(model, max_num_seqs=64, enable_prefix_caching=False, native_attention=True)
    out: dict = {"model": model, "parallel_pairs": measured(), "old": OLD, "new_tokens": new, "runs": []}
    print(f"threshold on this machine: {measured()} pairs (before: {OLD})")
    print("| batch | prompt | decode tokens | machine tok/s | fixed 65,536 tok/s | ratio | same tokens |\n"
          "| --- | --- | --- | --- | --- | --- | --- |")
    for ctx, b in cases:
        prompts = decode_prompts(b, ctx)
        sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)

        def run(fn):
            attention.parallel_pairs = fn
            return [o.token_ids for o in llm.generate(prompts, sp)]
        r = paired({k: (lambda fn=fn: run(fn)) for k, fn in sides.items()}, reps, warmup=True)
        attention.parallel_pairs = measured
        tps = {k: b * new / dt for k, (_, dt) in r.items()}
        same = r["machine"][0] == r["fixed_65536"][0]
        row = {"batch": b, "prompt": ctx, "decode_tokens": b * new, "tok_s": tps,
               "ratio": tps["machine"] / tps["fixed_65536"], "same_tokens": same}
        out["runs"].append(row)
        print(f"| {b} | {ctx} | {b * new} | {tps['machine']:.0f} | {tps['fixed_65536']:.0f} | "
              f"{row['ratio']:.2f}x | {same} |", flush=True)
    write_json(args.json, out)


if __name__ == "__main__":
    main()
