"""What a trainer in the run's process costs its engine: decode speed alone, beside a training loop
on a thread of the same process (one GIL), and beside the same loop in a process of its own
(`trainer_apart`), each on one core of its own (1 torch thread each).

    python benchmarks/trainer_gil.py [--model bench|demo] [--batch N] [--tokens N] [--json PATH]

The engine decodes `batch` sequences of `tokens` new tokens (seeded: the same tokens every time);
the trainer runs AdamW steps of transformers' forward and backward on 4 x 256 tokens of the same
model. Reports the engine's tokens/s in each setting and the trainer's steps/s beside it.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import threading
import time

from rollwise.omp import passive_unless_chosen
passive_unless_chosen()  # before torch loads

import torch  # noqa: E402

from common import engine_model, write_json  # noqa: E402

WARM_S = 8.0  # the trainer's start (model load, first steps) before the engine is timed


def train_loop(model: str, stop, steps) -> None:
    """AdamW steps on one torch thread until `stop` is set, counting them in `steps.value`."""
    from transformers import AutoModelForCausalLM
    torch.get_num_threads()  # (a thread's first torch call resets its count: torch's is per thread)
    torch.set_num_threads(1)
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    opt = torch.optim.AdamW(m.parameters(), 1e-5)
    x = torch.randint(3, m.config.vocab_size, (4, 256), generator=torch.Generator().manual_seed(0))
    while not stop.is_set():
        m(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        steps.value += 1


def decode(llm, prompts, params) -> tuple[float, int]:
    t = time.perf_counter()
    n = sum(len(o.token_ids) for o in llm.generate(prompts, params))
    return n / (time.perf_counter() - t), n


def beside(llm, prompts, params, start, stop, steps) -> dict:
    """Decode while the trainer runs (started by `start`), after its warm-up."""
    start()
    time.sleep(WARM_S)
    steps.value = 0
    t = time.perf_counter()
    tps, n = decode(llm, prompts, params)
    out = {"tokens_per_s": tps, "tokens": n, "trainer_steps_per_s": steps.value / (time.perf_counter() - t)}
    stop.set()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bench", choices=["bench", "demo"],
                    help="the engine benchmark's 32M model, or the demo's tiny one")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.model == "demo":
        from rollwise.cli import demo_model
        model = demo_model()
    else:
        model = engine_model("bench")
    from rollwise import LLM, SamplingParams
    llm = LLM(model, num_threads=1)
    params = SamplingParams(temperature=1.0, max_tokens=args.tokens, ignore_eos=True, seed=1)
    prompts = [[5 + i, 17, 300, 42] * 8 for i in range(args.batch)]
    decode(llm, prompts, params)  # warm
    out: dict = {"model": model, "batch": args.batch, "new_tokens": args.tokens}
    tps, n = decode(llm, prompts, params)
    out["alone"] = {"tokens_per_s": tps, "tokens": n}

    class Count:
        value = 0
    stop, steps = threading.Event(), Count()
    thread = threading.Thread(target=train_loop, args=(model, stop, steps))
    out["trainer_thread"] = beside(llm, prompts, params, thread.start, stop, steps)
    thread.join()
    ctx = mp.get_context("spawn")
    stop, steps = ctx.Event(), ctx.Value("i", 0)
    proc = ctx.Process(target=train_loop, args=(model, stop, steps))
    out["trainer_process"] = beside(llm, prompts, params, proc.start, stop, steps)
    proc.join()
    t, p = out["trainer_thread"], out["trainer_process"]
    out["engine_speedup_apart"] = p["tokens_per_s"] / t["tokens_per_s"]
    out["trainer_speedup_apart"] = p["trainer_steps_per_s"] / t["trainer_steps_per_s"]
    print(f"engine, {args.batch} x {args.tokens} tokens: alone {out['alone']['tokens_per_s']:.0f} tokens/s, beside "
          f"a trainer thread {t['tokens_per_s']:.0f}, beside a trainer process {p['tokens_per_s']:.0f} "
          f"({out['engine_speedup_apart']:.2f}x); trainer {t['trainer_steps_per_s']:.2f} vs "
          f"{p['trainer_steps_per_s']:.2f} steps/s ({out['trainer_speedup_apart']:.2f}x)")
    write_json(args.json, out)


if __name__ == "__main__":
    main()
