"""Sleep mode in a synchronous run (`replica_sleep`): what the in-process replicas give back while
the trainer trains, and what it costs per step. The same run (synchronous, the whole batch trained
once complete: verl's step) with the replicas awake (0), their KV pools given back (1) and their
weights too (2), each level in a fresh process. `--model demo`: the demo's environment, model and
SFT warm start, 8 groups of 8 a step; `bench`: the engine benchmarks' 8-layer model (16 KiB of KV
a token, the demo's 1 KiB), untrained, so every turn runs to its 256 tokens, 4 groups of 4.

    python benchmarks/replica_sleep.py [--model demo|bench] [--steps N] [--kv-gb G] [--levels 0,1,2]
                                      [--json PATH] [--plot PNG] [--smoke [--model-dir DIR]]

Per level: the replicas' KV pools in memory when each step's training starts (the pools' own
mappings' resident pages: the pools are taken page by page as blocks are first used, so an awake
pool grows with the blocks a run has used; the last step's in the table), the process's resident
memory when training starts, its peak during training and its peak during the rollouts and weight
sync before (VmHWM, reset at each boundary; medians over the steps after the first: at this
model's size they are mostly the allocator's arenas), seconds per step, the trainer's own seconds
(sleep and wake included) and the tokens generated. The plot draws the pools by step and the
process's memory over the run.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time

from rollwise.omp import passive_env, passive_unless_chosen
passive_unless_chosen()  # before torch loads
from common import write_json  # noqa: E402  (benchmarks/common.py)

GIB = 2**30


def _status(key: str) -> int:
    """A /proc/self/status figure in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # (Linux: VmHWM starts again from VmRSS)
        f.write("5")


def kv_resident() -> int:
    """Bytes of the in-process replicas' KV pools in memory now: each pool tensor is a mapping of its
    own (anonymous memory, model_runner.py), whose resident size /proc/self/smaps gives."""
    import gc

    from rollwise.engine.model_runner import ModelRunner
    starts = {t.data_ptr() for o in gc.get_objects() if isinstance(o, ModelRunner) for t in o.kv_cache}
    total, current = 0, None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                current = int(head.split("-")[0], 16)
            elif head == "Rss:" and current in starts:
                total += int(line.split()[1]) * 1024
    return total


def child(level: int, steps: int, smoke: bool, kv_gb: float, model: str, model_dir: str | None) -> dict:
    """One run in this process, its memory watched: every step's boundaries from the trainer's `step`."""
    from common import engine_model
    from rollwise.cli import DEMO_FULL, DEMO_SFT, DEMO_SFT_CACHE, demo_model
    from rollwise.rl import TrainConfig, train
    from rollwise.trainer.grpo import GRPOTrainer

    phases, trace, t0 = [], [], time.perf_counter()
    step = GRPOTrainer.step

    def watched(self, groups):  # (the whole-batch step: rollouts before it, training in it)
        rollout_peak, start, kv = _status("VmHWM"), _status("VmRSS"), kv_resident()
        _reset_peak()
        try:
            return step(self, groups)
        finally:
            phases.append({"rollout_peak": rollout_peak, "train_start": start, "train_peak": _status("VmHWM"),
                           "kv_resident": kv})
            _reset_peak()
    GRPOTrainer.step = watched
    done = threading.Event()

    def sample():
        while not done.wait(0.05):
            trace.append((time.perf_counter() - t0, _status("VmRSS") / GIB))
    threading.Thread(target=sample, daemon=True).start()
    if smoke:  # the 2-layer engine model (made once, where --model-dir says), a few SFT steps, nothing cached
        run, groups = dict(model=engine_model("smoke", model_dir), sft_steps=5, sft_tasks=8), 2
    elif model == "bench":  # 16 KiB of KV a token (the demo's: 1 KiB), untrained: every turn its max_tokens
        run, groups = dict(model=engine_model("bench"), sft_steps=0, max_tokens=256), 4
    else:
        run, groups = dict(model=demo_model(), sft_cache=DEMO_SFT_CACHE, **{k: DEMO_FULL[k] for k in DEMO_SFT}), 8
    with tempfile.TemporaryDirectory(prefix="rollwise-sleep-") as tmp:
        cfg = TrainConfig.from_dict(dict(
            **run, run_dir=tmp, env="phonebook", steps=steps, groups_per_step=groups, group_size=groups,
            lr=DEMO_FULL["lr"], max_staleness=0, stream_trainer=False, replica_sleep=level, replica_kv_cache_gb=kv_gb,
            eval_tasks=0, progress=False, seed=0))
        rep = train(cfg)
    done.set()
    st = rep["steps"]
    s = st[1:] or st  # (after the first step: warm)
    med = lambda xs: sorted(xs)[(len(xs) - 1) // 2]  # noqa: E731
    later = phases[1:] or phases
    return {"level": level, "steps": len(st),
            "train_start_gib": med([p["train_start"] for p in later]) / GIB,
            "train_peak_gib": med([p["train_peak"] for p in later]) / GIB,
            "rollout_peak_gib": med([p["rollout_peak"] for p in later]) / GIB,
            "kv_resident_gib": [p["kv_resident"] / GIB for p in phases],  # at each step's training
            "step_s": (st[-1]["wall_s"] - st[0]["wall_s"]) / (len(st) - 1) if len(st) > 1 else st[0]["wall_s"],
            "train_s": sum(x["train_s"] for x in s) / len(s),
            "generated_tokens": st[-1].get("generated_tokens", 0.0),
            "replicas_slept": [x.get("replicas_slept", 0) for x in st],
            "reward_mean": sum(x["reward"] for x in st) / len(st), "trace": trace}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--kv-gb", type=float, default=1.0, help="each replica's KV pool (replica_kv_cache_gb)")
    ap.add_argument("--levels", default="0,1,2")
    ap.add_argument("--smoke", action="store_true", help="a seconds-long run for tests")
    ap.add_argument("--model-dir", help="with --smoke: where its model is (made if absent)")
    ap.add_argument("--model", default="demo", choices=("demo", "bench"),
                    help="bench: the engine benchmarks' 8-layer model, untrained, 4 groups of 4 a step")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        r = child(args.child, args.steps, args.smoke, args.kv_gb, args.model, args.model_dir)
        print("RESULT " + json.dumps(r), flush=True)
        return
    levels = [int(x) for x in args.levels.split(",")]
    print(f"{args.steps} synchronous steps ({args.model} model, phonebook), whole batches; replicas asleep while "
          "training at each level")
    print(f"{'level':>5}{'KV at training GiB':>19}{'train start GiB':>16}{'train peak GiB':>15}"
          f"{'rollout peak GiB':>17}{'s/step':>8}{'train s':>8}{'gen tokens':>11}")
    out = {"steps": args.steps, "model": args.model, "replica_kv_cache_gb": args.kv_gb, "levels": {}}
    for level in levels:
        cmd = [sys.executable, __file__, "--child", str(level), "--steps", str(args.steps), "--kv-gb", str(args.kv_gb),
               "--model", args.model, *(["--smoke"] * args.smoke),
               *(["--model-dir", args.model_dir] if args.model_dir else [])]
        proc = subprocess.run(cmd, env=passive_env(), capture_output=True, text=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"level {level} failed:\n{proc.stderr[-3000:]}")
        r = out["levels"][level] = json.loads(line[7:])
        print(f"{level:>5}{r['kv_resident_gib'][-1]:>19.3f}{r['train_start_gib']:>16.2f}{r['train_peak_gib']:>15.2f}"
              f"{r['rollout_peak_gib']:>17.2f}{r['step_s']:>8.2f}{r['train_s']:>8.2f}{int(r['generated_tokens']):>11}",
              flush=True)
    if 0 in out["levels"]:
        base = out["levels"][0]
        for level, r in out["levels"].items():
            if level:
                r["train_peak_vs_awake"] = r["train_peak_gib"] / base["train_peak_gib"]
                r["step_s_vs_awake"] = r["step_s"] / base["step_s"]
                print(f"level {level}: training's peak {r['train_peak_vs_awake']:.2f}x the awake run's "
                      f"({r['train_peak_gib']:.2f} vs {base['train_peak_gib']:.2f} GiB), "
                      f"{r['step_s_vs_awake']:.2f}x its seconds per step")
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
        for level, r in out["levels"].items():
            name = f"replica_sleep = {level}"
            b.plot(*zip(*r["trace"]), label=name, lw=1)
            a.plot(range(1, len(r["kv_resident_gib"]) + 1), r["kv_resident_gib"], marker=".", label=name)
        a.set_xlabel("step")
        a.set_ylabel("GiB")
        a.set_title("replicas' KV pools in memory while the trainer trains")
        b.set_xlabel("seconds into the run")
        b.set_ylabel("GiB")
        b.set_title("the process's resident memory")
        a.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    for r in out["levels"].values():
        r["trace"] = [(round(t, 2), round(g, 4)) for t, g in r["trace"][::4]]  # (every 0.2 s in the file)
    write_json(args.json, out)


if __name__ == "__main__":
    main()
