"""Priority scheduling (vLLM's --scheduling-policy priority) against FCFS on the same load.

A replica is busy with a backlog of long requests (more than max_num_seqs, and a KV pool that makes
it preempt) when a few short urgent ones arrive. Under FCFS they queue behind the backlog; under
the priority policy (urgent ones at priority -1) they are admitted first and never preempted. Both
policies run the same requests on the same engine model, in the same process, alternating, and
every request generates its max_tokens (ignore_eos), so the work is equal; the figures are wall
times of the engine's step loop.

    python benchmarks/priority.py [--smoke] --json results/priority.json
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

from rollwise.config import EngineConfig  # noqa: E402
from rollwise.engine.llm_engine import LLMEngine  # noqa: E402
from rollwise.types import SamplingParams  # noqa: E402


def run(model: str, policy: str, args, seed: int) -> dict:
    eng = LLMEngine(EngineConfig(model=model, max_num_seqs=args.max_num_seqs, num_kv_blocks=args.kv_blocks,
                                 scheduling_policy=policy))
    rng = random.Random(seed)
    prompt = lambda n: [rng.randrange(10, eng.vocab_size) for _ in range(n)]  # noqa: E731
    long = SamplingParams(temperature=0, max_tokens=args.backlog_tokens, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=args.urgent_tokens, ignore_eos=True)
    added, done, urgent, at = {}, {}, set(), {}  # at: request -> (step added, step finished)
    t0 = time.perf_counter()
    for _ in range(args.backlog):
        rid = eng.add_request(prompt(args.prompt_len), long)
        added[rid], at[rid] = t0, [0, 0]
    steps = 0
    while eng.has_unfinished:
        if steps == args.urgent_after:
            for _ in range(args.urgent):
                rid = eng.add_request(prompt(args.prompt_len), short, priority=-1 if policy == "priority" else 0)
                added[rid], at[rid] = time.perf_counter(), [steps, 0]
                urgent.add(rid)
        for out in eng.step():
            if out.finished:
                done[out.request_id], at[out.request_id][1] = time.perf_counter(), steps + 1
        steps += 1
    end = time.perf_counter()
    lat = {r: done[r] - added[r] for r in added}
    m = eng.metrics()
    return {"urgent_latency_s": [lat[r] for r in sorted(urgent)],
            "urgent_latency_steps": [at[r][1] - at[r][0] for r in sorted(urgent)],
            "backlog_latency_s": [lat[r] for r in added if r not in urgent],
            "makespan_s": end - t0, "steps": steps, "generated_tokens": m["generated_tokens"],
            "prefill_tokens": m["prefill_tokens"], "preemptions": m["num_preemptions"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a model directory (default: the engine benchmarks' bench model)")
    ap.add_argument("--backlog", type=int, default=32)
    ap.add_argument("--backlog-tokens", type=int, default=96)
    ap.add_argument("--urgent", type=int, default=4)
    ap.add_argument("--urgent-tokens", type=int, default=16)
    ap.add_argument("--urgent-after", type=int, default=20, help="engine steps before the urgent requests come")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--kv-blocks", type=int, default=56, help="KV blocks of 16 tokens (small: preemption)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="the smoke model and a small load (for the tests)")
    args = ap.parse_args()
    if args.smoke:
        args.backlog, args.backlog_tokens, args.urgent_after, args.kv_blocks, args.repeats = 12, 24, 4, 24, 1
    model = engine_model("smoke" if args.smoke else "bench", args.model)
    runs: dict[str, list[dict]] = {"fcfs": [], "priority": []}
    for rep in range(args.repeats):  # alternating, same requests (same seed) for both
        for policy in ("fcfs", "priority"):
            runs[policy].append(run(model, policy, args, seed=rep))
    out = {"config": vars(args), "runs": runs}
    for policy, rs in runs.items():
        urgent = [x for r in rs for x in r["urgent_latency_s"]]
        backlog = [x for r in rs for x in r["backlog_latency_s"]]
        out[policy] = {"urgent_mean_s": statistics.mean(urgent), "urgent_max_s": max(urgent),
                       "urgent_mean_steps": statistics.mean(x for r in rs for x in r["urgent_latency_steps"]),
                       "backlog_mean_s": statistics.mean(backlog),
                       "makespan_s": statistics.mean(r["makespan_s"] for r in rs),
                       "generated_tokens": rs[0]["generated_tokens"],
                       "preemptions": statistics.mean(r["preemptions"] for r in rs)}
        o = out[policy]
        print(f"{policy:8s} urgent mean {o['urgent_mean_s']:.2f} s / {o['urgent_mean_steps']:.1f} steps "
              f"(max {o['urgent_max_s']:.2f} s), backlog mean "
              f"{o['backlog_mean_s']:.2f} s, makespan {o['makespan_s']:.2f} s, {o['generated_tokens']:.0f} tokens, "
              f"{o['preemptions']:.0f} preemptions")
    f, p = out["fcfs"], out["priority"]
    out["urgent_speedup"] = f["urgent_mean_s"] / p["urgent_mean_s"]
    out["makespan_ratio"] = p["makespan_s"] / f["makespan_s"]
    print(f"urgent requests {out['urgent_speedup']:.2f}x sooner under priority; makespan priority / fcfs "
          f"{out['makespan_ratio']:.3f}")
    write_json(args.json, out)


if __name__ == "__main__":
    main()
