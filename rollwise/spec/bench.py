"""`rollwise bench spec`: drafting acceptance and cost on recorded agent trajectories, side by side
with ArcticInference's SuffixDecodingCache when the peers venv has it (same token ids, same
parameters), and prompt lookup (vLLM's "ngram" speculation: ours, and vLLM's own function when the
peers venv has vLLM) as the baseline without suffix trees. No model runs: see `rollwise.spec.replay`."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from rollwise.spec.replay import ReplayParams

PEERS = Path(os.environ.get("ROLLWISE_PEERS", Path.home() / ".cache" / "rollwise-peers"))


def default_data() -> str:
    """The public agent trajectories: $ROLLWISE_TRAJECTORIES, else ../shared beside the checkout."""
    env = os.environ.get("ROLLWISE_TRAJECTORIES")
    path = Path(env) if env else Path(__file__).resolve().parents[3] / "shared" / "data" / "agent-trajectories" / "public.jsonl"
    if not path.exists():
        raise ValueError(f"no trajectories at {path}: pass --data or set ROLLWISE_TRAJECTORIES")
    return str(path)


def load_groups(data: str | None, tokenizer_dir: str, group_size: int, limit: int | None,
                system_chars: int | None = None) -> list:
    """Sibling sets of tokenized trajectories: up to `group_size` trials of each task together (all
    trials of a task when group_size is 1, one after another); `limit`: that many trajectories."""
    from rollwise.engine.tokenizer import Tokenizer
    tok = Tokenizer(tokenizer_dir)
    by_task: dict[str, list] = defaultdict(list)
    rows = [json.loads(line) for line in Path(data or default_data()).read_text().splitlines() if line.strip()]
    rows.sort(key=lambda r: r["id"])  # task-major: the trials of a task are neighbours
    for row in rows[:limit]:
        task = row["id"].rsplit("/", 1)[0] if group_size > 1 else row["id"]
        msgs = [dict(m, content=m["content"][:system_chars]) if m["role"] == "system" and system_chars else m
                for m in row["turns"]]
        turns = []
        for i, m in enumerate(msgs):
            if m["role"] == "assistant" and m["content"]:
                prompt = tok.encode_chat([{"role": x["role"], "content": x["content"]} for x in msgs[:i]])
                turns.append((prompt, tok.encode(m["content"], add_special_tokens=False)))
        if turns and len(by_task[task]) < group_size:
            by_task[task].append(turns)
    return list(by_task.values())


def arctic_python() -> str | None:
    return peers_python("import arctic_inference.suffix_decoding")


def peers_python(check: str) -> str | None:
    """The peers venv's Python, if it runs `check`."""
    py = PEERS / "bin" / "python"
    if not py.exists() or subprocess.run([str(py), "-c", check], capture_output=True).returncode:
        return None
    return str(py)


def run_replay(python: str, adapter: str, groups, p: ReplayParams) -> dict:
    """One replay in a fresh process of `python` (ours, or the peers venv's for arctic)."""
    with tempfile.TemporaryDirectory() as d:
        inp, out = Path(d, "in.json"), Path(d, "out.json")
        inp.write_text(json.dumps({"params": dataclasses.asdict(p), "groups": groups}))
        root = Path(__file__).resolve().parents[2]
        env = dict(os.environ, PYTHONPATH=str(root))
        subprocess.run([python, "-m", "rollwise.spec.replay", adapter, str(inp), str(out)], check=True, env=env)
        return json.loads(out.read_text())


def main(args) -> dict:
    groups = load_groups(args.data, args.tokenizer, args.group_size, args.limit)
    n_tok = sum(len(r) for sib in groups for traj in sib for _, r in traj)
    print(f"{sum(len(s) for s in groups)} trajectories in {len(groups)} groups of up to {args.group_size}, "
          f"{sum(len(t) for s in groups for t in s)} assistant turns, {n_tok} response tokens")
    results: dict = {}
    arctic = None if args.no_arctic else arctic_python()
    for tree in (False, True):
        p = ReplayParams(max_depth=args.max_depth, max_spec_tokens=args.max_spec_tokens, alpha=args.alpha,
                         min_token_prob=args.min_token_prob, tree=tree)
        kind = "tree" if tree else "chain"
        if arctic:
            results[f"arctic/{kind}"] = run_replay(arctic, "arctic", groups, p)
        for name in ("rollwise", "rollwise+group"):
            results[f"{name}/{kind}"] = run_replay(sys.executable, name, groups, p)
    lookups = [tuple(int(x) for x in pair.split(":")) for pair in args.lookup.split(",")] if args.lookup else []
    vllm = peers_python("import vllm.v1.spec_decode.ngram_proposer") if lookups and not args.no_arctic else None
    for lo, hi in lookups:  # prompt lookup drafts chains from the request's own context
        p = ReplayParams(max_depth=args.max_depth, max_spec_tokens=args.max_spec_tokens, lookup_min=lo, lookup_max=hi)
        results[f"ngram {lo}:{hi}/chain"] = run_replay(sys.executable, "ngram", groups, p)
        if vllm:
            results[f"vllm-ngram {lo}:{hi}/chain"] = run_replay(vllm, "vllm-ngram", groups, p)
    print(f"\n{'cache/draft':<24}{'accepted/step':>14}{'tokens/step':>12}{'us/speculate':>14}"
          f"{'us/append tok':>15}{'us/prompt tok':>15}{'RSS MB':>8}")
    for name, r in results.items():
        print(f"{name:<24}{r['mean_accepted_per_step']:>14.3f}{r['tokens_per_step']:>12.3f}{r['us_per_speculate']:>14.1f}"
              f"{r['us_per_appended_token']:>15.2f}{r['us_per_prompt_token']:>15.2f}{r['rss_growth_mb']:>8.0f}")
    for kind in ("chain", "tree"):
        a = results.get(f"arctic/{kind}")
        if a:
            r, g = results[f"rollwise/{kind}"], results[f"rollwise+group/{kind}"]
            print(f"{kind}: acceptance vs arctic {r['mean_accepted_per_step'] / a['mean_accepted_per_step']:.3f}x "
                  f"(group trees {g['mean_accepted_per_step'] / a['mean_accepted_per_step']:.3f}x), "
                  f"speculate cost {r['us_per_speculate'] / a['us_per_speculate']:.2f}x arctic's")
    for lo, hi in lookups:
        r, v = results[f"ngram {lo}:{hi}/chain"], results.get(f"vllm-ngram {lo}:{hi}/chain")
        ratio = results["rollwise/chain"]["mean_accepted_per_step"] / max(r["mean_accepted_per_step"], 1e-9)
        print(f"prompt lookup {lo}:{hi}: suffix trees (chain) accept {ratio:.2f}x as many per step"
              + (f"; vLLM's own lookup accepts {v['accepted']} tokens, ours {r['accepted']}" if v else ""))
    out = {"params": {"max_depth": args.max_depth, "max_spec_tokens": args.max_spec_tokens, "alpha": args.alpha,
                      "min_token_prob": args.min_token_prob, "group_size": args.group_size,
                      "lookup": args.lookup},
           "response_tokens": n_tok, "results": results}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return out
