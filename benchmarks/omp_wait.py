"""OpenMP's wait policy and the engine's decode speed: alone on the cores, and beside a second busy
engine process on the same cores (rollwise/omp.py).

    python benchmarks/omp_wait.py [--smoke] [--json PATH] [--spin-count N]

For each policy (`OMP_WAIT_POLICY=PASSIVE`, what rollwise's entry points set by default, and
libgomp's bounded spin `GOMP_SPINCOUNT=N` with no policy) it runs in-process decode at batch 1, 16
and 64 (64 new tokens per request, median of 3 runs) in one engine process, then in two at once,
each a fresh process with all the cores' threads. Every run generates the same tokens.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from rollwise.omp import passive_env, spin_env
from common import write_json  # (benchmarks/common.py)

HERE = Path(__file__).resolve().parent


def worker(model: str, batches: list[int], new: int, reps: int) -> dict:
    """The engine benchmark's in-process decode (its prompts, its median of `reps` runs), under the
    wait policy this process was started with."""
    sys.path.insert(0, str(HERE))
    import engine  # benchmarks/engine.py: leaves the chosen policy alone (rollwise.omp)
    import torch

    from rollwise import LLM, SamplingParams
    engine.REPS = reps
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    llm = LLM(model, max_num_seqs=max(batches), enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    llm.generate(engine.rand_prompts(2, 32, vocab, 99), params)  # warm up
    out = {"threads": torch.get_num_threads(), "decode": {}}
    for b in batches:
        prompts = engine.rand_prompts(b, 32, vocab, b)
        outs, dt = engine.paired({"rollwise": lambda: llm.generate(prompts, params)})["rollwise"]
        n = sum(len(o.token_ids) for o in outs)
        out["decode"][str(b)] = {"tok_s": n / dt, "tokens": n, "seconds": dt}
    return out


def launch(model: str, env: dict, args) -> subprocess.Popen:
    cmd = [sys.executable, str(Path(__file__)), "--worker", "--model", model, "--batches", args.batches,
           "--new", str(args.new), "--reps", str(args.reps)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def collect(procs: list[subprocess.Popen]) -> list[dict]:
    outs = []
    for p in procs:
        stdout, stderr = p.communicate()
        if p.returncode:
            raise RuntimeError(f"worker failed ({p.returncode}): {stderr[-2000:]}")
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    return outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: the engine benchmark's)")
    ap.add_argument("--smoke", action="store_true", help="tiny model and sizes (CI)")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--spin-count", type=int, default=300_000, help="GOMP_SPINCOUNT of the spinning policy")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--batches", default="1,16,64", help=argparse.SUPPRESS)
    ap.add_argument("--new", type=int, default=64, help=argparse.SUPPRESS)
    ap.add_argument("--reps", type=int, default=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.spin_count < 1:
        ap.error("--spin-count must be >= 1")
    if args.worker:
        print(json.dumps(worker(args.model, [int(b) for b in args.batches.split(",")], args.new, args.reps)))
        return
    if args.smoke:
        args.batches, args.new, args.reps = "1,2", 4, 1
    sys.path.insert(0, str(HERE))
    from common import engine_model  # benchmarks/common.py
    model = engine_model("smoke" if args.smoke else "bench", args.model)
    policies = {"passive": "OMP_WAIT_POLICY=PASSIVE", "spin": f"GOMP_SPINCOUNT={args.spin_count}"}
    envs = {"passive": passive_env(), "spin": spin_env(args.spin_count)}
    results: dict = {"model": model, "new_tokens": args.new, "policies": policies, "runs": {}}
    for name in policies:
        for procs in (1, 2):
            print(f"{name}: {procs} process(es) ...", file=sys.stderr, flush=True)
            results["runs"][f"{name}/{procs}"] = collect([launch(model, envs[name], args) for _ in range(procs)])
    batches = args.batches.split(",")
    print(f"\ndecode tok/s per process ({args.new} new tokens per request; two processes: each, on the same cores)")
    print(f"{'policy':<28}" + "".join(f"{'b=' + b + ' alone':>14}{'b=' + b + ' two':>14}" for b in batches))
    for name, label in policies.items():
        alone, two = results["runs"][f"{name}/1"][0], results["runs"][f"{name}/2"]
        cells = "".join(f"{alone['decode'][b]['tok_s']:>14.1f}"
                        f"{sum(o['decode'][b]['tok_s'] for o in two) / len(two):>14.1f}" for b in batches)
        print(f"{label:<28}{cells}")
    write_json(args.json, results)


if __name__ == "__main__":
    main()
