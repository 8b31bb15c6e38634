"""Fit the `linear` step-cost profile of our engine on this machine: run the real engine (one
thread per engine, two engines at once in two processes, as the router benchmark's replicas run)
on batches of every shape the router workloads
produce — prefill chunks, decode at batch 1..32, contexts from 128 to 6k tokens — record what each
step computed and how long `step()` took, and fit the profile's terms by non-negative least squares.

    python -m rollwise.sim.fit MODEL_DIR [--replicas 2] [--out rollwise/sim/profiles/cpu-fitted.toml]
    python benchmarks/router.py --workload swe --trace DIR ...   # steps under real serving, DIR/<policy>/
    python -m rollwise.sim.fit MODEL_DIR --trace DIR/verl --trace DIR/round_robin ...

Measured in isolation, steps come out ~20% faster than inside the router benchmark (there the
replicas share the 2 cores with the router process and parse HTTP requests between steps), so the
shipped profile is fitted on steps recorded by real replicas under the benchmark (`--trace`).
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import numpy as np

from rollwise.router.cost_model import nnls
from rollwise.sim.cost import LinearCost, StepWork, step_work

FIT_LOSSES = ("seconds", "relative")
GRID = [(b, ctx) for b in (1, 2, 4, 8, 16, 32) for ctx in (128, 512, 1536, 3072, 6144) if b * ctx <= 32 * 3072]


def measure(model_dir: str, *, new_tokens: int = 24, max_num_batched_tokens: int = 1024, threads: int = 1,
            seed: int = 0) -> list[tuple[StepWork, float]]:
    from rollwise.omp import passive_unless_chosen
    passive_unless_chosen()  # before torch loads
    import torch

    from rollwise.config import EngineConfig
    from rollwise.engine.llm_engine import LLMEngine
    from rollwise.types import SamplingParams
    torch.set_num_threads(threads)
    eng = LLMEngine(EngineConfig(model=model_dir, max_num_seqs=32, max_num_batched_tokens=max_num_batched_tokens,
                                 num_kv_blocks=16_384, max_model_len=8192, enable_prefix_caching=False))
    rng = random.Random(seed)
    sched, seen = eng.scheduler, []
    schedule = sched.schedule

    def spy():
        batch = schedule()
        seen.append(batch)
        return batch
    sched.schedule = spy
    samples = []
    for b, ctx in GRID:
        for i in range(b):
            prompt = [rng.randrange(100, eng.vocab_size) for _ in range(ctx)]
            eng.add_request(prompt, SamplingParams(max_tokens=new_tokens, ignore_eos=True),
                            forced_output=[rng.randrange(100, eng.vocab_size) for _ in range(new_tokens)])
        while eng.has_unfinished:
            t0 = time.perf_counter()
            eng.step()
            dt = time.perf_counter() - t0
            batch = seen[-1]
            if batch:
                samples.append((work_of(batch), dt))
    return samples


def work_of(batch) -> StepWork:
    return step_work([(s.num_new_tokens + (len(s.draft) if s.draft is not None else 0), s.num_computed_before,
                       (1 + (len(s.draft) if s.draft is not None else 0)) if s.samples else 0) for s in batch])


def load_trace(trace_dir: str) -> list[tuple[StepWork, float]]:
    """Steps recorded by engines run with $ROLLWISE_STEP_TRACE=DIR (e.g. the router benchmark's replicas)."""
    out = []
    for f in sorted(Path(trace_dir).glob("steps-*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                d = json.loads(line)
                out.append((step_work([tuple(e) for e in d["e"]]), float(d["s"])))
    if not out:
        raise ValueError(f"no steps-*.jsonl with steps under {trace_dir}")
    return out


def fit(samples: list[tuple[StepWork, float]], loss: str = "seconds") -> LinearCost:
    """Non-negative least squares (terms whose coefficient comes out negative are dropped and the
    rest refit). `loss="seconds"`: on each step's error in seconds, so the total stays close (a
    makespan is a sum of step times); `"relative"`: on relative error, so short decode steps weigh
    as much as long prefill steps (a better median step, but it under-predicts the long ones: on
    SWE traces its totals came out 7-25% low)."""
    if loss not in FIT_LOSSES:
        raise ValueError(f"loss must be one of {FIT_LOSSES}, got {loss!r}")
    x = np.array([[1.0, w.tokens, w.logits, w.seqs, w.kv_padded, w.attn_padded] for w, _ in samples])
    y = np.array([dt for _, dt in samples])
    wt = 1.0 / y if loss == "relative" else np.ones_like(y)
    coef = nnls(x * wt[:, None], y * wt)
    if coef is None:
        raise ValueError("no non-negative fit of the step times")
    full = {t: float(c) for t, c in zip(LinearCost.TERMS, coef)}
    return LinearCost(full, name="cpu-fitted")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--out", default=str(Path(__file__).parent / "profiles" / "cpu-fitted.toml"))
    ap.add_argument("--replicas", type=int, default=2,
                    help="engines measured at once, one process each (the router benchmark runs 2 on 2 cores)")
    ap.add_argument("--trace", action="append",
                    help="fit on steps recorded with $ROLLWISE_STEP_TRACE=DIR instead of measuring (repeatable)")
    ap.add_argument("--loss", choices=FIT_LOSSES, default="seconds")
    args = ap.parse_args(argv)
    if args.trace:
        samples = [s for d in args.trace for s in load_trace(d)]
    else:
        from concurrent.futures import ProcessPoolExecutor
        with ProcessPoolExecutor(args.replicas) as pool:
            runs = list(pool.map(measure, [args.model] * args.replicas))
        samples = [s for run in runs for s in run]
    cost = fit(samples, args.loss)
    pred = np.array([cost.step_s(w) for w, _ in samples])
    y = np.array([dt for _, dt in samples])
    err = np.abs(pred - y) / y
    print(f"{len(samples)} steps, {y.sum():.1f} s measured; median |error| {np.median(err):.1%}, "
          f"total predicted/measured {pred.sum() / y.sum():.3f}")
    where = f"steps recorded in {', '.join(args.trace)}" if args.trace else f"steps measured, {args.replicas} engines at once"
    lines = ["# Our engine on this CPU (1 thread per replica), fitted by `python -m rollwise.sim.fit`",
             f"# (--loss {args.loss}) on {len(samples)} {where} (model: {Path(args.model).name});",
             f"# median |error| per step {np.median(err):.1%}, total predicted / measured {pred.sum() / y.sum():.3f}.",
             'kind = "linear"', "block_size = 16", "", "[coef]"]
    lines += [f"{k} = {v:.6g}" for k, v in cost.coef.items()]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
