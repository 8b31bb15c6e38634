"""Sampling's inverse CDF, native kernel against its torch twin, and greedy's argmax, numpy's against
torch's, side by side in one run.

    python benchmarks/sampler.py [--smoke] [--json PATH]

The twin (sampler.inverse_cdf_torch) turns a batch's probabilities into a [B, V] float64 cumulative
sum and searches it; the kernel (sampling.cpp) adds in the same order without storing the sums, so
both draw the same tokens. Three tables:

- the sampler alone: one call on random logits at temperature 1 (seeded rows), batch 1 / 16 / 64 at
  vocabularies of 8,192 and 151,936 (Qwen's), median of 7;
- the engine: decode tokens/s at temperature 1 with a seed per request, batch 1 / 16 / 64, on the
  engine benchmark's model with Qwen's vocabulary (llama, 8 layers, hidden 512, vocab 151,936); the
  two take turns on one engine (median of 5 after a warm-up round) and must give the same tokens;
- the engine greedy: the same decode at temperature 0, numpy's argmax against torch's (both the
  first largest entry: the same tokens).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rollwise.omp import passive_unless_chosen
passive_unless_chosen()  # before torch loads

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import decode_sides, engine_model, paired, write_json  # noqa: E402

import torch  # noqa: E402

from rollwise import LLM, SamplingParams  # noqa: E402
from rollwise.engine import sampler  # noqa: E402

SIDES = {"native": sampler.inverse_cdf, "torch": sampler.inverse_cdf_torch}
ARGMAX = {"numpy": sampler.argmax, "torch": lambda x: x.argmax(dim=-1)}


def use(side: str) -> None:
    sampler.inverse_cdf = SIDES[side]  # what Sampler._sample calls


def alone(batches, vocabs, reps: int) -> list[dict]:
    rows = []
    for v in vocabs:
        for b in batches:
            logits = torch.randn(b, v, generator=torch.Generator().manual_seed(b))
            sr = [sampler.SampleRow(SamplingParams(temperature=1.0, seed=i), position=0) for i in range(b)]

            def call(side):  # (no row bans a token or sets a rule: the sampler leaves `logits` as it is)
                use(side)
                return sampler.Sampler(0)(logits, sr)[0]
            r = paired({side: (lambda side=side: call(side)) for side in SIDES}, reps)
            ms = {k: dt * 1e3 for k, (_, dt) in r.items()}
            rows.append({"batch": b, "vocab": v, "ms": ms, "ratio": ms["torch"] / ms["native"],
                         "same_tokens": r["native"][0] == r["torch"][0]})
            print(f"| {b} | {v} | {ms['native']:.2f} | {ms['torch']:.2f} | {rows[-1]['ratio']:.2f}x | "
                  f"{rows[-1]['same_tokens']} |", flush=True)
    return rows


def engine(llm: LLM, batches, new: int, reps: int, greedy: bool = False) -> list[dict]:
    """Decode tok/s, the two inverse CDFs (or with `greedy`, the two argmaxes) taking turns."""
    def params(b, new):
        return [SamplingParams(temperature=0.0 if greedy else 1.0, seed=100 + i, max_tokens=new, ignore_eos=True)
                for i in range(b)]

    def switch(side):
        if greedy:
            sampler.argmax = ARGMAX[side]
        else:
            use(side)
    rows = decode_sides(llm, {side: (lambda side=side: switch(side)) for side in (ARGMAX if greedy else SIDES)},
                        batches, new, reps, params)
    sampler.argmax = ARGMAX["numpy"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    model = engine_model("smoke" if args.smoke else "qwen-vocab")
    out: dict = {"model": model}
    print("sampler alone (ms a call):\n| batch | vocab | native | torch | speedup | same tokens |\n"
          "| --- | --- | --- | --- | --- | --- |")
    out["alone"] = alone((1, 4) if args.smoke else (1, 16, 64), (1024,) if args.smoke else (8192, 151936),
                         2 if args.smoke else 7)
    print("engine decode at temperature 1 (tok/s):\n| batch | decode tokens | native | torch | ratio | same tokens |\n"
          "| --- | --- | --- | --- | --- | --- |")
    llm = LLM(model, max_num_seqs=64, enable_prefix_caching=False)
    batches, new, reps = ((1, 4), 4, 1) if args.smoke else ((1, 16, 64), 32, 5)
    out["engine"] = engine(llm, batches, new, reps)
    print("engine greedy decode (tok/s):\n| batch | decode tokens | numpy argmax | torch argmax | ratio "
          "| same tokens |\n| --- | --- | --- | --- | --- | --- |")
    out["engine_greedy"] = engine(llm, batches, new, reps, greedy=True)
    use("native")
    write_json(args.json, out)


if __name__ == "__main__":
    main()
