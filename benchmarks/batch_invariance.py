"""Batch invariance: what the batch does to a request's bits by default, and what invariance costs.

    python benchmarks/batch_invariance.py [--smoke] [--episodes N] [--json PATH]

Drift: the RL demo's warm-start model (its SFT weights from `rollwise demo`'s cache under
~/.cache/rollwise; the untrained demo model where there is none) plays N phonebook episodes at temperature 1 with seeded
sampling, once one episode at a time and once all N at once (each turn batched with whatever the
other episodes have in flight), default engine against `batch_invariant`. Reported: episodes
whose logprobs differ in any bit, whose tokens differ, and the largest |dlogprob| among tokens
both runs sampled alike.

Cost: decode tokens/s at batch 1, 16 and 64 and prefill tokens/s on the engine benchmark's model
(llama, 8 layers, hidden 512) and on the demo's (qwen3, 2 layers, hidden 128), default against
invariant, taking turns (median of 3).
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
from common import cached_model, engine_model, write_json  # noqa: E402

from rollwise import LLM, SamplingParams  # noqa: E402
from rollwise.agent.envs import make_env  # noqa: E402
from rollwise.agent.episode import collect  # noqa: E402
from rollwise.engine.async_engine import AsyncEngine  # noqa: E402
from rollwise.rl import TrainConfig, _sft_cache_path  # noqa: E402
from rollwise.trainer.policy import PolicyModel  # noqa: E402



def demo_model(smoke: bool) -> str:
    """The RL demo's warm start as a model directory (made once from `rollwise demo`'s SFT cache);
    without that cache, the demo's untrained model."""
    from rollwise.cli import DEMO_FULL, DEMO_MODEL, DEMO_SFT_CACHE, demo_model as base
    if smoke:
        return cached_model("batch-invariance-smoke-model", **dict(DEMO_MODEL, hidden=64))
    model = base()
    cfg = TrainConfig.from_dict({"model": model, "env": "phonebook", "sft_cache": DEMO_SFT_CACHE, **DEMO_FULL})
    pt, out = _sft_cache_path(cfg), Path(model).parent / "rl-demo-sft-model"
    if (out / "config.json").exists() or pt is None or not pt.exists():
        return str(out) if (out / "config.json").exists() else model
    import torch
    policy = PolicyModel(model)
    policy.model.load_state_dict(torch.load(pt, weights_only=True))
    policy.save(str(out))
    return str(out)


def episodes(model: str, invariant: bool, n: int, concurrency: int) -> list:
    async def go():
        engine = AsyncEngine(model, max_num_seqs=64, batch_invariant=invariant, kv_cache_gb=0.25, seed=0)
        try:
            tasks = make_env("phonebook").sample_tasks(n, seed=7)
            params = SamplingParams(temperature=1.0, max_tokens=48, seed=3)
            return [t async for g in collect(engine, lambda: make_env("phonebook"), tasks, params, group_size=1,
                                             max_concurrency=concurrency) for t in g]
        finally:
            engine.shutdown()
    return sorted(asyncio.run(go()), key=lambda t: t.trajectory_id)


def drift(model: str, invariant: bool, n: int) -> dict:
    alone, batched = episodes(model, invariant, n, 1), episodes(model, invariant, n, n)
    assert [t.trajectory_id for t in alone] == [t.trajectory_id for t in batched]
    bits = sum(a.logprobs != b.logprobs for a, b in zip(alone, batched))
    tokens = sum(a.token_ids != b.token_ids for a, b in zip(alone, batched))
    worst = 0.0
    for a, b in zip(alone, batched):
        for ta, tb, la, lb, m in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs, a.loss_mask):
            if ta != tb:
                break  # the episodes went different ways from here
            if m:
                worst = max(worst, abs(la - lb))
    return {"episodes": n, "turns": sum(t.num_turns for t in batched),
            "generated_tokens": sum(sum(t.loss_mask) for t in batched), "logprobs_differ": bits,
            "tokens_differ": tokens, "max_abs_dlogprob": worst}


def cost(model: str, smoke: bool) -> dict:
    sides = {"default": LLM(model, max_num_seqs=64, enable_prefix_caching=False),
             "invariant": LLM(model, max_num_seqs=64, enable_prefix_caching=False, batch_invariant=True)}
    new = 8 if smoke else 64
    work = {f"decode batch {b}": ([[7 + i, 300 + i, 42, 99] * 4 for i in range(b)], new) for b in (1, 16, 64)}
    work["prefill 8 x 512"] = ([[(13 * i + j) % 997 + 3 for j in range(64 if smoke else 512)] for i in range(8)], 1)
    out = {}
    for name, (prompts, k) in work.items():
        sp = SamplingParams(temperature=0, max_tokens=k, ignore_eos=True)
        times: dict[str, list[float]] = {s: [] for s in sides}
        for rep in range(2 if smoke else 4):
            for side, llm in sides.items():
                t0 = time.perf_counter()
                llm.generate(prompts, sp)
                if rep:  # the first round warms up
                    times[side].append(time.perf_counter() - t0)
        tokens = len(prompts) * (k if k > 1 else len(prompts[0]))
        tps = {s: tokens / statistics.median(v) for s, v in times.items()}
        out[name] = {"tokens": tokens, "tok_s": tps, "ratio": tps["invariant"] / tps["default"]}
        print(f"| {name} | {tokens} | {tps['default']:.0f} | {tps['invariant']:.0f} | {out[name]['ratio']:.2f}x |",
              flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--json")
    args = ap.parse_args()
    model = demo_model(args.smoke)
    n = 8 if args.smoke else args.episodes
    out: dict = {"drift_model": model, "drift": {}}
    print(f"drift: {model}, {n} phonebook episodes alone vs all at once\n")
    print("| engine | turns | generated tokens | episodes with other logprobs | with other tokens | max abs dlogprob |")
    print("| --- | --- | --- | --- | --- | --- |")
    for invariant in (False, True):
        d = drift(model, invariant, n)
        out["drift"]["invariant" if invariant else "default"] = d
        print(f"| {'batch_invariant' if invariant else 'default'} | {d['turns']} | {d['generated_tokens']} | "
              f"{d['logprobs_differ']} / {n} | {d['tokens_differ']} / {n} | {d['max_abs_dlogprob']:.2e} |", flush=True)
    out["cost"] = {}
    for m in (engine_model("smoke" if args.smoke else "bench"), model):
        print(f"\ncost: {m}\n\n| work | tokens | default tok/s | batch_invariant tok/s | ratio |\n"
              "| --- | --- | --- | --- | --- |")
        out["cost"][m] = cost(m, args.smoke)
    write_json(args.json, out)


if __name__ == "__main__":
    main()
