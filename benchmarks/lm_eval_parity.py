"""lm-eval-harness's own client (`local-completions`) against `rollwise serve`: its loglikelihood
requests (completions with `echo` + `logprobs`) and `generate_until`, checked against a
transformers forward of the same fp32 model. Runs in a venv with lm-eval, not rollwise's: e.g.

    ~/.cache/rollwise-peers/bin/python -m pip install 'lm_eval[api]==0.4.13'
    ~/.cache/rollwise-peers/bin/python benchmarks/lm_eval_parity.py [--model DIR] [--json PATH]

(`rollwise serve` is started from this checkout's .venv; the model defaults to the engine
benchmark's, made by `python benchmarks/engine.py` or `rollwise make-model`.)
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import time
from pathlib import Path

import httpx
import torch
from lm_eval.api.instance import Instance
from lm_eval.models.openai_completions import LocalCompletionsAPI
from transformers import AutoModelForCausalLM, AutoTokenizer

ROLLWISE = Path(__file__).resolve().parents[1] / ".venv" / "bin" / "rollwise"
PAIRS = [("The customer asked to cancel the order", " because it was late"),
         ("Find the user by email", " and look up the reservation"),
         ("The agent", " said"), ("Hello", " world, this is a test")]


def reference(model_dir: str) -> list[tuple[float, bool]]:
    """Each continuation's summed logprob and whether it is the greedy one, as lm-eval splits them."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for ctx, cont in PAIRS:
        whole = tok(ctx + cont, add_special_tokens=False).input_ids
        n = len(tok(ctx, add_special_tokens=False).input_ids)
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), -1)[n - 1:len(whole) - 1]
        target = torch.tensor(whole[n:])
        out.append((float(lp.gather(1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all())))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(Path.home() / ".cache" / "rollwise" / "engine-bench-model"))
    ap.add_argument("--json")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([str(ROLLWISE), "serve", args.model, "--port", str(port), "--max-model-len", "1024"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"))
    try:
        for _ in range(240):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        lm = LocalCompletionsAPI(base_url=f"http://127.0.0.1:{port}/v1/completions", model="m",
                                 tokenizer_backend="huggingface", tokenizer=args.model, max_length=1024)
        got = lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(PAIRS)])
        gen = lm.generate_until([Instance("generate_until", {}, ("The agent", {"until": ["\n"], "max_gen_toks": 16}), 0)])
    finally:
        proc.terminate()
        proc.wait(30)
    ref = reference(args.model)
    diff = max(abs(a[0] - b[0]) for a, b in zip(got, ref))
    print("| context + continuation | lm-eval via rollwise serve | transformers | greedy (both) |")
    print("| --- | --- | --- | --- |")
    for (ctx, cont), a, b in zip(PAIRS, got, ref):
        print(f"| {ctx!r} + {cont!r} | {a[0]:.4f} | {b[0]:.4f} | {a[1]} / {b[1]} |")
    print(f"largest difference {diff:.2g}; generate_until: {gen}")
    if args.json:
        Path(args.json).write_text(json.dumps({"loglikelihood": got, "transformers": ref, "max_abs_diff": diff,
                                               "generate_until": gen}, indent=1))


if __name__ == "__main__":
    main()
