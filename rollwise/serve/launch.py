"""`rollwise serve`'s launch lines from other engines: `vllm serve`'s flags and SGLang's
(`python -m sglang.launch_server`'s) where they agree with this engine, checked as `LLM(...)` and
`SGLangEngine(...)` check them (peer_args.engine_args, peer_args.sglang_args), so that an RL framework's
launch line for either serves as written."""
from __future__ import annotations

import argparse
import dataclasses
import json

from rollwise.config import EngineConfig
from rollwise.peer_args import (SGLANG_ARGS, SGLANG_NAMES, SGLANG_SPECIAL, VLLM_ARGS, engine_args, sglang_args,
                                speculative_args)

# SGLang's flags that are ours or vLLM's already (the same meaning), so not added twice
_SHARED = {"trust_remote_code", "skip_tokenizer_init", "host", "port", "model_path"}
# SGLang's names of tool-call and reasoning formats that have another name here (vLLM's)
PARSER_ALIASES = {"tool_call_parser": {"qwen25": "hermes", "qwen": "hermes", "llama3": "llama3_json",
                                       "deepseekv3": "deepseek_v3", "deepseekv31": "deepseek_v31"},
                  "reasoning_parser": {"deepseek-r1": "deepseek_r1"}}


def add_launch_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("vLLM's flags, where they agree with this engine")
    for name, ok in VLLM_ARGS.items():
        flag = "--" + name.replace("_", "-")
        if all(v is None or isinstance(v, bool) for v in ok):
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        elif any(isinstance(v, str) for v in ok):
            g.add_argument(flag, default=None, choices=[v for v in ok if v is not None], help="(these only here)")
        else:
            g.add_argument(flag, type=int, default=None, help=f"(only {ok[0]} here)")
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="(on the CPU; the KV pool is --kv-cache-gb)")
    g.add_argument("--served-model-name", nargs="+", default=None, help="= --model-name (one name here)")
    g.add_argument("--weight-transfer-config", type=json.loads, default=None,
                   help='vLLM 0.32\'s weight transfer: {"backend": "gloo"} here (always on; nccl and ipc need GPUs)')
    g.add_argument("--speculative-config", type=json.loads, default=None,
                   help='vLLM\'s, for its methods with no draft model: {"method": "ngram", '
                        '"num_speculative_tokens": 5, "prompt_lookup_max": 4} or {"method": "suffix"} '
                        '(= --speculative and the --spec-* flags)')
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="(tool calls are always parsed, by --tool-call-parser: hermes unless given)")
    g.add_argument("--disable-log-requests", action="store_true", help="(requests are not logged here)")

    g = p.add_argument_group("SGLang's flags, where they agree with this engine")
    g.add_argument("--model-path", default=None, help="= the model directory")
    types = {f.name: f.type for f in dataclasses.fields(EngineConfig)}
    for name, ours in SGLANG_NAMES.items():
        if name in _SHARED:
            continue
        kind = types.get(ours, "float")  # (mem_fraction_static: a fraction)
        if kind == "bool":
            g.add_argument("--" + name.replace("_", "-"), action="store_const", const=True, default=None,
                           help=f"= --{ours.replace('_', '-')}")
        else:
            g.add_argument("--" + name.replace("_", "-"), type=int if "int" in str(kind) else float, default=None,
                           help=f"= --{ours.replace('_', '-')}")
    g.add_argument("--disable-radix-cache", action="store_const", const=True, default=None,
                   help="= --no-enable-prefix-caching")
    g.add_argument("--speculative-algorithm", default=None, metavar="NGRAM",
                   help="NGRAM = --speculative suffix (no draft model: EAGLE, MTP and the rest are not taken)")
    for name, ok in SGLANG_ARGS.items():
        if name in _SHARED:
            continue
        flag = "--" + name.replace("_", "-")
        if ok is not None and all(isinstance(v, bool) for v in ok):
            g.add_argument(flag, action="store_const", const=True, default=None, help="(no work to do here)")
        else:
            conv = int if ok is not None and isinstance(ok[0], int) or name.endswith(("_id", "_step")) else str
            g.add_argument(flag, type=conv, default=None,
                           help="(any value: nothing to choose here)" if ok is None else f"(only {ok[0]} here)")
    g.add_argument("--lora-paths", nargs="+", default=None, metavar="NAME=PATH", help="= --lora-modules")


def launch_args(args: argparse.Namespace) -> None:
    """`args` with vLLM's and SGLang's flags checked and folded into ours: the model (positional or
    --model-path), dtype names, the served model's name, SGLang's names for our fields (ValueError if
    one disagrees with ours given too), its LoRA adapters."""
    if args.model_path is not None and args.model not in (None, args.model_path):
        raise ValueError("give the model once (a directory, or --model-path)")
    args.model = args.model or args.model_path
    for k, aliases in PARSER_ALIASES.items():
        setattr(args, k, aliases.get(getattr(args, k), getattr(args, k)))
    if not args.model:
        raise ValueError("give the model directory (or --model-path)")
    vllm = {k: getattr(args, k) for k in (*VLLM_ARGS, "gpu_memory_utilization", "weight_transfer_config")
            if getattr(args, k) is not None}
    args.dtype = engine_args({"dtype": args.dtype, "device": args.device, **vllm}, args.model)["dtype"]
    if args.served_model_name:
        if len(args.served_model_name) > 1 or args.model_name not in (None, args.served_model_name[0]):
            raise ValueError("give the model one name here (--served-model-name or --model-name)")
        args.model_name = args.served_model_name[0]
    names = [k for k in (*SGLANG_NAMES, *SGLANG_ARGS, *SGLANG_SPECIAL) if k not in _SHARED]
    given = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
    _, ours = sglang_args({**given, "model_path": args.model, "device": args.device})
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    for k, v in ours.items():
        if getattr(args, k) not in (defaults[k], v):
            raise ValueError(f"--{k.replace('_', '-')} and its SGLang name disagree ({getattr(args, k)!r}, {v!r})")
        setattr(args, k, v)
    for k, v in speculative_args(args.speculative_config).items():
        if getattr(args, k) not in (defaults[k], v):
            raise ValueError(f"--{k.replace('_', '-')} and --speculative-config disagree ({getattr(args, k)!r}, {v!r})")
        setattr(args, k, v)
    if args.lora_paths:
        from rollwise.serve.sglang_engine import lora_paths
        args.lora_modules = [*args.lora_modules, *(f"{n}={p}" for n, p in lora_paths(args.lora_paths))]
