"""What each way of pausing around a weight update costs: vLLM's /pause modes (abort, wait, keep),
SGLang's retract, and no pause at all (the engine's own update: both versions side by side).

B requests are generating when the trainer's new weights arrive; B/2 more arrive while the update
is under way. Under each mode the same requests run to their full length (ignore_eos: equal work;
under abort the client resubmits each aborted request with its tokens so far, as AReaL does) on
one AsyncEngine, and the table says how long the trainer waited for its weights to land, how long
the whole load took, how many tokens were computed again, how many came from the new weights, and
how many copies of the weights the engine held at once.

    python benchmarks/pause_modes.py [--smoke] --json results/pause_modes.json
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

from rollwise.omp import passive_unless_chosen
passive_unless_chosen()  # before torch loads

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import decode_prompts, engine_model, write_json  # noqa: E402

from rollwise import AsyncEngine, SamplingParams  # noqa: E402
from rollwise.engine.models.loader import load_state_dict  # noqa: E402

MODES = ("none", "abort", "wait", "keep", "retract")


def run(model: str, mode: str, weights: dict, args) -> dict:
    eng = AsyncEngine(model, max_num_seqs=args.batch * 2)
    sp = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)  # noqa: E731
    prompts = decode_prompts(args.batch * 3 // 2, args.prompt_len)
    peak, by_version = [0.0], {0: 0, 1: 0}

    async def one(i: int) -> int:
        ids, left, done = prompts[i], args.tokens, 0
        while left:
            out = await eng.generate(ids, sp(left))
            for k, (at, v) in enumerate(out.version_segments or [(0, out.policy_version)]):
                end = out.version_segments[k + 1][0] if k + 1 < len(out.version_segments) else len(out.token_ids)
                by_version[v] += end - at
            ids, left, done = ids + list(out.token_ids), left - len(out.token_ids), done + len(out.token_ids)
        return done  # (aborted: the client sends it again with its tokens so far)

    async def watch() -> None:
        while True:
            peak[0] = max(peak[0], (await eng.call(eng.engine.metrics))["weight_versions"])
            await asyncio.sleep(0.005)

    async def go() -> dict:
        watcher = asyncio.ensure_future(watch())
        t0 = time.perf_counter()
        first = [asyncio.ensure_future(one(i)) for i in range(args.batch)]
        while (await eng.call(eng.engine.metrics))["generated_tokens"] < args.batch * args.tokens * args.update_at:
            await asyncio.sleep(0.002)
        t_update = time.perf_counter()
        pausing = asyncio.ensure_future(
            eng.pause(abort=mode == "abort", wait=mode == "wait", retract=mode == "retract")
            if mode != "none" else asyncio.sleep(0))
        await asyncio.sleep(0)
        late = [asyncio.ensure_future(one(args.batch + i)) for i in range(args.batch // 2)]
        await pausing
        await eng.update_weights(weights)
        if mode != "none":
            await eng.resume()
        landed = time.perf_counter() - t_update
        done = await asyncio.gather(*first, *late)
        makespan = time.perf_counter() - t0
        watcher.cancel()
        return {"update_wait_s": landed, "makespan_s": makespan, "tokens": sum(done)}
    try:
        out = asyncio.run(go())
        m = eng.metrics()
    finally:
        eng.shutdown()
    return {**out, "prefill_tokens": int(m["prefill_tokens"]), "new_weights_tokens": by_version[1],
            "old_weights_tokens": by_version[0], "peak_weight_copies": int(peak[0])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a model directory (default: the engine benchmarks' bench model)")
    ap.add_argument("--batch", type=int, default=16, help="requests generating when the update comes")
    ap.add_argument("--tokens", type=int, default=128, help="tokens each request generates")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--update-at", type=float, default=0.25, help="the update comes after this share of the first "
                                                                  "requests' tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="the smoke model and a small load (for the tests)")
    args = ap.parse_args()
    if args.smoke:
        args.batch, args.tokens, args.prompt_len, args.repeats = 4, 16, 32, 1
    model = engine_model("smoke" if args.smoke else "bench", args.model)
    weights = load_state_dict(model)  # (in memory, as a trainer hands them over)
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for rep in range(args.repeats):  # taking turns: this machine's speed drifts
        for mode in MODES:
            runs[mode].append(run(model, mode, weights, args))
            print(f"  repeat {rep + 1}/{args.repeats} {mode}: {runs[mode][-1]['makespan_s']:.2f} s", file=sys.stderr,
                  flush=True)
    out: dict = {"config": vars(args), "runs": runs, "modes": {}}
    print(f"{args.batch} requests generating {args.tokens} tokens each (prompts of {args.prompt_len}) when the weights "
          f"come, {args.batch // 2} more during the update; medians of {args.repeats}")
    print(f"{'mode':<8}{'update wait s':>14}{'makespan s':>12}{'tokens':>8}{'prefill tok':>12}{'new-weights tok':>16}"
          f"{'weight copies':>14}")
    for mode, rs in runs.items():
        med = lambda k: statistics.median(r[k] for r in rs)  # noqa: E731
        o = out["modes"][mode] = {k: med(k) for k in rs[0]}
        print(f"{mode:<8}{o['update_wait_s']:>14.3f}{o['makespan_s']:>12.2f}{o['tokens']:>8.0f}"
              f"{o['prefill_tokens']:>12.0f}{o['new_weights_tokens']:>16.0f}{o['peak_weight_copies']:>14.0f}")
    base = out["modes"]["none"]["makespan_s"]
    out["makespan_vs_none"] = {m: o["makespan_s"] / base for m, o in out["modes"].items()}
    print("makespan / no pause: " + ", ".join(f"{m} {r:.2f}x" for m, r in out["makespan_vs_none"].items()))
    write_json(args.json, out)


if __name__ == "__main__":
    main()
