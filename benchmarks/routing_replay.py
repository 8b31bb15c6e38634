"""Training-inference mismatch on an MoE model, and what Rollout Routing Replay does to it.

    python benchmarks/routing_replay.py [--smoke] [--episodes N] [--json PATH]

A Qwen3-MoE model (4 layers, 16 experts, top 4; made here, then warm-started by SFT on the
phonebook env's expert transcripts, both cached under ~/.cache/rollwise) plays phonebook episodes
on our engine at temperature 1, with its weights in fp32 and in bf16 (as most RL rollouts run), each
returning every token's experts. The trainer (transformers, fp32, the same weights) then computes
the sampled tokens' logprobs three ways: routing on its own ("off"), and replaying the rollout's
experts ("replay"). Reported per rollout dtype: the share of (token, layer) pairs whose top-k
experts differ between rollout and trainer, and the mean, 99th percentile and max of
|trainer - rollout| logprob over the generated tokens.

Its cost: decode with routing kept against decode without it, the same engine weights, prompts and
tokens, taking turns (median of 3), and the bytes a token's routing takes on the wire.
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
from common import cached_model, write_json  # noqa: E402

import torch  # noqa: E402

from rollwise import LLM, SamplingParams  # noqa: E402
from rollwise.agent.envs import make_env  # noqa: E402
from rollwise.agent.episode import collect  # noqa: E402
from rollwise.engine.async_engine import AsyncEngine  # noqa: E402
from rollwise.engine.tokenizer import Tokenizer  # noqa: E402
from rollwise.rl import expert_trajectories  # noqa: E402
from rollwise.trainer.sft import sft  # noqa: E402
from rollwise.trainer.policy import Batch, PolicyModel, micro_batches  # noqa: E402

MOE = dict(family="qwen3_moe", layers=4, hidden=128, heads=4, kv_heads=2, vocab=2048, experts=16,
           experts_per_token=4, moe_intermediate=64, seed=0)
SMOKE = dict(MOE, layers=2, hidden=64, experts=8, experts_per_token=2, moe_intermediate=32)


def warm_started(base: str, out: Path, steps: int) -> str:
    """The base model after `steps` of SFT on phonebook's expert transcripts (cached)."""
    if (out / "config.json").exists():
        return str(out)
    env = make_env("phonebook")
    demos = asyncio.run(expert_trajectories(Tokenizer(base), lambda: make_env("phonebook"), env.sample_tasks(256, seed=1)))
    policy = PolicyModel(base)
    losses = sft(policy, demos, steps=steps, lr=3e-3, batch_size=16)
    print(f"SFT {steps} steps: loss {losses[0]:.3f} -> {statistics.mean(losses[-10:]):.3f}", file=sys.stderr)
    policy.save(str(out))
    return str(out)


def episodes(model: str, dtype: str, n: int) -> list:
    async def go():
        engine = AsyncEngine(model, dtype=dtype, max_num_seqs=64, enable_return_routed_experts=True, seed=0)
        try:
            tasks = make_env("phonebook").sample_tasks(n, seed=7)
            params = SamplingParams(temperature=1.0, max_tokens=64, seed=3, return_routed_experts=True)
            return [t async for g in collect(engine, lambda: make_env("phonebook"), tasks, params, group_size=1,
                                             max_concurrency=64) for t in g]
        finally:
            engine.shutdown()
    return asyncio.run(go())


def mismatch(policy: PolicyModel, trajs: list, mode: str) -> dict:
    policy.routing, policy.routing_stats = mode, torch.zeros(2)
    diffs = []
    with torch.no_grad():
        for mb in micro_batches(trajs, 8192):
            b = Batch.of(mb)
            d = (policy.logprobs(b) - b.behaviour_logprobs).abs()
            diffs.append(d[b.mask > 0])
    d = torch.cat(diffs)
    moved, seen = policy.routing_stats.tolist()
    return {"mean_abs_logprob_diff": float(d.mean()), "p99": float(d.quantile(0.99)), "max": float(d.max()),
            "tokens": int(d.numel()), **({"routing_mismatch": moved / seen} if seen else {})}


def decode_cost(model: str, n: int, new: int, reps: int) -> dict:
    """tok/s of plain decode against decode keeping routing: one engine each, turns taken."""
    prompts = [[5 + i % 50, 17, 300 + i, 42] * 8 for i in range(n)]
    sides = {"plain": LLM(model, max_num_seqs=n, enable_prefix_caching=False),
             "routing kept": LLM(model, max_num_seqs=n, enable_prefix_caching=False, enable_return_routed_experts=True)}
    times: dict[str, list[float]] = {k: [] for k in sides}
    for rep in range(reps + 1):
        for name, llm in sides.items():
            sp = SamplingParams(temperature=1.0, seed=1, max_tokens=new, ignore_eos=True,
                                return_routed_experts=name != "plain")
            t0 = time.perf_counter()
            llm.generate(prompts, sp)
            if rep:  # the first round warms up
                times[name].append(time.perf_counter() - t0)
    tps = {k: n * new / statistics.median(v) for k, v in times.items()}
    return {"batch": n, "new_tokens": new, "tok_s": tps, "ratio": tps["routing kept"] / tps["plain"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--sft-steps", type=int, default=200)
    ap.add_argument("--json")
    args = ap.parse_args()
    name = "moe-smoke" if args.smoke else "moe-bench"
    base = cached_model(f"{name}-model", **(SMOKE if args.smoke else MOE))
    steps = 10 if args.smoke else args.sft_steps
    model = warm_started(base, Path(base).parent / f"{name}-sft{steps}", steps)
    n = 8 if args.smoke else args.episodes
    policy = PolicyModel(model)
    out: dict = {"model": model, "episodes": n, "dtypes": {}}
    print("| rollout dtype | tokens | routing differs (token-layers) | mean abs dlogprob, own routing | "
          "with replay | p99 own / replay | max own / replay |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for dtype in ("float32", "bfloat16"):
        trajs = episodes(model, dtype, n)
        off, replay = mismatch(policy, trajs, "off"), mismatch(policy, trajs, "replay")
        out["dtypes"][dtype] = {"off": off, "replay": replay, "turns": sum(t.num_turns for t in trajs)}
        print(f"| {dtype} | {off['tokens']} | {replay['routing_mismatch']:.2%} | {off['mean_abs_logprob_diff']:.4f} | "
              f"{replay['mean_abs_logprob_diff']:.4f} | {off['p99']:.3f} / {replay['p99']:.3f} | "
              f"{off['max']:.3f} / {replay['max']:.3f} |", flush=True)
    cost = decode_cost(model, 4 if args.smoke else 32, 16 if args.smoke else 64, 1 if args.smoke else 3)
    layers, k = MOE["layers"] if not args.smoke else SMOKE["layers"], (SMOKE if args.smoke else MOE)["experts_per_token"]
    cost["wire_bytes_per_token"] = 4 * layers * k * 4 / 3  # int32, base64
    out["cost"] = cost
    print(f"\ndecode, batch {cost['batch']} x {cost['new_tokens']} tokens: {cost['tok_s']['plain']:.0f} tok/s plain, "
          f"{cost['tok_s']['routing kept']:.0f} keeping routing ({cost['ratio']:.2f}x); "
          f"{cost['wire_bytes_per_token']:.0f} bytes of routing per token over HTTP")
    write_json(args.json, out)


if __name__ == "__main__":
    main()
