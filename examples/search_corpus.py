"""Write the `search` env's world as one corpus and a task file, in the formats Search-R1 uses, to
train or evaluate through a retrieval server (`rollwise retrieve`) instead of per-task pages:

    python examples/search_corpus.py runs/search-corpus
    rollwise retrieve runs/search-corpus/corpus.jsonl --port 8100 &
    rollwise eval examples/train-search-corpus.toml --set model=runs/search/final-model

corpus.jsonl: Search-R1's {"id", "contents": '"Title"\\ntext'}, one page per person (all 320 of the
env's names; 128 founded a company, the rest are pilots, chemists, ... with no company) and one
per company (128, each in one of 16 cities); one question per founder, {"id", "prompt", "answer",
"solution"} (the expert's two searches and the city, for a warm start): train.jsonl 96 of them,
eval.jsonl the other 32. `--protocol search_r1`: the questions as Search-R1's files have them,
{"id", "question", "golden_answers"}, and the expert's searches and answer in its tags
(`<search> name </search>`, `<answer> city </answer>`), for `examples/train-search-r1.toml`.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from rollwise.agent.envs.phonebook import FIRST, LAST
from rollwise.agent.envs.search import BRAND, CITIES, KIND, ROLES, TRADES


def world(seed: int, protocol: str = "tools") -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    people = [f"{f} {s}" for f in FIRST for s in LAST]
    companies = [f"{b} {k}" for b in BRAND for k in KIND]
    rng.shuffle(people)
    rng.shuffle(companies)
    founders = dict(zip(people, companies))  # the first 128 people founded one company each
    city = {c: rng.choice(CITIES) for c in companies}
    pages, tasks = [], []
    for p in people:
        c = founders.get(p)
        text = f"{p} is {rng.choice(ROLES)}" + (f" who founded {c} in {rng.randint(1950, 2020)}." if c else ".")
        pages.append((p, text))
    pages += [(c, f"{c} is {rng.choice(TRADES)} company based in {city[c]}.") for c in companies]
    rng.shuffle(pages)
    corpus = [{"id": str(i), "contents": f'"{title}"\n{text}'} for i, (title, text) in enumerate(pages)]
    for i, (p, c) in enumerate(founders.items()):
        question = f"Which city is the company founded by {p} based in?"
        if protocol == "search_r1":
            tasks.append({"id": f"corpus-{i}", "question": question, "golden_answers": [city[c]],
                          "solution": [f"<search> {p} </search>", f"<search> {c} </search>",
                                       f"<answer> {city[c]} </answer>"]})
            continue
        calls = [json.dumps({"name": "search", "arguments": {"query": q}}) for q in (p, c)]
        tasks.append({"id": f"corpus-{i}", "prompt": question, "answer": city[c],
                      "solution": [f"<tool_call>\n{x}\n</tool_call>" for x in calls] + [city[c]]})
    return corpus, tasks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--protocol", choices=["tools", "search_r1"], default="tools",
                    help="the questions' layout and the expert's actions: tool calls (the dataset env) or Search-R1's "
                         "tags (the search_r1 env)")
    args = ap.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    corpus, tasks = world(args.seed, args.protocol)
    for name, rows in (("corpus.jsonl", corpus), ("train.jsonl", tasks[:96]), ("eval.jsonl", tasks[96:])):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(corpus)} pages in {out / 'corpus.jsonl'}; questions: 96 in train.jsonl, {len(tasks) - 96} in "
          f"eval.jsonl")


if __name__ == "__main__":
    main()
