"""`rollwise demo | train | eval | serve | route | retrieve | generate | bench | sim | make-model`.
Engine options come from `EngineConfig`'s fields."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from rollwise.engine import allocator  # (no torch yet)
from rollwise.omp import passive_unless_chosen
passive_unless_chosen()  # before torch loads: spinning threads starve peers
allocator.settle()  # before any thread allocates: one arena for all (rollwise/engine/allocator.py)

from rollwise.config import EngineConfig, ServerConfig  # noqa: E402
from rollwise.serve.launch import PARSER_ALIASES, add_launch_args  # noqa: E402

DEMO_DIR = Path(os.environ.get("ROLLWISE_CACHE", Path.home() / ".cache" / "rollwise")) / "rl-demo-model"
DEMO_SFT_CACHE = str(DEMO_DIR.parent / "rl-demo-sft")  # warm starts, keyed by their settings
DEMO_MODEL = dict(family="qwen3", layers=2, hidden=128, heads=4, kv_heads=2, vocab=2048, seed=0)
# SFT: a mix of tool-using and answer-at-once transcripts (see README); RL from reward then
DEMO_FULL = dict(sft_steps=2000, sft_tasks=8192, sft_direct_fraction=0.5, steps=240, groups_per_step=8, group_size=8,
                 lr=1e-4, max_staleness=1, deterministic=True)
DEMO_SMOKE = dict(sft_steps=2, sft_tasks=8, steps=2, groups_per_step=2, group_size=2, eval_tasks=4, max_tokens=16)
# its own lighter warm start (a quarter of the transcripts skip the tool: with half, the lookup-and-copy
# skill needs 2,000 SFT steps to appear; with a quarter, 1,000), then fewer, larger GRPO steps
DEMO_QUICK = dict(DEMO_FULL, sft_steps=1000, sft_direct_fraction=0.25, steps=30, eval_tasks=100, lr=3e-4)
DEMO_SFT = ("sft_steps", "sft_tasks", "sft_direct_fraction")  # the warm start's settings (its cache key)


def demo_model() -> str:
    """The demo's tiny model (built once; its warm starts are cached beside it, `DEMO_SFT_CACHE`)."""
    from rollwise.make_model import cached_model
    if not (DEMO_DIR / "config.json").exists():
        print(f"building a tiny model in {DEMO_DIR} ...", flush=True)
    return str(cached_model(DEMO_DIR, **DEMO_MODEL))


def add_config_args(p: argparse.ArgumentParser, cls, skip: tuple[str, ...] = (),
                    more_choices: dict | None = None) -> None:
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        if f.type in ("bool", "bool | None") or isinstance(default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        else:
            conv = {"int": int, "float": float, "int | None": int, "float | None": float}.get(str(f.type), str)
            choices = f.metadata.get("choices")
            choices = (*choices, *(more_choices or {}).get(f.name, ())) if choices else None
            p.add_argument(flag, type=conv, default=default, choices=choices, help=f"(default: {default})")


def config_from_args(cls, args: argparse.Namespace, **fixed):
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in vars(args).items() if k in names and k not in fixed}, **fixed)


def cmd_make_model(args) -> None:
    from rollwise.agent.parsing import make_parser
    from rollwise.make_model import make_model
    out = make_model(args.out_dir, family=args.family, layers=args.layers, hidden=args.hidden, heads=args.heads,
                     kv_heads=args.kv_heads, intermediate=args.intermediate, vocab=args.vocab,
                     max_positions=args.max_positions, tie=args.tie, seed=args.seed, std=args.init_std,
                     dtype=args.dtype, experts=args.experts, experts_per_token=args.experts_per_token,
                     moe_intermediate=args.moe_intermediate,
                     special_tokens=make_parser(args.tool_tokens).tags if args.tool_tokens else ())
    print(f"wrote {args.family} model to {out}")


def cmd_generate(args) -> None:
    from rollwise import LLM, SamplingParams
    llm = LLM(**dataclasses.asdict(config_from_args(EngineConfig, args)))
    try:
        extra = json.loads(args.sampling)
    except json.JSONDecodeError as e:
        raise ValueError(f"--sampling must be a JSON object of SamplingParams fields: {e}") from e
    if not isinstance(extra, dict):
        raise ValueError("--sampling must be a JSON object of SamplingParams fields")
    params = SamplingParams.from_dict({"temperature": args.temperature, "max_tokens": args.max_tokens,
                                       "seed": args.sample_seed, **extra})
    prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": p}]) if args.chat else p for p in args.prompt]
    t0 = time.perf_counter()
    outs = [c for o in llm.generate(prompts, params) for c in o.samples or [o]]  # (n each, with --sampling n)
    dt = time.perf_counter() - t0
    for o in outs:
        print(f"--- {o.request_id} ({len(o.token_ids)} tokens, {o.finish_reason}, "
              f"{o.num_cached_tokens} cached)\n{o.text}")
    n = sum(len(o.token_ids) for o in outs)
    print(f"[{n} tokens in {dt:.2f}s: {n / dt:.1f} tok/s]")


def cmd_serve(args) -> None:
    import uvicorn

    from rollwise.engine.async_engine import AsyncEngine
    from rollwise.serve.launch import launch_args
    from rollwise.serve.lora import parse_modules
    from rollwise.serve.server import build_app
    launch_args(args)
    ecfg = config_from_args(EngineConfig, args)
    scfg = config_from_args(ServerConfig, args)
    modules = parse_modules(args.lora_modules)
    if modules and not ecfg.enable_lora:
        raise SystemExit("--lora-modules needs --enable-lora")
    engine = AsyncEngine(**dataclasses.asdict(ecfg))
    for lora_name, path in modules.items():  # before serving: a bad adapter stops the server at start
        try:
            asyncio.run(engine.call(lambda n=lora_name, p=path: engine.engine.add_lora(n, p)))
        except ValueError as e:
            engine.shutdown()
            raise SystemExit(f"--lora-modules {lora_name}={path}: {e}") from None
    name = scfg.model_name or Path(ecfg.model).name
    if not scfg.is_loopback and not scfg.api_key:
        print("warning: serving off loopback without --api-key; /update_weights is refused", file=sys.stderr)
    uvicorn.run(build_app(engine, scfg, name), host=scfg.host, port=scfg.port, log_level="warning")


def cmd_route(args) -> None:
    import uvicorn

    from rollwise.router.proxy import build_router_app
    from rollwise.router.replica import HttpReplica
    from rollwise.router.router import Router
    tok = None
    if args.tokenizer:
        from rollwise.engine.tokenizer import Tokenizer
        tok = Tokenizer(args.tokenizer)
    router = Router([HttpReplica(u, args.replica_api_key) for u in args.replica], args.policy, tokenizer=tok,
                    max_inflight_per_replica=args.max_inflight_per_replica)
    scfg = config_from_args(ServerConfig, args)
    print(f"routing to {len(args.replica)} replica(s) by policy {args.policy!r} on http://{scfg.host}:{scfg.port}"
          + ("" if args.replica else '; none yet: POST /replicas {"url": ...} adds one'), file=sys.stderr, flush=True)
    if not scfg.is_loopback and not scfg.api_key:
        print("warning: routing off loopback without --api-key; its control endpoints (weight updates, replica "
              "changes, pause) are refused", file=sys.stderr)
    uvicorn.run(build_router_app(router, scfg, args.replica_api_key), host=scfg.host, port=scfg.port,
                log_level="warning")


def cmd_retrieve(args) -> None:
    import uvicorn

    from rollwise.agent.search import SearchIndex
    from rollwise.serve.retrieve import build_retrieve_app
    index = SearchIndex.for_corpus(args.corpus, args.index)
    print(f"{index.size:,} documents from {args.corpus}; serving Search-R1's POST /retrieve on "
          f"http://{args.host}:{args.port}/retrieve", flush=True)
    uvicorn.run(build_retrieve_app(index, args.api_key), host=args.host, port=args.port, log_level="warning")


def cmd_bench_spec(args) -> None:
    from rollwise.spec.bench import main as bench_main
    bench_main(args)


def cmd_demo(args) -> None:
    """The main job on a tiny local model: SFT warm start on the phonebook environment's
    transcripts, then asynchronous GRPO (staleness 1, the reproducible lockstep pipeline: the same
    seed gives the same weights) with 2 in-process replicas behind the router, suffix speculation
    and weight sync after every step; evaluation on held-out tasks before and after RL. Last line:
    sft_success=<f> rl_success=<f>."""
    from rollwise.rl import TrainConfig, train
    size = DEMO_SMOKE if args.smoke else DEMO_QUICK if args.quick else DEMO_FULL
    cfg = TrainConfig.from_dict({"model": demo_model(), "seed": args.seed, "env": "phonebook", "sft_cache": DEMO_SFT_CACHE,
                                 "run_dir": args.run_dir or f"runs/demo-{'quick' if args.quick else 'full'}-{args.seed}", **size,
                                 **_overrides(args.set)})
    if Path(cfg.run_dir).exists() and not args.resume:
        import shutil
        shutil.rmtree(cfg.run_dir)  # a fresh run unless --resume
    t0 = time.perf_counter()
    report = train(cfg)
    print(f"report: {cfg.run_dir}/report (metrics.json, curves.png); {len(report['steps'])} GRPO steps, policy version "
          f"{report['policy_version']}, {time.perf_counter() - t0:.0f}s")
    print(f"sft_success={report['sft_success']:.3f} rl_success={report['rl_success']:.3f}")


def cmd_train(args) -> None:
    from rollwise.rl import TrainConfig, train
    cfg = TrainConfig.from_toml(args.config, **_overrides(args.set))
    report = train(cfg)
    shown = {k: "none (no evaluation tasks)" if report[k] is None else f"{report[k]:.3f}" for k in ("sft_success", "rl_success")}
    print(" ".join(f"{k}={v}" for k, v in shown.items()))


def cmd_eval(args) -> None:
    from rollwise.evaluation import evaluate_model
    from rollwise.rl import TrainConfig
    cfg = TrainConfig.from_toml(args.config, **_overrides(args.set))
    report = evaluate_model(cfg, samples=args.samples, temperature=args.temperature, out=args.out)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    print(json.dumps(report))


def cmd_sim(args) -> None:
    """The cluster simulator: the WAR sweep (every configuration at every load) on modeled replicas
    driven by the real router policies and speculation controllers."""
    from rollwise.sim import sweep
    from rollwise.sim.run import SimConfig
    overrides = _overrides(args.set)
    if args.config:
        cfg = SimConfig.from_toml(args.config, overrides)
    else:
        cfg = SimConfig.from_toml_text("", overrides)
    result = sweep.sweep(cfg, jobs=args.jobs)
    sweep.write(result, args.json, args.plot)
    print(sweep.table(result))
    sp = sweep.speedups(result)
    if "rollwise" in sp:
        print("rollwise speedup per load: " + " ".join(f"{p}:{v:.2f}" for p, v in sorted(sp["rollwise"].items())))


def _overrides(pairs: list[str]) -> dict:
    """`--set KEY=VALUE` options as config keys, each value read as TOML (else as a string)."""
    bad = [kv for kv in pairs if "=" not in kv]
    if bad:
        raise ValueError(f"--set takes KEY=VALUE, got {bad[0]!r}")
    return {k: _parse_value(v) for k, v in (kv.split("=", 1) for kv in pairs)}


def _parse_value(v: str):
    import tomllib
    try:
        return tomllib.loads(f"x = {v}")["x"]
    except tomllib.TOMLDecodeError:
        return v


def _policy_names() -> list[str]:
    from rollwise.router.policies import POLICIES
    return list(POLICIES)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="rollwise", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("make-model", help="create a random-initialised model + local tokenizer")
    p.add_argument("out_dir")
    p.add_argument("--family", choices=["llama", "qwen2", "qwen3", "qwen3_moe"], default="llama")
    for name, default in (("layers", 2), ("hidden", 128), ("heads", 4), ("kv-heads", 2), ("vocab", 2048),
                          ("max-positions", 4096), ("seed", 0), ("experts", 8), ("experts-per-token", 2)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--intermediate", type=int, default=None)
    p.add_argument("--moe-intermediate", type=int, default=None, help="qwen3_moe: each expert's (default hidden / 2)")
    p.add_argument("--init-std", type=float, default=0.02)
    p.add_argument("--tie", action="store_true", help="tie input and output embeddings")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--tool-tokens", choices=["kimi_k2", "deepseek_v31", "deepseek_v3", "mistral"], default=None,
                   help="the tokenizer gets this tool-call format's markup as special tokens, as its models' have")
    p.set_defaults(fn=cmd_make_model)

    p = sub.add_parser("generate", help="generate from prompts on the engine")
    p.add_argument("model")
    add_config_args(p, EngineConfig, skip=("model",))
    p.add_argument("--prompt", action="append", required=True)
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat message")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--sample-seed", type=int, default=None)
    p.add_argument("--sampling", default="{}", help='more SamplingParams fields as JSON, e.g. '
                   '\'{"top_p": 0.9, "repetition_penalty": 1.1, "logit_bias": {"7": -100}}\'')
    p.set_defaults(fn=cmd_generate)

    p = sub.add_parser("serve", help="HTTP server (OpenAI-compatible + /generate + /metrics)")
    p.add_argument("model", nargs="?", help="the model directory (or --model-path)")
    add_config_args(p, EngineConfig, skip=("model",), more_choices={"dtype": ("auto", "half", "float")})
    add_config_args(p, ServerConfig, more_choices={k: tuple(v) for k, v in PARSER_ALIASES.items()})
    add_launch_args(p)
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters (peft directories) to serve from the start, each by its name (with --enable-lora)")
    p.set_defaults(fn=cmd_serve)

    p = sub.add_parser("route", help="one HTTP endpoint in front of several `rollwise serve` replicas")
    p.add_argument("--replica", action="append", default=[], help="replica URL (repeat)")
    p.add_argument("--policy", default="rollwise", choices=sorted(_policy_names()),
                   help="how each request picks its replica (default: rollwise, cache- and load-aware)")
    p.add_argument("--tokenizer", help="model directory, to accept text prompts on /v1/completions")
    p.add_argument("--max-inflight-per-replica", type=int, default=64,
                   help="requests sent to one replica at once; more wait at the route (default: 64)")
    p.add_argument("--replica-api-key", default=None, help="the bearer key the replicas require, if any")
    add_config_args(p, ServerConfig)
    p.set_defaults(fn=cmd_route)

    p = sub.add_parser("retrieve", help="a BM25 retrieval server over a JSON-lines corpus (Search-R1's /retrieve)")
    p.add_argument("corpus", help='JSON lines: {"id", "title", "text"} or Search-R1\'s {"id", "contents"}')
    p.add_argument("--index", help="the sqlite index file (default: in ~/.cache/rollwise/search, built once)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require this bearer key (/health stays open)")
    p.set_defaults(fn=cmd_retrieve)

    p = sub.add_parser("bench", help="built-in benchmarks")
    bsub = p.add_subparsers(dest="bench", required=True)
    b = bsub.add_parser("spec", help="offline drafting replay on agent trajectories (no model)")
    b.add_argument("--data", default=None, help="trajectories JSONL (default: ../shared's public.jsonl)")
    b.add_argument("--tokenizer", required=True, help="model directory whose tokenizer to use")
    b.add_argument("--group-size", type=int, default=1, help="replay this many trials of a task as siblings")
    b.add_argument("--limit", type=int, default=None, help="first N trajectories only")
    b.add_argument("--max-depth", type=int, default=24)
    b.add_argument("--max-spec-tokens", type=int, default=16)
    b.add_argument("--alpha", type=float, default=1.0)
    b.add_argument("--min-token-prob", type=float, default=0.1)
    b.add_argument("--lookup", default="5:5,2:5,1:3",
                   help="prompt lookup's (vLLM's ngram) n-gram lengths min:max, comma-separated rows ('' for none)")
    b.add_argument("--no-arctic", action="store_true", help="no peers' rows (ArcticInference, vLLM's lookup)")
    b.add_argument("--json")
    b.set_defaults(fn=cmd_bench_spec)

    p = sub.add_parser("demo", help="the main job: SFT + asynchronous GRPO on a tiny local model")
    p.add_argument("--quick", action="store_true",
                   help="a 1,000-step warm start and 30 GRPO steps: under 3 minutes (about 30 s once the warm "
                        "start is cached)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", default=None)
    p.add_argument("--resume", action="store_true", help="continue the run in --run-dir instead of starting over")
    p.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)  # seconds-long run for tests
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key of the demo's run (TrainConfig's fields)")
    p.set_defaults(fn=cmd_demo)

    p = sub.add_parser("train", help="agentic RL from a TOML config (keys: rollwise.rl.TrainConfig's fields)")
    p.add_argument("config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.set_defaults(fn=cmd_train)

    p = sub.add_parser("eval", help="a model on a config's held-out tasks: success, pass@k, every transcript")
    p.add_argument("config", help="a `rollwise train` TOML (model, env, eval tasks, fleet); --set model=DIR picks the model")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--samples", type=int, default=1, help="episodes per task (pass@k with k = samples)")
    p.add_argument("--temperature", type=float, default=None, help="default: the config's rollout temperature; 0: greedy")
    p.add_argument("--out", help="write every episode (reward, status, transcript) as JSON lines")
    p.add_argument("--json", help="write the summary")
    p.set_defaults(fn=cmd_eval)

    p = sub.add_parser("sim", help="cluster simulator: the WAR sweep on modeled GPUs with the real policies")
    p.add_argument("--config", help="TOML with rollwise.sim.run.SimConfig's fields (default: WAR's setting)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--json", help="write {loads: {P: {CONFIG: {makespan_s, decode_tokens, prefill_tokens, ...}}}}")
    p.add_argument("--plot", help="write a PNG of speedup vs load")
    p.add_argument("--jobs", type=int, default=1, help="simulations run at once, each in its own process (same results)")
    p.set_defaults(fn=cmd_sim)

    args = ap.parse_args(argv)
    try:
        args.fn(args)
    except ValueError as e:
        ap.exit(2, f"rollwise {args.cmd}: error: {e}\n")


if __name__ == "__main__":
    main()
