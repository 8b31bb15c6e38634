"""What the `math` reward's worker pool buys: a step's answers scored by math-verify in the event
loop's own thread (the baseline: the only place its SIGALRM timeouts work without a pool, and where
every comparison holds up every episode) against `MathVerifier` (spawned worker processes, a
deadline each). Some answers are adversarial (`\\boxed{9^{9^{9^{9}}}}`: math-verify runs until its
timeout, 5 s); the rest are a model's answers to fraction, decimal, interval and radical questions,
half of them right. Reported: the time to score them all, and how long a normal answer waits for
its reward (median and worst), both ways, on the same answers.

    python benchmarks/math_reward.py [--answers 200] [--adversarial 0,0.02,0.1] [--workers N] [--smoke]
        [--json PATH]
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from fractions import Fraction

from rollwise.agent.math_reward import MathVerifier, equivalent
from common import write_json  # (benchmarks/common.py)

ADVERSARIAL = "Multiplying it all out, the count is $\\boxed{9^{9^{9^{9}}}}$."


def answers(n: int, adversarial: float, seed: int = 0) -> list[tuple[str, str, bool, bool]]:
    """(want, answer, adversarial, right): half of the normal answers right, in another form."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if rng.random() < adversarial:
            out.append(("12", ADVERSARIAL, True, False))
            continue
        a, b = rng.randint(1, 9), rng.randint(2, 12)
        right = rng.random() < 0.5
        x = Fraction(a, b) if right else Fraction(a + 1, b)
        kind = i % 4
        if kind == 0:
            want, ans = f"\\frac{{{a}}}{{{b}}}", f"{float(x):.6g}"
        elif kind == 1:
            want, ans = f"{a / b:.6g}", f"\\frac{{{x.numerator}}}{{{x.denominator}}}"
        elif kind == 2:
            want, ans = f"({a}, {a + b}]", f"({a if right else a + 1},{a + b}]"
        else:
            want, ans = f"{a}\\sqrt{{2}}", f"\\sqrt{{{2 * a * a if right else 2 * a * a + 1}}}"
        out.append((want, f"Working it through, the answer is $\\boxed{{{ans}}}$.", False, right))
    return out


async def score_all(items, score) -> tuple[float, list[float], list[float]]:
    """Every answer scored by `score(want, answer)` at once, as a step's episodes finish: the
    seconds for all, each answer's wait for its reward, and the scores."""
    t0 = time.perf_counter()
    waits, scores = [None] * len(items), [None] * len(items)

    async def one(i, want, answer):
        scores[i] = await score(want, answer)
        waits[i] = time.perf_counter() - t0
    await asyncio.gather(*(one(i, w, a) for i, (w, a, *_) in enumerate(items)))
    return time.perf_counter() - t0, waits, scores


def inline(timeout_s: int):
    """The baseline: each comparison in the loop's thread, holding up every other episode."""
    async def score(want, answer):
        await asyncio.sleep(0)
        return float(equivalent(want, answer, timeout_s))
    return score


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--answers", type=int, default=200)
    ap.add_argument("--adversarial", default="0,0.02,0.1", help="fractions of adversarial answers")
    ap.add_argument("--workers", type=int, default=None, help="pool size (default: MathVerifier's, 8 up to 16 cores)")
    ap.add_argument("--timeout-s", type=int, default=5, help="math-verify's timeout (the reward's math_timeout_s)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="a few answers, once")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.smoke:
        args.answers, args.adversarial, args.repeats, args.timeout_s = 12, "0,0.2", 1, 1
    fractions = [float(x) for x in args.adversarial.split(",")]
    verifier = MathVerifier(timeout_s=args.timeout_s, workers=args.workers)
    asyncio.run(verifier.score("1", "\\boxed{1}"))  # the workers start (not timed)
    result = {"answers": args.answers, "workers": verifier.workers, "timeout_s": args.timeout_s, "levels": {}}
    print(f"{args.answers} answers, math-verify timeout {args.timeout_s} s, pool of {verifier.workers} workers")
    print("| adversarial | inline s | pool s | speedup | a normal answer's wait, median / worst: inline -> pool |")
    print("|---|---|---|---|---|")
    for frac in fractions:
        items = answers(args.answers, frac)
        runs = {"inline": [], "pool": []}
        for _ in range(args.repeats):
            for side in ("inline", "pool"):  # sides take turns
                score = inline(args.timeout_s) if side == "inline" else verifier.score
                runs[side].append(asyncio.run(score_all(items, score)))
        (ti, wi, si), (tp, wp, sp) = (min(runs[s], key=lambda r: r[0]) for s in ("inline", "pool"))
        if si != sp:
            raise SystemExit(f"the two ways scored differently at {frac}: {si} vs {sp}")
        normal = [i for i, it in enumerate(items) if not it[2]]
        row = {"adversarial": sum(it[2] for it in items), "scored_right": sum(sp),
               "as_intended": sum(sp[i] == float(items[i][3]) for i in range(len(items))), "inline_s": ti, "pool_s": tp,
               "speedup": ti / tp, "inline_runs_s": [r[0] for r in runs["inline"]],
               "pool_runs_s": [r[0] for r in runs["pool"]],
               "normal_wait_s": {side: {"median": statistics.median(w[i] for i in normal),
                                        "worst": max(w[i] for i in normal)}
                                 for side, w in (("inline", wi), ("pool", wp))},
               "pool_deadline_cuts": verifier.timeouts}
        result["levels"][str(frac)] = row
        w = row["normal_wait_s"]
        print(f"| {row['adversarial']} / {args.answers} | {ti:.2f} | {tp:.2f} | {ti / tp:.2f}x | "
              f"{w['inline']['median']:.2f} / {w['inline']['worst']:.2f} s -> "
              f"{w['pool']['median']:.2f} / {w['pool']['worst']:.2f} s |", flush=True)
    verifier.close()
    write_json(args.json, result)


if __name__ == "__main__":
    main()
