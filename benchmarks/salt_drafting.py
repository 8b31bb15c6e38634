"""What cache salts cost SuffixDecoding, and what a global tree per salt gives back.

A salted request (vLLM's `cache_salt`: a tenant's) must not draft from other salts' text. Offline
replay of the public tau-bench trajectories (no model: rollwise.spec.replay; a greedy verifier
accepts the drafted path that matches the recorded turn), the tasks dealt round-robin to K
tenants, each task's trials as concurrent siblings (a GRPO group). Three ways, the same turns:
- shared: no salts; every request drafts from one global tree (what a salt must forbid);
- per salt: each tenant's requests draft from their own global tree (`SuffixCache(scope=...)`);
- none: no global tree at all, the request's own context and its group's only (a salted request's
  drafting before per-salt trees).
Reported: tokens accepted per verification step (the drafting speed-up's driver) and their ratios.

    python benchmarks/salt_drafting.py [--smoke] [--tenants 1,5,25] --json results/salt_drafting.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import engine_model, write_json  # noqa: E402

from rollwise.spec.bench import load_groups  # noqa: E402
from rollwise.spec.replay import ReplayParams, RollwiseAdapter, replay  # noqa: E402


class Tenants(RollwiseAdapter):
    """Each group's requests under the salt of its tenant (`group` is "g<index>": tasks round-robin)."""

    def __init__(self, p: ReplayParams, tenants: int) -> None:
        super().__init__(p, use_group_tree=True)
        self.tenants = tenants

    def start(self, rid, prompt, group):
        self.cache.start_request(rid, prompt, group, scope=f"tenant-{int(group[1:]) % self.tenants}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", default=None, help="a model directory (default: the engine benchmarks' bench model)")
    ap.add_argument("--data", default=None, help="agent trajectories (default: ../shared's tau-bench corpus)")
    ap.add_argument("--group-size", type=int, default=4, help="trials of a task run as concurrent siblings")
    ap.add_argument("--tenants", default="1,5,25", help="salts the tasks are dealt to, one run each")
    ap.add_argument("--limit", type=int, default=None, help="that many trajectories")
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="the smoke tokenizer and 16 trajectories (for the tests)")
    args = ap.parse_args()
    if args.smoke:
        args.limit, args.tenants = 16, "1,2"
    groups = load_groups(args.data, engine_model("smoke" if args.smoke else "bench", args.tokenizer),
                         args.group_size, args.limit)
    turns = sum(len(t) for s in groups for t in s)
    tokens = sum(len(r) for s in groups for t in s for _, r in t)
    print(f"{sum(map(len, groups))} trajectories of {len(groups)} tasks, {turns} assistant turns, {tokens} tokens")
    p = ReplayParams()
    runs = {"shared": replay(RollwiseAdapter(p, use_group_tree=True), groups),
            "none": replay(RollwiseAdapter(ReplayParams(max_cached_requests=0), use_group_tree=True), groups)}
    for k in (int(x) for x in args.tenants.split(",")):
        runs[f"per_salt/{k}"] = replay(Tenants(p, k), groups)
    out = {"config": vars(args), "trajectories": sum(map(len, groups)), "turns": turns, "response_tokens": tokens,
           "runs": runs}
    none, shared = runs["none"]["mean_accepted_per_step"], runs["shared"]["mean_accepted_per_step"]
    print(f"{'drafting from':<18}{'accepted/step':>14}{'tokens/step':>12}{'vs none':>9}{'vs shared':>11}{'steps':>9}")
    for name, r in runs.items():
        a = r["mean_accepted_per_step"]
        print(f"{name:<18}{a:>14.3f}{r['tokens_per_step']:>12.3f}{a / none:>8.3f}x{a / shared:>10.3f}x{r['steps']:>9}")
    write_json(args.json, out)


if __name__ == "__main__":
    main()
