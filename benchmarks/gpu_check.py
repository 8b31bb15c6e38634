"""The engine on an accelerator, checked and timed in one short run: the script for a session lent a
GPU (the engine has not yet run on one; CI runs it on the CPU with --smoke so it stays runnable).

Correctness, on small Qwen3-style models (one dense, one with experts) made here: greedy tokens and
their logprobs against transformers' on the same device and dtype; suffix speculation lossless
(the same greedy tokens with it as without); a seeded sample the same twice. Speed, on the engine
benchmarks' 8-layer model: decode tok/s at batch 1 / 16 / 64 and prefill tok/s against
transformers' generate and forward on the same device, taking turns (ratios, same run).

    python benchmarks/gpu_check.py --json results/gpu_check.json     # on the GPU machine: ~3 min
    python benchmarks/gpu_check.py --device cpu --smoke              # the same code here
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from rollwise.omp import passive_unless_chosen
passive_unless_chosen()  # before torch loads

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import engine_model, paired, rand_prompts as prompts, write_json  # noqa: E402

from rollwise import LLM, SamplingParams  # noqa: E402
from rollwise.make_model import make_model  # noqa: E402

SMALL = {"dense": dict(family="qwen3", layers=2, hidden=128, heads=4, kv_heads=2, vocab=2048, head_dim=32, std=0.1),
         "moe": dict(family="qwen3_moe", layers=2, hidden=128, heads=4, kv_heads=2, vocab=2048, std=0.1,
                     experts=8, experts_per_token=2, moe_intermediate=64)}


def transformers_model(model: str, device: str, dtype: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).to(device).eval()


def hf_greedy(hf, batch: list[list[int]], new: int, device: str, scores: bool = False):
    ids = torch.tensor(batch, device=device)
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=scores)
    tokens = out.sequences[:, ids.shape[1]:].cpu()
    if not scores:
        return tokens, None
    lp = torch.log_softmax(torch.stack(out.logits, 1).float(), -1).cpu()  # [B, new, V]
    return tokens, lp.gather(2, tokens[:, :, None]).squeeze(2)


def correctness(model: str, device: str, dtype: str, new: int) -> dict:
    vocab = SMALL["dense"]["vocab"]
    batch = prompts(4, 24, vocab, 0)
    llm = LLM(model, device=device, dtype=dtype)
    ours = llm.generate(batch, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, logprobs=0))
    hf = transformers_model(model, device, dtype)
    theirs, their_lp = hf_greedy(hf, batch, new, device, scores=True)
    same = [list(o.token_ids) == t.tolist() for o, t in zip(ours, theirs)]
    # logprobs compared where the tokens agree (a near-tie may flip one at bf16)
    diff = max((abs(a - b) for o, t, lp in zip(ours, theirs, their_lp) for a, b, x, y in
                zip(o.logprobs, lp.tolist(), o.token_ids, t.tolist()) if x == y), default=0.0)
    loop = [[5, 6, 7, 8, 9, 10, 11, 12] * 6 for _ in range(4)]  # repetitive: the suffix tree drafts
    greedy = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    spec = LLM(model, device=device, dtype=dtype, speculative="suffix", spec_controller="always")
    with_spec = [list(o.token_ids) for o in spec.generate(loop, greedy)]
    without = [list(o.token_ids) for o in llm.generate(loop, greedy)]
    seeded = SamplingParams(temperature=1.0, max_tokens=new, seed=7, ignore_eos=True)
    twice = [[list(o.token_ids) for o in llm.generate(batch, seeded)] for _ in range(2)]
    m = spec.engine.metrics()
    return {"same_greedy_tokens": sum(same), "prompts": len(same), "max_logprob_diff": diff,
            "spec_lossless": with_spec == without, "spec_accepted": m.get("spec_accepted_tokens", 0.0),
            "seeded_repeatable": twice[0] == twice[1]}


def speed(model: str, device: str, dtype: str, batches: list[int], new: int, prefill: tuple[int, int],
          reps: int) -> dict:
    llm = LLM(model, device=device, dtype=dtype, max_num_seqs=max(batches), enable_prefix_caching=False)
    vocab = llm.engine.vocab_size
    hf = transformers_model(model, device, dtype)
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    warm = prompts(2, 32, vocab, 99)
    llm.generate(warm, params)
    hf_greedy(hf, warm, new, device)
    out: dict = {"decode": {}}
    for b in batches:
        batch = prompts(b, 32, vocab, b)
        r = paired({"rollwise": lambda: llm.generate(batch, params),
                    "transformers": lambda: hf_greedy(hf, batch, new, device)}, reps)
        n = b * new
        out["decode"][b] = {"rollwise_tok_s": n / r["rollwise"][1], "transformers_tok_s": n / r["transformers"][1],
                            "ratio": r["transformers"][1] / r["rollwise"][1], "tokens": n}
    n_req, plen = prefill
    batch = prompts(n_req, plen, vocab, 7)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def hf_forward():
        with torch.inference_mode():
            return hf(torch.tensor(batch, device=device), use_cache=False, logits_to_keep=1).logits.cpu()
    r = paired({"rollwise": lambda: llm.generate(batch, one), "transformers": hf_forward}, reps)
    out["prefill"] = {"rollwise_tok_s": n_req * plen / r["rollwise"][1],
                      "transformers_tok_s": n_req * plen / r["transformers"][1],
                      "ratio": r["transformers"][1] / r["rollwise"][1], "tokens": n_req * plen}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on the CPU")
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="small sizes (CI, on the CPU)")
    args = ap.parse_args()
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    new, batches, prefill, reps = (8, [1, 2], (2, 32), 1) if args.smoke else (64, [1, 16, 64], (8, 512), 3)
    res: dict = {"device": args.device, "dtype": dtype, "torch": torch.__version__,
                 "name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu", "correctness": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, kw in SMALL.items():
            model = str(make_model(Path(tmp) / name, **kw))
            c = res["correctness"][name] = correctness(model, args.device, dtype, new)
            print(f"{name}: greedy tokens as transformers' for {c['same_greedy_tokens']}/{c['prompts']} prompts, "
                  f"max |dlogprob| {c['max_logprob_diff']:.2e}; speculation lossless {c['spec_lossless']} "
                  f"({c['spec_accepted']:.0f} drafted tokens accepted); seeded sample repeatable "
                  f"{c['seeded_repeatable']}", flush=True)
    model = engine_model("smoke" if args.smoke else "bench")
    res["speed"] = speed(model, args.device, dtype, batches, new, prefill, reps)
    for b, d in res["speed"]["decode"].items():
        print(f"decode batch {b:>3}: rollwise {d['rollwise_tok_s']:9.1f} tok/s, transformers "
              f"{d['transformers_tok_s']:9.1f} ({d['ratio']:.2f}x)")
    p = res["speed"]["prefill"]
    print(f"prefill {p['tokens']} tokens: rollwise {p['rollwise_tok_s']:9.1f} tok/s, transformers "
          f"{p['transformers_tok_s']:9.1f} ({p['ratio']:.2f}x)")
    write_json(args.json, res)


if __name__ == "__main__":
    main()
