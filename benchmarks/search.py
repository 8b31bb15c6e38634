"""What the search tool costs, and what sharing requests buys: concurrent episodes' searches through a
`rollwise retrieve` server (a subprocess on 127.0.0.1), one request per query (the baseline) against
the default, where queries waiting for a request slot leave together; the index in process beside
them (identical queries not joined here: the stream repeats some). Sides take turns within each
repetition; every side must return the same hits. Then GRPO groups: 8 samples of a task each search
the task's question first, then two queries of their own, with identical queries out at once
joined (the default) or not. Then a trainer's whole batch in requests of 512 queries (Search-R1's and
verl's one call per batch), which the server runs in a thread per core, against the same queries one
after another in process.

    python benchmarks/search.py [--concurrency 1,16,64,256] [--repeats 3] [--smoke] [--json PATH]

Corpus: the text of every message of the public tau-bench trajectories (../shared/data/agent-
trajectories, one page per message, its trajectory and turn as the title); queries: the first
eight words of each user message, every episode searching its own slice of them in turn.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from rollwise.agent.search import RemoteSearch, SearchIndex
from rollwise.serve.process import free_port
from common import write_json  # (benchmarks/common.py)

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "agent-trajectories" / "public.jsonl"


def corpus_and_queries(path: Path, out: Path, limit: int | None) -> list[str]:
    """Writes the corpus (JSON lines) to `out`; returns the queries."""
    rows, queries = [], []
    with open(path) as f:
        for line in list(f)[:limit]:
            traj = json.loads(line)
            for i, m in enumerate(traj["turns"]):
                if m["content"].strip():
                    rows.append({"id": f"{traj['id']}/{i}", "title": f"{traj['id']} turn {i} ({m['role']})",
                                 "text": m["content"]})
                words = m["content"].split()[:8]
                if m["role"] == "user" and len(words) >= 3:
                    queries.append(" ".join(words))
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return queries


async def run_side(search, queries: list[str], concurrency: int, k: int) -> tuple[float, list]:
    """Seconds for `concurrency` episodes to run every query (each its own share, one after another)."""
    async def episode(mine: list[str]) -> list:
        return [[h.id for h in await search(q, k)] for q in mine]
    t0 = time.perf_counter()
    parts = await asyncio.gather(*(episode(queries[i::concurrency]) for i in range(concurrency)))
    return time.perf_counter() - t0, parts


async def groups(url: str, base: list[str], n_groups: int, repeats: int, k: int, size: int = 8) -> dict:
    """GRPO groups: every sample of a group searches its task's question, then two queries of its own,
    all groups at once; identical queries out at once joined (the default) against not."""
    streams = [[base[g % len(base)], base[(n_groups + 2 * (g * size + j)) % len(base)],
                base[(n_groups + 2 * (g * size + j) + 1) % len(base)]] for g in range(n_groups) for j in range(size)]
    secs: dict[str, list[float]] = {"joined": [], "not_joined": []}
    sent, answers = {}, {}
    for _ in range(repeats):
        for name in secs:
            remote = RemoteSearch(url, join_inflight=name == "joined")
            before = remote.sent  # (the loop's count of queries sent to the server)

            async def episode(qs):
                return [[h.id for h in await remote.asearch(q, k)] for q in qs]
            t0 = time.perf_counter()
            answers[name] = await asyncio.gather(*(episode(qs) for qs in streams))
            secs[name].append(time.perf_counter() - t0)
            sent[name] = remote.sent - before
        assert answers["joined"] == answers["not_joined"], "joined queries got other hits"
    med = {s: statistics.median(v) for s, v in secs.items()}
    n = sum(map(len, streams))
    return {"episodes": len(streams), "searches": n, "joined_qps": n / med["joined"],
            "not_joined_qps": n / med["not_joined"], "joined_sent": sent["joined"],
            "not_joined_sent": sent["not_joined"], "ratio": med["not_joined"] / med["joined"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,16,64,256")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--queries", type=int, default=2048, help="searches per measurement (cycled from the data)")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--smoke", action="store_true", help="seconds-long run for tests")
    ap.add_argument("--json")
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    if args.smoke:
        levels, args.repeats, args.queries = [1, 8], 1, 64
    tmp = Path(tempfile.mkdtemp())
    base = corpus_and_queries(Path(args.data), tmp / "corpus.jsonl", 10 if args.smoke else None)
    queries = [base[i % len(base)] for i in range(args.queries)]
    index = SearchIndex.for_corpus(tmp / "corpus.jsonl", tmp / "index.sqlite", progress=False)
    port = free_port()
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    server = subprocess.Popen([sys.executable, "-m", "rollwise.cli", "retrieve", str(tmp / "corpus.jsonl"), "--port",
                               str(port), "--index", str(tmp / "index.sqlite")], env=env, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/retrieve"
    try:
        for _ in range(300):
            try:
                if httpx.get(url.replace("/retrieve", "/health")).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        sides = {"per_query": RemoteSearch(url, max_batch=1, join_inflight=False).asearch,
                 "shared": RemoteSearch(url, join_inflight=False).asearch, "in_process": index.asearch}
        out = {"documents": index.size, "queries": len(queries), "k": args.k, "levels": {}}
        print(f"{index.size:,} pages, {len(queries)} searches per measurement, top {args.k}")

        async def measure():
            for c in levels:
                secs: dict[str, list[float]] = {s: [] for s in sides}
                for _ in range(args.repeats):
                    hits = {}
                    for name, search in sides.items():
                        t, hits[name] = await run_side(search, queries, c, args.k)
                        secs[name].append(t)
                    assert hits["per_query"] == hits["shared"] == hits["in_process"], "the sides' hits differ"
                med = {s: statistics.median(v) for s, v in secs.items()}
                row = {f"{s}_qps": len(queries) / t for s, t in med.items()}
                row["shared_vs_per_query"] = med["per_query"] / med["shared"]
                out["levels"][str(c)] = row
                print(f"{c:>4} episodes: per query {row['per_query_qps']:8.0f} q/s, shared "
                      f"{row['shared_qps']:8.0f} q/s ({row['shared_vs_per_query']:.2f}x), in process "
                      f"{row['in_process_qps']:8.0f} q/s")
        asyncio.run(measure())
        out["groups"] = asyncio.run(groups(url, base, 4 if args.smoke else 32, args.repeats, args.k))
        g = out["groups"]
        print(f"{g['episodes']} episodes in groups of 8 ({g['searches']} searches): joined {g['joined_qps']:.0f} q/s, "
              f"{g['joined_sent']} sent; not joined {g['not_joined_qps']:.0f} q/s, {g['not_joined_sent']} sent "
              f"({g['ratio']:.2f}x)")
        # a trainer's whole batch in requests of 512 queries (verl's and Search-R1's one call per batch):
        # the server runs a request's queries in a thread per core; against them one after another in
        # process (what a request cost before, in the one thread it had)
        secs = {"one_request": [], "serial": []}
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            got = [[x["document"]["id"] for x in hits] for i in range(0, len(queries), 512)
                   for hits in httpx.post(url, json={"queries": queries[i:i + 512], "topk": args.k},
                                          timeout=300).json()["result"]]
            secs["one_request"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            want = [[h.id for h in index.search(q, args.k)] for q in queries]
            secs["serial"].append(time.perf_counter() - t0)
            assert got == want, "the server's hits differ from the index's"
        med = {s: statistics.median(v) for s, v in secs.items()}
        out["one_request"] = {"requests_of": 512, "server_qps": len(queries) / med["one_request"],
                              "serial_qps": len(queries) / med["serial"], "ratio": med["serial"] / med["one_request"]}
        r = out["one_request"]
        print(f"requests of 512 queries: {r['server_qps']:.0f} q/s against {r['serial_qps']:.0f} q/s one after "
              f"another in process ({r['ratio']:.2f}x)")
    finally:
        server.terminate()
        server.wait(timeout=10)
    write_json(args.json, out)


if __name__ == "__main__":
    main()
