"""Write the `code` env's questions as a task file for the `inline` env in ReTool's layout (the model
writes a program between <code> and </code>, reads its output between <interpreter> and
</interpreter> in the same message, and ends with \\boxed{answer}): examples/train-code-inline.toml.

    python examples/code_tasks.py runs/code-tasks

train.jsonl: 4096 tasks (`--train`), eval.jsonl: 200 others (`--eval`, drawn with another seed), each
{"id", "question", "answer", "solution"}; the solution is the expert's program and its answer.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from rollwise.agent.envs import make_env
from rollwise.agent.envs.code import FAMILIES


def tasks(n: int, seed: int) -> list[dict]:
    return [{"id": f"code-inline-{seed}-{i}", "question": t["question"], "answer": t["answer"],
             "solution": [f"<code>\n{FAMILIES[t['family']][1].format(**t['params'])}\n</code>",
                          f"\nThe answer is \\boxed{{{t['answer']}}}."]}
            for i, t in enumerate(make_env("code").sample_tasks(n, seed))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--train", type=int, default=4096)
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
