"""Speculation in the engine on real agent text: trace replay of the public tau-bench trajectories
on a model from make-model, speculation off vs the controller, at several concurrencies, in one run.

    python benchmarks/spec_engine.py [--quick | --smoke] [--json PATH] [--controllers adaptive,threshold]
    python benchmarks/spec_engine.py --quick --alphas 1,2   # draft length (x match length), same run
    python benchmarks/spec_engine.py --quick --methods suffix,ngram --lookup 2:5   # vLLM's prompt lookup beside

Trace replay ("teacher forcing"): the model computes every forward for real, but the engine emits
the recorded assistant tokens, so acceptance is that of real agent text and verification costs what
it really costs. Every configuration replays the same requests (so the work is identical: same
prompt tokens, same generated tokens), with `concurrency` requests in flight (closed loop).
"""
from __future__ import annotations

import argparse
import sys
import time

from rollwise.omp import passive_unless_chosen
passive_unless_chosen()  # before torch loads

from rollwise.config import EngineConfig  # noqa: E402
from rollwise.engine.llm_engine import LLMEngine  # noqa: E402
from rollwise.spec.bench import load_groups  # noqa: E402
from rollwise.types import SamplingParams  # noqa: E402

from common import engine_model, write_json  # noqa: E402  (benchmarks/common.py)



def requests_from_trajectories(model: str, n_traj: int, prompt_len: int, max_new: int) -> list[dict]:
    """Assistant turns in trajectory order; the trials of a task share a group (GRPO siblings)."""
    groups = load_groups(None, model, group_size=4, limit=n_traj)
    reqs = []
    for g, sibs in enumerate(groups):
        for turn in range(max(len(t) for t in sibs)):
            for s, traj in enumerate(sibs):  # siblings' turns interleave, as concurrent rollouts do
                if turn < len(traj):
                    prompt, resp = traj[turn]
                    reqs.append({"prompt": prompt[-prompt_len:], "forced": resp[:max_new], "group": f"task{g}"})
    return reqs


def run(model: str, reqs: list[dict], concurrency: int, controller: str | None, alpha: float | None = None,
        method: str = "suffix", lookup: tuple[int, int] | None = None) -> dict:
    spec = {} if controller is None else {"speculative": method, "spec_controller": controller, "spec_alpha": alpha}
    if controller is not None and method == "ngram" and lookup:
        spec |= {"spec_lookup_min": lookup[0], "spec_lookup_max": lookup[1]}
    eng = LLMEngine(EngineConfig(model=model, max_num_seqs=max(concurrency, 1), **spec))
    params = SamplingParams(temperature=0)
    todo = list(reqs)
    t0 = time.perf_counter()
    while todo or eng.has_unfinished:
        while todo and len(eng.seqs) < concurrency:
            r = todo.pop(0)
            eng.add_request(r["prompt"], params, group_id=r["group"], forced_output=r["forced"])
        eng.step()
    dt = time.perf_counter() - t0
    m = eng.metrics()
    gen = m["generated_tokens"]
    return {"seconds": dt, "tok_s": gen / dt, "generated_tokens": gen, "prefill_tokens": m["prefill_tokens"],
            "decode_tokens_computed": m["decode_tokens"], "steps": m["num_steps"],
            "mean_accepted": m.get("spec_accepted_tokens", 0.0) / max(m.get("spec_verifications", 0.0), 1.0),
            "drafted": m.get("spec_drafted_tokens", 0.0), "accepted": m.get("spec_accepted_tokens", 0.0),
            "spec_step_fraction": m.get("spec_steps", 0.0) / max(m["num_steps"], 1),
            "accepted_by_source": {s: m.get(f"spec_accepted_{s}", 0.0)
                                   for s in ("request", "group", "global", "ngram")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: build one with make-model)")
    ap.add_argument("--quick", action="store_true", help="finishes in under 5 minutes")
    ap.add_argument("--smoke", action="store_true", help="tiny model and workload (CI)")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--controllers", default="adaptive", help="comma-separated: adaptive, threshold, always")
    ap.add_argument("--alphas", help="comma-separated draft lengths (spec_alpha) to run each controller with "
                                     "(default: the controller's own)")
    ap.add_argument("--methods", default="suffix",
                    help="comma-separated drafters: suffix, ngram (vLLM's prompt lookup)")
    ap.add_argument("--lookup", default=None, help="ngram's n-gram lengths min:max (default: vLLM's, 5:5)")
    ap.add_argument("--prompt-len", type=int, default=None, help="keep each prompt's last N tokens (default 256)")
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args()
    size = "smoke" if args.smoke else "bench"
    model = engine_model(size, args.model)
    conc = [1, 2] if args.smoke else [int(c) for c in args.concurrency.split(",")]
    n_traj = 4 if args.smoke else 24 if args.quick else 48
    prompt_len, max_new = (32, 16) if args.smoke else (args.prompt_len or 256, 96)
    reqs = requests_from_trajectories(model, n_traj, prompt_len, max_new)
    alphas = [float(a) for a in args.alphas.split(",")] if args.alphas else [None]
    lookup = tuple(int(x) for x in args.lookup.split(":")) if args.lookup else None
    # (column, controller, alpha, method): suffix's columns are named by controller (and alpha) alone
    ctrls = [((c if a is None else f"{c} a={a:g}") if m == "suffix" else f"{m} {c}", c, a, m)
             for m in args.methods.split(",") if m for c in args.controllers.split(",") if c
             for a in (alphas if m == "suffix" else [None])]
    out: dict = {"model": model, "methods": args.methods, "lookup": args.lookup, "prompt_len": prompt_len,
                 "concurrency": {}}
    # warm-up: kernels are built per batch shape on first use; build them before any timing
    warm = reqs[: 8 if args.smoke else 64]
    for ctrl in (None, "always"):
        run(model, warm, max(conc), ctrl)
    print(f"{len(reqs)} assistant turns from {n_traj} trajectories, {sum(len(r['forced']) for r in reqs)} tokens "
          f"to generate, prompts cut to their last {prompt_len} tokens")
    print(f"{'conc':>5}{'requests':>10}{'off tok/s':>11}" + "".join(
        f"{c + ' tok/s':>22}{'ratio':>7}{'acc/verif':>10}{'spec steps':>11}" for c, *_ in ctrls))
    for c in conc:
        sub = reqs[: max(16 if args.quick or args.smoke else 40, 4 * c) if not args.smoke else 8]
        off = run(model, sub, c, None)
        row = {"off_tok_s": off["tok_s"], "off": off}
        line = f"{c:>5}{len(sub):>10}{off['tok_s']:>11.1f}"
        for ctrl, mode, alpha, method in ctrls:
            r = run(model, sub, c, mode, alpha, method, lookup)
            assert r["generated_tokens"] == off["generated_tokens"], "configurations must do the same work"
            row[ctrl] = r
            line += (f"{r['tok_s']:>22.1f}{r['tok_s'] / off['tok_s']:>6.2f}x{r['mean_accepted']:>10.2f}"
                     f"{r['spec_step_fraction']:>11.2f}")
        first = row[ctrls[0][0]]
        row |= {"spec_tok_s": first["tok_s"], "mean_accepted": first["mean_accepted"]}
        out["concurrency"][c] = row
        print(line, flush=True)
    write_json(args.json, out)


if __name__ == "__main__":
    sys.exit(main())
