"""What gradient checkpointing (`gradient_checkpointing = true`) and the output head in chunks
(`logit_chunk_tokens`) save and cost in the trainer: one micro-batch's forward and backward
(`PolicyModel.logprobs`, then the loss's backward) on agent-like rows, a group's common prompt and
then each row's own tokens (generated turns and tool output), each way in a process of its own.

    python benchmarks/grad_checkpoint.py [--smoke] [--rows 8] [--prompt 512] [--rest 1536] [--json PATH]
        [--sides plain,checkpointed,head_chunks,both] [--vocab 151936] [--head-chunk 1024]

Sides: `plain` (neither), `checkpointed` (the decoder layers), `head_chunks` (the head's logits
recomputed `--head-chunk` positions at a time) and `both`. `--vocab`: the engine benchmarks' model
with that vocabulary (a real one's makes the head's logits a micro-batch's largest tensors).

Reported for each: the bytes autograd kept for the backward (saved tensors), the process's peak
resident memory above what it held before the pass (VmHWM, reset before each pass), and the median
seconds of `--repeats` passes; then checkpointed / plain for each, and the tokens of the micro-batch.
The shared prompt runs once either way (the trainer's default).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

from rollwise.omp import passive_unless_chosen
passive_unless_chosen()  # before torch loads

from common import cached_model, engine_model, ENGINE_SIZES, write_json  # noqa: E402  (benchmarks/common.py)


def _status(key: str) -> int:
    """A /proc/self/status figure in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


SIDES = {"plain": (False, 0), "checkpointed": (True, 0), "head_chunks": (False, 1), "both": (True, 1)}


def measure(model: str, ckpt: bool, rows: int, prompt: int, rest: int, repeats: int, head_chunk: int = 0) -> dict:
    """In this process: kept bytes, peak memory above the start and seconds of one pass, median."""
    import torch

    from rollwise.trainer.policy import Batch, PolicyModel
    from rollwise.types import Trajectory

    with open(f"{model}/config.json") as f:
        vocab = json.load(f)["vocab_size"]
    rng = random.Random(0)
    head = [rng.randrange(10, vocab) for _ in range(prompt)]
    trajs = []
    for i in range(rows):
        n = rest - rng.randrange(0, rest // 4)  # rows of unequal length, as episodes are
        own = [rng.randrange(10, vocab) for _ in range(n)]
        mask = [1 if (j // 64) % 2 == 0 else 0 for j in range(n)]  # turns of 64 generated, 64 tool tokens
        trajs.append(Trajectory(trajectory_id=f"t{i}", group_id="g", task={}, token_ids=head + own,
                                loss_mask=[0] * prompt + mask, logprobs=[0.0] * (prompt + n)))
    b = Batch.of(trajs)
    policy = PolicyModel(model)
    policy.head_chunk = head_chunk
    if ckpt:
        policy.enable_checkpointing()
    kept, peaks, secs = [0], [], []

    def pack(t):
        kept[0] += t.numel() * t.element_size()
        return t
    for r in range(repeats + 1):  # the first one warms up
        policy.model.zero_grad(set_to_none=True)
        kept[0] = 0
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak resident memory starts again from now
        before = _status("VmRSS")
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            lp = policy.logprobs(b)
        (-(lp * b.mask).sum() / b.mask.sum()).backward()
        secs.append(time.perf_counter() - t0)
        peaks.append(_status("VmHWM") - before)
        del lp
    return {"kept_bytes": kept[0], "peak_bytes": statistics.median(peaks[1:]), "seconds": statistics.median(secs[1:]),
            "tokens": int(b.attention_mask.sum()), "padded_tokens": b.input_ids.numel(),
            "generated_tokens": int(b.mask.sum()), "shared_prefix": b.shared}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="the 2-layer model, short rows")
    ap.add_argument("--rows", type=int, default=8, help="rows of the micro-batch")
    ap.add_argument("--prompt", type=int, default=512, help="their common prompt's tokens")
    ap.add_argument("--rest", type=int, default=1536, help="each row's own tokens (at most; some are shorter)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", help="a model directory (default: the engine benchmarks' model, made once)")
    ap.add_argument("--json")
    ap.add_argument("--sides", default="plain,checkpointed", help=f"comma-separated, of {list(SIDES)}")
    ap.add_argument("--vocab", type=int, help="the model's vocabulary (default: the engine benchmarks' model's)")
    ap.add_argument("--head-chunk", type=int, default=1024, help="head_chunks and both: positions per chunk")
    ap.add_argument("--child", choices=list(SIDES), help=argparse.SUPPRESS)
    args = ap.parse_args()
    rest = 96 if args.smoke else args.rest
    prompt = 40 if args.smoke else args.prompt
    size = "smoke" if args.smoke else "bench"
    model = (cached_model(f"engine-{size}-vocab{args.vocab}-model", args.model, **{**ENGINE_SIZES[size],
                                                                                  "vocab": args.vocab})
             if args.vocab else engine_model(size, args.model))
    if args.child:
        ckpt, chunked = SIDES[args.child]
        print(json.dumps(measure(model, ckpt, args.rows, prompt, rest, args.repeats,
                                 args.head_chunk if chunked else 0)))
        return
    sides = args.sides.split(",")
    if not set(sides) <= set(SIDES) or "plain" not in sides:
        sys.exit(f"--sides: plain and any of {list(SIDES)}")
    res = {}
    for name in sides:
        cmd = [sys.executable, __file__, "--child", name, "--rows", str(args.rows), "--prompt", str(prompt),
               "--rest", str(rest), "--repeats", str(args.repeats), "--model", model, "--head-chunk",
               str(args.head_chunk)]
        # tensors over 64 KiB mmapped, so freeing one returns it at once and the resident memory is the live one
        out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
        if out.returncode:
            sys.exit(f"{name} failed:\n{out.stderr[-3000:]}")
        res[name] = json.loads(out.stdout.strip().splitlines()[-1])
        r = res[name]
        print(f"{name:>12}: kept {r['kept_bytes'] / 2**20:8.1f} MiB, peak {r['peak_bytes'] / 2**20:8.1f} MiB, "
              f"{r['seconds']:.3f} s per forward and backward", flush=True)
    p = res["plain"]
    res["ratios"] = {name: {k: res[name][k] / p[k] for k in ("kept_bytes", "peak_bytes", "seconds")}
                     for name in sides if name != "plain"}
    if "checkpointed" in res:
        res["ratio"] = res["ratios"]["checkpointed"]
    with open(f"{model}/config.json") as f:
        vocab = json.load(f)["vocab_size"]
    res["settings"] = {"rows": args.rows, "prompt": prompt, "rest": rest, "repeats": args.repeats, "model": size,
                       "vocab": vocab, "head_chunk": args.head_chunk}
    print(f"{p['tokens']:,} tokens ({p['generated_tokens']:,} generated, a {p['shared_prefix']}-token prompt "
          f"run once), vocabulary {vocab:,}; against plain:")
    for name, r in res["ratios"].items():
        print(f"{name:>12}: kept {r['kept_bytes']:.3f}x, peak {r['peak_bytes']:.3f}x, time {r['seconds']:.3f}x")
    write_json(args.json, res)


if __name__ == "__main__":
    main()
