"""A warm start on a teacher's real agent conversations (`sft_file`): the tau-bench airline corpus.

    python benchmarks/sft_file.py [--smoke] [--steps 300] [--json PATH] [--plot PNG]

The 200 gpt-4o conversations of ../shared/data/agent-trajectories/public.jsonl (a system policy, a
user simulator, JSON tool calls and their results) tokenized as the episode loop tokenizes an episode
(rollwise/trainer/sft_data.py), cut at `--max-tokens` (the airline policy they share is ~2,800 of
them), on the demo's model (qwen3-style, 1M parameters, its own small tokenizer; `--model` another). The conversations of tasks 45-49 (20)
are held out; SFT trains on the other 180. Reported: the held-out conversations' NLL per assistant
token (what SFT trains) before and after, the same run, the tokens and the time; the loss curve as a
PNG with `--plot`.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from rollwise.omp import passive_unless_chosen
passive_unless_chosen()  # before torch loads

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cached_model, write_json  # noqa: E402
from rollwise.cli import DEMO_MODEL, demo_model  # noqa: E402
from rollwise.engine.tokenizer import Tokenizer  # noqa: E402
from rollwise.trainer.policy import Batch, PolicyModel, micro_batches  # noqa: E402
from rollwise.trainer.sft import SFT  # noqa: E402
from rollwise.trainer.sft_data import transcripts  # noqa: E402

CORPUS = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "agent-trajectories" / "public.jsonl"
HELD_OUT = tuple(f"task{t:03d}" for t in range(45, 50))


@torch.no_grad()
def nll(policy: PolicyModel, trajs: list, max_tokens: int) -> float:
    """Mean NLL per assistant token over `trajs`."""
    total, n = 0.0, 0
    for rows in micro_batches(trajs, max_tokens):
        b = Batch.of(rows)
        total -= float((policy.logprobs(b) * b.mask).sum())
        n += int(b.mask.sum())
    return total / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--max-tokens", type=int, default=4096, help="each conversation cut at this many tokens")
    ap.add_argument("--corpus", default=str(CORPUS))
    ap.add_argument("--model", help="a model directory (default: the demo's; made there as the demo's if absent)")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.batch, args.max_tokens = 2, 2, 3200  # (the airline policy alone is ~2,800 tokens)
    args.model = demo_model() if args.model is None else cached_model("", args.model, **DEMO_MODEL)  # (made if absent)
    tok = Tokenizer(args.model)
    t0 = time.perf_counter()
    data = transcripts(args.corpus, tok, "hermes", args.max_tokens)
    read_s = time.perf_counter() - t0
    held = [t for t in data if any(h in t.trajectory_id for h in HELD_OUT)]
    train = [t for t in data if t not in held]
    if args.smoke:
        held, train = held[:2], train[:4]
    tokens = sum(len(t.token_ids) for t in train)
    trained = sum(sum(t.loss_mask) for t in train)
    print(f"{len(train)} conversations to train on ({tokens:,} tokens, {trained:,} of them the assistant's), "
          f"{len(held)} held out; read and tokenized in {read_s:.1f} s", flush=True)
    torch.manual_seed(0)
    policy = PolicyModel(args.model)
    micro = 8 * args.max_tokens  # (rows share the policy prompt: a micro-batch computes it once)
    before = nll(policy, held, micro)
    warm = SFT(policy, train, steps=args.steps, lr=args.lr, batch_size=args.batch, micro_batch_tokens=micro)
    losses, t0 = [], time.perf_counter()
    for s in range(args.steps):
        losses.append(warm.step())
        if (s + 1) % max(1, args.steps // 10) == 0:
            print(f"  step {s + 1}/{args.steps}: loss {losses[-1]:.3f}", flush=True)
    sft_s = time.perf_counter() - t0
    after = nll(policy, held, micro)
    print(f"held-out NLL per assistant token: {before:.3f} before, {after:.3f} after {args.steps} SFT steps "
          f"({before / after:.2f}x lower; perplexity {torch.tensor(before).exp():.1f} -> {torch.tensor(after).exp():.1f}); "
          f"{sft_s:.0f} s, {sft_s / args.steps:.2f} s a step")
    out = {"model": args.model, "corpus": args.corpus, "train_conversations": len(train),
           "held_out_conversations": len(held), "train_tokens": tokens, "train_assistant_tokens": trained,
           "max_tokens": args.max_tokens, "steps": args.steps, "batch": args.batch, "lr": args.lr,
           "held_out_nll_before": before, "held_out_nll_after": after, "nll_ratio": before / after,
           "sft_seconds": sft_s, "losses": losses}
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(range(1, len(losses) + 1), losses, label="train loss (batch)")
        ax.axhline(before, color="gray", ls="--", label=f"held-out NLL before ({before:.2f})")
        ax.axhline(after, color="green", ls="--", label=f"held-out NLL after ({after:.2f})")
        ax.set_xlabel("SFT step")
        ax.set_ylabel("NLL per assistant token")
        ax.set_title("SFT on tau-bench conversations (sft_file)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    write_json(args.json, out)


if __name__ == "__main__":
    sys.exit(main())
