"""Write a built-in env's questions as a task file for the inline envs, with the expert's transcripts
(for the warm start) in the protocol's own tags:

    python examples/task_files.py search_r1 runs/search-r1-tasks   # examples/train-search-r1.toml
    python examples/task_files.py retool runs/code-tasks           # examples/train-code-inline.toml

`search_r1`: the `search` env's two-hop questions as Search-R1's files have them, {"id", "question",
"golden_answers"}, each task carrying its own eight pages in "docs" (HotpotQA's distractor setting),
the solution the expert's two `<search>`es and its `<answer>`. `retool`: the `code` env's questions,
{"id", "question", "answer"}, the solution the expert's program between `<code>` and `</code>`, then
the answer as `\\boxed{N}`. train.jsonl: `--train` tasks (default 8192 and 4096), eval.jsonl: `--eval`
others (200, drawn with another seed).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from rollwise.agent.envs import make_env
from rollwise.agent.envs.code import FAMILIES


def search_r1(n: int, seed: int) -> list[dict]:
    env = make_env("search")
    return [{"id": f"search-r1-{seed}-{i}", "question": env.prompt(t), "golden_answers": [t["answer"]],
             "docs": t["docs"], "solution": [f"<search> {t['person']} </search>", f"<search> {t['company']} </search>",
                                             f"<answer> {t['answer']} </answer>"]}
            for i, t in enumerate(env.sample_tasks(n, seed))]


def retool(n: int, seed: int) -> list[dict]:
    return [{"id": f"code-inline-{seed}-{i}", "question": t["question"], "answer": t["answer"],
             "solution": [f"<code>\n{FAMILIES[t['family']][1].format(**t['params'])}\n</code>",
                          f"\nThe answer is \\boxed{{{t['answer']}}}."]}
            for i, t in enumerate(make_env("code").sample_tasks(n, seed))]


LAYOUTS = {"search_r1": (search_r1, 8192), "retool": (retool, 4096)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("layout", choices=sorted(LAYOUTS))
    ap.add_argument("out_dir")
    ap.add_argument("--train", type=int, help="training tasks (default: 8192 for search_r1, 4096 for retool)")
    ap.add_argument("--eval", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    make, default_train = LAYOUTS[args.layout]
    n_train = default_train if args.train is None else args.train
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train.jsonl", make(n_train, args.seed)), ("eval.jsonl", make(args.eval, args.seed + 1))):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{n_train} questions in {out / 'train.jsonl'}, {args.eval} in {out / 'eval.jsonl'}")


if __name__ == "__main__":
    main()
