"""What structured outputs cost the engine: decode held to a JSON schema against plain decode, the
same engine, the same prompts and the same number of tokens, taking turns (benchmarks/engine.py's
`paired`, median of 3).

    python benchmarks/structured.py [--smoke] [--json PATH]

Every request samples 64 tokens at temperature 1 (seeded). The schema's one field is a string of
up to 1,000 characters, so a constrained request runs to max_tokens as the plain one does
(`ignore_eos`), with a mask computed at every step; each step of a batch computes one mask per
request. Speculation is off for both sides (a constrained request is never drafted for).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rollwise.omp import passive_unless_chosen
passive_unless_chosen()  # before torch loads

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine as bench  # noqa: E402  (benchmarks/engine.py: prompts, paired timing)
from common import engine_model, write_json  # noqa: E402

from rollwise import LLM, SamplingParams  # noqa: E402

SCHEMA = {"type": "object", "properties": {"note": {"type": "string", "maxLength": 1000}}, "required": ["note"],
          "additionalProperties": False}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    model = engine_model("smoke" if args.smoke else "bench")
    batches, new = ([1, 4], 16) if args.smoke else ([1, 16, 64], 64)
    bench.REPS = 1 if args.smoke else 3
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    llm = LLM(model, max_num_seqs=max(batches), enable_prefix_caching=False)
    sides = {"plain": {}, "json_schema": {"structured_outputs": {"json": SCHEMA}}}

    def params(side: str, b: int) -> list[SamplingParams]:
        return [SamplingParams(temperature=1.0, seed=i, max_tokens=new, ignore_eos=True, **sides[side])
                for i in range(b)]
    llm.generate(bench.rand_prompts(2, 32, vocab, 99), params("json_schema", 2))  # warm up (the grammar engine too)
    out: dict = {"model": model, "new_tokens": new, "batches": {}}
    print("| batch | plain tok/s | JSON schema tok/s | schema / plain | tokens each side |")
    print("| --- | --- | --- | --- | --- |")
    for b in batches:
        prompts = bench.rand_prompts(b, 32, vocab, b)
        r = bench.paired({side: (lambda side=side: llm.generate(prompts, params(side, b))) for side in sides})
        row = {}
        for side, (outs, dt) in r.items():
            n = sum(len(o.token_ids) for o in outs)
            row[side] = {"seconds": dt, "tokens": n, "tokens_per_s": n / dt}
        if not all(o.text.startswith('{"note":"') for o in r["json_schema"][0]):
            raise SystemExit("a constrained output does not follow the schema")
        row["ratio"] = row["json_schema"]["tokens_per_s"] / row["plain"]["tokens_per_s"]
        out["batches"][b] = row
        print(f"| {b} | {row['plain']['tokens_per_s']:.1f} | {row['json_schema']['tokens_per_s']:.1f} | "
              f"{row['ratio']:.2f}x | {row['plain']['tokens']} / {row['json_schema']['tokens']} |")
    write_json(args.json, out)


if __name__ == "__main__":
    main()
