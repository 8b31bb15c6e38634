"""Search: the BM25 index (sqlite FTS5), its corpus files, the Search-R1 retrieval server and its
client, the `search` tool in the dataset env and the built-in `search` env."""
from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import sys
import time

import httpx
import pytest

from rollwise.agent.env import exact_match, f1_score
from rollwise.agent.envs import make_env
from rollwise.agent.episode import run_episode
from rollwise.agent.generator import ScriptedGenerator
from rollwise.agent.search import RemoteSearch, SearchIndex, match_expression, search_tool
from rollwise.agent.tools import ServiceError
from rollwise.engine.tokenizer import Tokenizer
from rollwise.serve.process import free_port
from rollwise.serve.retrieve import build_retrieve_app
from rollwise.types import SamplingParams
from tests.agent.servers import AppServer

DOCS = [{"id": "1", "title": "Ana Smith", "text": "Ana Smith is a chemist who founded Maple Motors."},
        {"id": "2", "title": "Maple Motors", "text": "Maple Motors is a car maker based in Vintry."},
        {"id": "3", "title": "Maple Systems", "text": "Maple Systems is a software company based in Northgate."},
        {"id": "4", "title": "Ben Smith", "text": "Ben Smith is a pilot."}]


def test_index_ranks_the_documents_that_match_best_and_takes_any_text():
    index = SearchIndex.from_docs(DOCS)
    assert index.size == 4
    assert [h.id for h in index.search("Ana Smith", 4)] == ["1", "4"]  # both words, then one; no others
    hits = index.search("maple motors", 3)
    assert [h.id for h in hits] == ["2", "1", "3"]  # the title's match first
    assert hits[0].score > hits[1].score > hits[2].score > 0
    assert index.search("Where is MAPLE MOTORS based?", 1)[0].id == "2"  # stopwords and case ignored
    for text in ['"Maple', "Maple AND (NEAR", "maple* OR -motors", "title:Ana", "Ana's"]:  # FTS5 syntax is text
        assert index.search(text, 3)
    assert index.search("unknown words", 3) == []
    with pytest.raises(ValueError, match="no words"):
        index.search("?! --", 3)
    with pytest.raises(ValueError, match="k must be from 1 to 100"):
        index.search("maple", 0)
    assert match_expression("the who") == '"the" OR "who"'  # only stopwords: kept
    assert match_expression("Who founded the MAPLE company, maple?") == '"founded" OR "maple" OR "company"'


def _corpus(path, docs) -> None:  # Search-R1's format: the title, in quotes, on the first line of `contents`
    rows = [{"id": d["id"], "contents": f'"{d["title"]}"\n{d["text"]}'} for d in docs]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_corpus_index_is_built_once_opened_read_only_and_rebuilt_when_the_corpus_changes(tmp_path):
    corpus, index_path = tmp_path / "corpus.jsonl", tmp_path / "idx" / "corpus.sqlite"
    _corpus(corpus, DOCS)
    index = SearchIndex.for_corpus(corpus, index_path, progress=False)
    assert index.search("Vintry", 1)[0].title == "Maple Motors"
    built = index_path.stat().st_mtime_ns
    again = SearchIndex.for_corpus(corpus, index_path, progress=False)
    assert index_path.stat().st_mtime_ns == built and again.size == 4  # reused, not rebuilt
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        again._conn().execute("INSERT INTO docs VALUES ('x', 'x', 'x')")
    time.sleep(0.01)
    _corpus(corpus, DOCS + [{"id": "5", "title": "Vintry", "text": "Vintry is a port city."}])
    changed = SearchIndex.for_corpus(corpus, index_path, progress=False)
    assert changed.size == 5 and changed.search("Vintry", 1)[0].id == "5"
    assert sorted(p.name for p in index_path.parent.iterdir()) == ["corpus.sqlite"]  # no temporary files left
    (tmp_path / "bad.jsonl").write_text('{"id": 1, "body": "no text"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: a document needs 'text'"):
        SearchIndex.for_corpus(tmp_path / "bad.jsonl", tmp_path / "bad.sqlite", progress=False)
    assert not [p for p in tmp_path.iterdir() if "bad.sqlite" in p.name]  # nor a temporary file


class RetrieveServer(AppServer):
    def __init__(self, index: SearchIndex, api_key: str | None = None) -> None:
        super().__init__(build_retrieve_app(index, api_key))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/retrieve"


def test_retrieval_server_speaks_search_r1s_protocol_and_refuses_bad_input_with_json():
    index = SearchIndex.from_docs(DOCS)
    with RetrieveServer(index, api_key="k") as srv:
        auth = {"Authorization": "Bearer k"}
        body = {"queries": ["maple motors", "Ben"], "topk": 2, "return_scores": True}
        r = httpx.post(srv.url, json=body, headers=auth)
        assert r.status_code == 200
        result = r.json()["result"]
        assert [[x["document"]["id"] for x in hits] for hits in result] == [["2", "1"], ["4"]]
        assert result[0][0]["document"]["contents"] == '"Maple Motors"\nMaple Motors is a car maker based in Vintry.'
        assert result[0][0]["score"] == pytest.approx(index.search("maple motors", 1)[0].score)
        many = ["maple motors", "Ben", "Ana Smith", "Vintry", "pilot", "car maker"] * 5  # in threads, in order
        result = httpx.post(srv.url, json={"queries": many, "topk": 3}, headers=auth).json()["result"]
        assert [[x["document"]["id"] for x in hits] for hits in result] == [[h.id for h in index.search(q, 3)]
                                                                             for q in many]
        plain = httpx.post(srv.url, json={"queries": ["Ben"], "return_scores": False}, headers=auth).json()
        assert plain == {"result": [[{"id": "4", "contents": '"Ben Smith"\nBen Smith is a pilot.'}]]}
        for body, why in [({"queries": "maple"}, "queries"), ({"queries": []}, "1 to 512"),
                          ({"queries": ["?!"]}, "no words"), ({"queries": ["maple"], "topk": 0}, "k must be")]:
            r = httpx.post(srv.url, json=body, headers=auth)
            assert r.status_code == 400 and why in r.json()["error"]["message"], (body, r.text)
        assert httpx.post(srv.url, json={"queries": ["maple"]}).status_code == 401
        assert httpx.get(srv.url.replace("/retrieve", "/health")).json() == {"status": "ok", "documents": 4}

        async def client():  # the tool over HTTP gives what the index gives
            remote, local = search_tool(RemoteSearch(srv.url, "k"), 2), search_tool(index, 2)
            got = [(await remote.call({"query": q})).content for q in ("Maple Motors", "?!")]
            want = (await local.call({"query": "Maple Motors"})).content
            with pytest.raises(ServiceError, match="401"):  # a wrong key is the run's fault, not the model's
                await search_tool(RemoteSearch(srv.url, "wrong"), 2).call({"query": "maple"})
            return got, want
        got, want = asyncio.run(client())
        assert got[0] == want and want.startswith("Doc 1(Title: Maple Motors) Maple Motors is a car maker")
        assert got[1].startswith("error: tool 'search' failed: ValueError: the retrieval server refused") \
            and "no words" in got[1]  # the model reads why its query was refused


def test_concurrent_searches_share_requests_and_a_refused_query_fails_alone():
    index = SearchIndex.from_docs(DOCS)
    srv = RetrieveServer(index)
    sizes = []

    @srv.server.config.app.middleware("http")
    async def count(request, call_next):
        if request.url.path == "/retrieve":
            sizes.append(len(json.loads(await request.body())["queries"]))
        return await call_next(request)
    queries = ["maple motors", "Ben", "Ana Smith", "Vintry", "software"] * 8 + ["?!"]
    with srv:
        async def go(max_batch):
            tool = search_tool(RemoteSearch(srv.url, max_batch=max_batch, max_inflight=1, join_inflight=False), 2)
            return [r.content for r in await asyncio.gather(*(tool.call({"query": q}) for q in queries))]
        batched = asyncio.run(go(64))
        batched_sizes, sizes[:] = list(sizes), []
        alone = asyncio.run(go(1))
    assert sizes == [1] * 41 and batched == alone  # the same answers as query by query
    assert len(batched_sizes) < 20 and max(batched_sizes) > 10  # shared requests (a refused one halved)
    assert "refused" in batched[-1] and "no words" in batched[-1]  # the bad query's episode reads why
    assert all(c.startswith("Doc 1(Title: ") for c in batched[:-1])  # and no other


def test_a_query_asked_again_while_out_joins_the_first_answer():
    """A GRPO group's samples searching the same question at once: one query goes out; each asker
    gets the answer (or the refusal); an asker cut off leaves the others theirs."""
    index = SearchIndex.from_docs(DOCS)
    srv = RetrieveServer(index)
    sent = []

    @srv.server.config.app.middleware("http")
    async def count(request, call_next):
        if request.url.path == "/retrieve":
            sent.extend(json.loads(await request.body())["queries"])
            await asyncio.sleep(0.2)  # (slow enough that the askers overlap)
        return await call_next(request)
    queries = ["maple motors", "Ben", "Ana Smith"] * 8 + ["?!"] * 3
    with srv:
        async def go(join, max_batch):
            remote = RemoteSearch(srv.url, max_batch=max_batch, join_inflight=join)
            tool = search_tool(remote, 2)
            got = [r.content for r in await asyncio.gather(*(tool.call({"query": q}) for q in queries))]
            cut = asyncio.create_task(tool.call({"query": "Vintry"}))  # cut off while its query is out ...
            other = asyncio.create_task(tool.call({"query": "Vintry"}))
            await asyncio.sleep(0.05)
            cut.cancel()
            return got, (await other).content, remote.sent
        joined, later, n = asyncio.run(go(True, 1))  # (one request per query: no refused batch halved)
        sent_joined, sent[:] = sorted(sent), []
        alone, _, n_alone = asyncio.run(go(False, 1))
        assert asyncio.run(go(True, 64))[0] == alone  # joined and shared requests: the same answers
    want = asyncio.run(search_tool(index, 2).call({"query": "Vintry"})).content
    assert joined == alone and later == want  # ... the other still gets its answer
    assert sent_joined == sorted(["maple motors", "Ben", "Ana Smith", "?!", "Vintry"]) and n == 5
    assert n_alone == len(queries) + 2
    assert all("refused" in c for c in joined[-3:]) and all(c.startswith("Doc 1(Title: ") for c in joined[:-3])


def test_a_retrieval_outage_ends_the_episode_as_an_error_not_as_the_tools_answer(model_dir):
    port = free_port()  # nothing listens there
    env = make_env("dataset", reward="em", tools=["search"],
                   search={"url": f"http://127.0.0.1:{port}/retrieve", "retries": 1})
    call = '<tool_call>{"name": "search", "arguments": {"query": "maple"}}</tool_call>'
    gen = ScriptedGenerator(Tokenizer(model_dir), lambda req: call)
    t = asyncio.run(run_episode(gen, env, {"id": "t", "prompt": "Where is Maple Motors?", "answer": "Vintry"},
                                SamplingParams(max_tokens=64)))
    assert t.status == "error" and "ServiceError" in t.error and "failed 2 times" in t.error
    assert len(t.turns) == 1  # no observation of the outage was appended for the model to read


def test_dataset_env_searches_a_corpus_and_scores_by_exact_match(tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLWISE_CACHE", str(tmp_path / "cache"))
    _corpus(tmp_path / "wiki.jsonl", DOCS)
    search = {"corpus": str(tmp_path / "wiki.jsonl"), "top_k": 1}
    env = make_env("dataset", reward="em", tools=["search"], search=search)
    task = {"id": "t", "prompt": "Where is Maple Motors based?", "answer": ["Vintry", "Vintry town"]}

    async def go():
        msgs = await env.reset(task)
        call = '<tool_call>{"name": "search", "arguments": {"query": "Maple Motors"}}</tool_call>'
        obs, _, done, _ = await env.step(call)
        assert not done and obs[0]["content"] == "Doc 1(Title: Maple Motors) " + DOCS[1]["text"]
        _, reward, done, _ = await env.step("The Vintry.")
        return msgs, reward, done
    msgs, reward, done = asyncio.run(go())
    assert done and reward == 1.0 and "Where is Maple Motors" in msgs[-1]["content"]
    assert [p.suffix for p in (tmp_path / "cache" / "search").iterdir()] == [".sqlite"]  # indexed in the cache
    with pytest.raises(ValueError, match="needs search"):
        make_env("dataset", tools=["search"])
    with pytest.raises(ValueError, match="one of corpus .*, url .* or task_docs"):
        make_env("dataset", tools=["search"], search={"top_k": 2})
    with pytest.raises(ValueError, match="unknown search options \\['k'\\]"):
        make_env("dataset", tools=["search"], search={"url": "http://x/retrieve", "k": 2})


def test_exact_match_and_f1_normalise_as_squad():
    assert exact_match("The  Vintry!", "vintry") == 1.0 and exact_match("Vintry town", ["x", "vintry town"]) == 1.0
    assert exact_match("Vintry, Northgate", "Vintry") == 0.0
    assert f1_score("port of vintry", "Vintry") == pytest.approx(2 * (1 / 3) * 1 / (1 / 3 + 1))
    assert f1_score("nothing", ["Vintry", "Port"]) == 0.0 and f1_score("the port", ["vintry", "Port"]) == 1.0


def test_search_env_needs_two_searches_the_second_from_the_firsts_result():
    env = make_env("search")
    task = env.sample_tasks(1, seed=3)[0]

    async def go():
        await env.reset(task)
        first, _, _, _ = await env.step(env.expert(task)[0])
        second, _, _, _ = await env.step(env.expert(task)[1])
        return first[0]["content"], second[0]["content"]
    first, second = asyncio.run(go())
    assert task["company"] in first and task["answer"] not in first  # the person's page: the company, no city
    assert second.startswith(f"Doc 1(Title: {task['company']}) ") and task["answer"] in second.split("\n")[0]


def test_rollwise_retrieve_serves_a_corpus_from_the_command_line(tmp_path):
    _corpus(tmp_path / "wiki.jsonl", DOCS)
    port = free_port()
    log = open(tmp_path / "log.txt", "w")  # (a file, not a pipe: a server that logs much cannot block on it)
    proc = subprocess.Popen([sys.executable, "-m", "rollwise.cli", "retrieve", str(tmp_path / "wiki.jsonl"), "--port",
                             str(port), "--index", str(tmp_path / "wiki.sqlite")], stdout=log,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    try:
        for _ in range(300):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        r = httpx.post(f"http://127.0.0.1:{port}/retrieve", json={"queries": ["Vintry"], "topk": 3})
        assert [x["document"]["id"] for x in r.json()["result"][0]] == ["2"]
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()
    assert "4 documents from" in (tmp_path / "log.txt").read_text()


def test_example_corpus_answers_every_question_by_the_experts_two_searches(tmp_path, monkeypatch):
    """examples/search_corpus.py: one corpus for all questions (names unique, founders' pages among
    pages of people who founded nothing); the expert's two searches find each answer through the
    corpus's index, and examples/train-search-corpus.toml makes a dataset env that searches it."""
    from pathlib import Path

    from rollwise.rl import TrainConfig
    ex = Path(__file__).parents[2] / "examples"
    subprocess.run([sys.executable, str(ex / "search_corpus.py"), str(tmp_path)], check=True, capture_output=True)
    corpus = [json.loads(x) for x in (tmp_path / "corpus.jsonl").read_text().splitlines()]
    train, held = ([json.loads(x) for x in (tmp_path / f).read_text().splitlines()]
                   for f in ("train.jsonl", "eval.jsonl"))
    assert (len(corpus), len(train), len(held)) == (448, 96, 32)
    assert len({c["contents"].split("\n")[0] for c in corpus}) == 448  # every title once
    monkeypatch.setenv("ROLLWISE_CACHE", str(tmp_path / "cache"))
    cfg = TrainConfig.from_toml(ex / "train-search-corpus.toml", model="unused")
    opts = {**cfg.env_options, "search": {"corpus": str(tmp_path / "corpus.jsonl"), "top_k": 3}}

    async def solve(task) -> float:
        env = make_env(cfg.env, **opts)
        await env.reset(task)
        for action in task["solution"]:
            _, reward, _, _ = await env.step(action)
        return reward

    async def go():
        return [await solve(t) for t in train + held]
    assert asyncio.run(go()) == [1.0] * 128
    assert cfg.env_options["search"]["url"].endswith("/retrieve") and cfg.eval_tasks == 32
