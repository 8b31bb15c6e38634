"""Write the `search` env's questions as a Search-R1 question file whose tasks carry their own
documents (HotpotQA's distractor setting), for the `search_r1` env with `search = { task_docs =
"docs" }` (examples/train-search-r1.toml):

    python examples/search_tasks.py runs/search-r1-tasks

train.jsonl: 8192 tasks (`--train`), eval.jsonl: 200 others (`--eval`, drawn with another seed), each
{"id", "question", "golden_answers", "docs": [{"id", "title", "text"}, ...] (the task's eight pages),
"solution"}; the solution is the expert's two searches and its answer in Search-R1's tags.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from rollwise.agent.envs import make_env


def tasks(n: int, seed: int) -> list[dict]:
    env = make_env("search")
    return [{"id": f"search-r1-{seed}-{i}", "question": env.prompt(t), "golden_answers": [t["answer"]],
             "docs": t["docs"],
             "solution": [f"<search> {t['person']} </search>", f"<search> {t['company']} </search>",
                          f"<answer> {t['answer']} </answer>"]}
            for i, t in enumerate(env.sample_tasks(n, seed))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--train", type=int, default=8192)
    ap.add_argument("--eval", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train.jsonl", tasks(args.train, args.seed)), ("eval.jsonl", tasks(args.eval, args.seed + 1))):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{args.train} questions in {out / 'train.jsonl'}, {args.eval} in {out / 'eval.jsonl'}")


if __name__ == "__main__":
    main()
