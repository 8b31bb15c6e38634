"""Search: BM25 retrieval over documents as an agent's tool, the tool Search-R1 and ASearcher train with.

`SearchIndex` holds documents in sqlite's FTS5, ranked by BM25 (a title word counts twice a text
word); a query's words are OR-ed (common English words dropped unless nothing else is left), so
any text the model writes is a valid query. `SearchIndex.for_corpus(path)` indexes a JSON-lines
corpus once into a sqlite file (in ~/.cache/rollwise/search, keyed by the corpus's path, size and
modification time) and opens it read-only from then on. A corpus line is {"id", "title", "text"}
or Search-R1's {"id", "contents"}, whose first line is the title (in quotes).

`RemoteSearch` asks a retrieval server that speaks Search-R1's protocol (POST /retrieve
{"queries": [...], "topk": k, "return_scores": true} -> {"result": [[{"document": {"id",
"contents"}, "score"}, ...], ...]}), e.g. its dense e5 retriever; `rollwise retrieve CORPUS`
serves a `SearchIndex` that way (rollwise.serve.retrieve). Concurrent episodes' queries share
requests once a few are out (benchmarks/search.py). A server that stays down after the retries
raises `ServiceError`: the episode ends with status `error` and runs again, rather than the
policy being trained on an outage.

`search_tool(backend, top_k)` is the tool: its hits as Search-R1 shows them, "Doc 1(Title: ...) ...".
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import os
import re
import sqlite3
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from rollwise.agent.env import loop_shared
from rollwise.agent.tools import ServiceError, Tool, ToolCache

_WORD = re.compile(r"\w+")
MAX_QUERY_WORDS = 32
STOPWORDS = frozenset("a an and are as at be by for from has have in is it its of on or that the to was were what "
                      "when where which who whom whose why how with".split())
_RANK = "bm25(docs, 0.0, 2.0, 1.0)"  # columns doc_id (not indexed), title, text


@dataclass(slots=True)
class Hit:
    id: str
    title: str
    text: str
    score: float


def match_expression(query: str) -> str:
    """The FTS5 query for free text: its distinct words, quoted and OR-ed (stopwords dropped when
    other words are left), so punctuation and FTS5's operators in the text are plain words."""
    words = list(dict.fromkeys(w.lower() for w in _WORD.findall(str(query))))
    content = [w for w in words if w not in STOPWORDS] or words
    if not content:
        raise ValueError(f"query {query!r} has no words to search for")
    return " OR ".join(f'"{w}"' for w in content[:MAX_QUERY_WORDS])


def read_corpus(path: str | Path) -> Iterator[tuple[str, str, str]]:
    """(id, title, text) for each line of a JSON-lines corpus: {"title", "text"} or Search-R1's
    {"contents": '"Title"\\ntext'}; a line without an id gets its line number."""
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if line.strip():
                try:
                    yield parse_doc(json.loads(line), i)
                except (json.JSONDecodeError, ValueError) as e:
                    raise ValueError(f"{path}:{i + 1}: {e}") from e


def parse_doc(row: dict | list, i: int = 0) -> tuple[str, str, str]:
    """(id, title, text) of {"title", "text"}, Search-R1's {"contents"} or HotpotQA's [title, sentences]."""
    if isinstance(row, (list, tuple)) and len(row) == 2 and isinstance(row[0], str):
        body = row[1]
        return str(i), row[0], "".join(body) if isinstance(body, (list, tuple)) else str(body)
    if not isinstance(row, dict):
        raise ValueError(f"a document is a JSON object or a [title, sentences] pair, got {type(row).__name__}")
    if "contents" in row:
        title, _, text = str(row["contents"]).partition("\n")
        title = title.strip().strip('"')
    elif "text" in row:
        title, text = str(row.get("title", "")), str(row["text"])
    else:
        raise ValueError(f"a document needs 'text' (and 'title') or 'contents'; got {sorted(row)}")
    return str(row.get("id", i)), title, text


def _create(conn: sqlite3.Connection, docs: Iterable[tuple[str, str, str]]) -> None:
    conn.execute("CREATE VIRTUAL TABLE docs USING fts5(doc_id UNINDEXED, title, text)")
    batch: list[tuple[str, str, str]] = []
    for doc in docs:
        batch.append(doc)
        if len(batch) == 10000:
            conn.executemany("INSERT INTO docs VALUES (?, ?, ?)", batch)
            batch = []
    conn.executemany("INSERT INTO docs VALUES (?, ?, ?)", batch)
    conn.execute("INSERT INTO docs(docs) VALUES ('optimize')")


class SearchIndex:
    """Documents in sqlite FTS5, ranked by BM25. Safe from any thread: an index in a file opens a
    read-only connection per thread; one in memory serialises its queries on one connection."""

    def __init__(self, path: str | Path | None = None, _conn: sqlite3.Connection | None = None) -> None:
        self.path = None if path is None else Path(path)
        self._shared, self._lock, self._local = _conn, threading.Lock(), threading.local()
        self.size = self._query("SELECT count(*) FROM docs", ())[0][0]

    @classmethod
    def from_docs(cls, docs: Iterable[dict | tuple[str, str, str]]) -> SearchIndex:
        """An index in memory ({"id", "title", "text"} or {"contents"} dicts, or (id, title, text))."""
        conn = sqlite3.connect(":memory:", check_same_thread=False)
        _create(conn, (d if isinstance(d, tuple) else parse_doc(d, i) for i, d in enumerate(docs)))
        conn.commit()
        return cls(_conn=conn)

    @classmethod
    def for_corpus(cls, corpus: str | Path, index: str | Path | None = None, progress: bool = True) -> SearchIndex:
        """The index of a JSON-lines corpus, built once (`index`, default in the cache) and reused
        while the corpus keeps its size and modification time; opened read-only."""
        corpus = Path(corpus)
        st = corpus.stat()
        key = f"{corpus.resolve()}:{st.st_size}:{st.st_mtime_ns}"
        if index is None:
            cache = Path(os.environ.get("ROLLWISE_CACHE", Path.home() / ".cache" / "rollwise")) / "search"
            index = cache / f"{corpus.stem}-{hashlib.sha1(key.encode()).hexdigest()[:16]}.sqlite"
        index = Path(index)
        if _stored_key(index) != key:
            index.parent.mkdir(parents=True, exist_ok=True)
            tmp = index.with_name(f"{index.name}.{os.getpid()}.tmp")
            tmp.unlink(missing_ok=True)
            docs = read_corpus(corpus)
            if progress:
                from tqdm import tqdm
                docs = tqdm(docs, desc=f"indexing {corpus.name}", unit=" docs", mininterval=1.0)
            conn = sqlite3.connect(tmp)
            try:
                _create(conn, docs)
                conn.execute("CREATE TABLE meta (key TEXT)")
                conn.execute("INSERT INTO meta VALUES (?)", (key,))
                conn.commit()
            except BaseException:
                conn.close()
                tmp.unlink(missing_ok=True)
                raise
            conn.close()
            os.replace(tmp, index)  # whole or not at all: a failed or killed build leaves no index behind
        return cls(index)

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True)
        return conn

    def _query(self, sql: str, args: tuple) -> list[tuple]:
        if self._shared is not None:
            with self._lock:
                return self._shared.execute(sql, args).fetchall()
        return self._conn().execute(sql, args).fetchall()

    def search(self, query: str, k: int = 3) -> list[Hit]:
        """The k documents that match the query's words best, best first."""
        if not 1 <= k <= 100:
            raise ValueError(f"k must be from 1 to 100, got {k}")
        rows = self._query(f"SELECT doc_id, title, text, -{_RANK} FROM docs WHERE docs MATCH ? ORDER BY {_RANK} "
                           f"LIMIT ?", (match_expression(query), k))
        return [Hit(*r) for r in rows]

    async def asearch(self, query: str, k: int = 3) -> list[Hit]:
        return await asyncio.to_thread(self.search, query, k)


def _stored_key(index: Path) -> str | None:
    if not index.exists():
        return None
    try:
        with sqlite3.connect(f"{index.resolve().as_uri()}?mode=ro", uri=True) as conn:
            row = conn.execute("SELECT key FROM meta").fetchone()
        conn.close()
    except sqlite3.Error:
        return None
    return row[0] if row else None


class RemoteSearch:
    """A retrieval server over HTTP, Search-R1's protocol (`url`: its /retrieve endpoint); failed
    requests are retried with backoff, then `ServiceError`. One client per event loop.

    The queries of every episode on the event loop share requests: while `max_inflight` requests
    are out, new queries wait and leave together in one request (at most `max_batch`), so a loaded
    run sends few large requests (a dense retriever encodes each in one batch) and an idle one sends
    each query at once. A batch the server refuses (400) is sent again in halves until the refused
    queries stand alone, so only a bad query's episode reads the refusal. `max_batch = 1`: one
    request per query. A query asked again while it is waiting or out (a GRPO group's samples often
    all search the question first) joins the first one's answer instead of going out again
    (`join_inflight`); `sent` counts the queries that went out to the server from this event loop."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 10.0, retries: int = 2,
                 backoff_s: float = 0.5, max_batch: int = 64, max_inflight: int = 4,
                 join_inflight: bool = True) -> None:
        if retries < 0 or timeout_s <= 0 or max_batch < 1 or max_inflight < 1:
            raise ValueError(f"need retries >= 0, timeout_s > 0, max_batch >= 1 and max_inflight >= 1, got {retries}, "
                             f"{timeout_s}, {max_batch} and {max_inflight}")
        self.url, self.api_key, self.timeout_s = url, api_key, timeout_s
        self.retries, self.backoff_s, self.max_batch, self.max_inflight = retries, backoff_s, max_batch, max_inflight
        self.join_inflight = join_inflight

    @property
    def sent(self) -> int:
        return self._sent[0]

    @property
    def _sent(self) -> list[int]:
        return loop_shared(("search-sent", self.url), lambda: [0])

    def _client(self) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return loop_shared(("search", self.url, self.api_key),
                           lambda: httpx.AsyncClient(timeout=self.timeout_s, headers=headers))

    async def asearch(self, query: str, k: int = 3) -> list[Hit]:
        if not self.join_inflight:
            return await self._asearch(query, k)
        joined = loop_shared(("search-inflight", self.url, self.api_key, k), lambda: ToolCache(size=0))  # keeps none
        return (await joined.get(query, lambda: self._asearch(query, k)))[0]

    async def _asearch(self, query: str, k: int) -> list[Hit]:
        if self.max_batch == 1:
            return (await self.post([query], k))[0]
        key = ("search-batches", self.url, self.api_key, k, self.max_batch, self.max_inflight, self.timeout_s,
               self.retries, self.backoff_s)
        return await loop_shared(key, lambda: _Batcher(self, k)).submit(query)

    async def post(self, queries: list[str], k: int) -> list[list[Hit]]:
        """One request: each query's hits."""
        self._sent[0] += len(queries)
        body = {"queries": queries, "topk": k, "return_scores": True}
        err: Exception | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                r = await self._client().post(self.url, json=body)
            except httpx.HTTPError as e:
                err = e
                continue
            if r.status_code == 400:  # the query's fault: the model reads why
                raise ValueError(f"the retrieval server refused the query: {r.text[:300]}")
            if r.is_success:
                result = r.json().get("result")
                if not isinstance(result, list) or len(result) != len(queries):
                    raise ServiceError(f"retrieval server {self.url} answered {len(queries)} queries with "
                                       f"{r.text[:200]}")
                return [[_hit(x) for x in hits] for hits in result]
            err = RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
            if r.status_code < 500 and r.status_code != 429:  # 401, 404: misconfigured, no use retrying
                raise ServiceError(f"retrieval server {self.url}: {err}")
        raise ServiceError(f"retrieval server {self.url} failed {self.retries + 1} times: {err}")


class _Batcher:
    """The queries waiting for a request slot of one server (and top-k) on one event loop."""

    def __init__(self, remote: RemoteSearch, k: int) -> None:
        self.remote, self.k = remote, k
        self.waiting: list[tuple[str, asyncio.Future]] = []
        self.slots = asyncio.Semaphore(remote.max_inflight)
        self.pump: asyncio.Task | None = None
        self.sending: set[asyncio.Task] = set()

    async def submit(self, query: str) -> list[Hit]:
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append((query, fut))
        if self.pump is None or self.pump.done():
            self.pump = asyncio.create_task(self._pump())
        return await fut

    async def _pump(self) -> None:
        while self.waiting:
            await self.slots.acquire()
            batch, self.waiting = self.waiting[:self.remote.max_batch], self.waiting[self.remote.max_batch:]
            task = asyncio.create_task(self._send(batch))
            self.sending.add(task)
            task.add_done_callback(self.sending.discard)

    async def _answers(self, queries: list[str]) -> list:
        """Each query's hits, or the ValueError of a query the server refuses: a refused batch is
        halved until the refused queries stand alone."""
        try:
            return await self.remote.post(queries, self.k)
        except ValueError as e:
            if len(queries) == 1:
                return [e]
            half = len(queries) // 2
            first, second = await asyncio.gather(self._answers(queries[:half]), self._answers(queries[half:]))
            return first + second

    async def _send(self, batch: list[tuple[str, asyncio.Future]]) -> None:
        try:
            results = await self._answers([q for q, _ in batch])
            for (_, fut), r in zip(batch, results):
                if not fut.done():
                    fut.set_exception(r) if isinstance(r, BaseException) else fut.set_result(r)
        except BaseException as e:  # noqa: BLE001 - every waiting episode gets it (ServiceError: their error)
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(e)
        finally:
            self.slots.release()


def _hit(x: dict) -> Hit:
    doc, score = (x["document"], float(x.get("score", 0.0))) if "document" in x else (x, 0.0)
    return Hit(*parse_doc(doc), score)


def format_hits(hits: list[Hit], max_chars: int = 1000) -> str:
    """Search-R1's layout: 'Doc 1(Title: T) text' per hit, each text cut at `max_chars`."""
    if not hits:
        return "no documents found"
    return "\n".join(f"Doc {i}(Title: {h.title}) {h.text[:max_chars]}" for i, h in enumerate(hits, 1))


def search_tool(backend: SearchIndex | RemoteSearch, top_k: int = 3, max_chars: int = 1000,
                name: str = "search") -> Tool:
    """The `search(query)` tool over a backend: its top_k hits, formatted."""
    if not 1 <= top_k <= 100:
        raise ValueError(f"top_k must be from 1 to 100, got {top_k}")

    async def search(query: str) -> str:
        """Search the documents; returns the best matches, each with its title."""
        return format_hits(await backend.asearch(query, top_k), max_chars)
    return Tool(search, name=name, timeout=None if isinstance(backend, RemoteSearch) else 10.0, pure=True)


@functools.lru_cache(maxsize=8)
def _index(corpus: str, index: str | None, size: int, mtime_ns: int) -> SearchIndex:
    """One SearchIndex per corpus file and version in a process, whatever the number of envs."""
    return SearchIndex.for_corpus(corpus, index)


class TaskDocsSearch:
    """Search over each task's own documents, its `key` field (HotpotQA's and MuSiQue's distractor
    setting: every question with its paragraphs), BM25 in memory: `tool_for(task)` is the task's tool."""

    def __init__(self, key: str, top_k: int = 3, max_chars: int = 1000) -> None:
        if not 1 <= top_k <= 100:
            raise ValueError(f"top_k must be from 1 to 100, got {top_k}")
        self.key, self.top_k, self.max_chars = key, top_k, max_chars

    def tool_for(self, task: dict) -> Tool:
        docs = task.get(self.key)
        if not isinstance(docs, (list, tuple)) or not docs:
            raise ValueError(f"task {task.get('id')!r} has no documents in {self.key!r} (search = {{ task_docs = "
                             f"{self.key!r} }}); fields: {sorted(task)}")
        return search_tool(SearchIndex.from_docs(parse_doc(d, i) for i, d in enumerate(docs)), self.top_k,
                           self.max_chars)


def make_search(options: dict) -> Tool | TaskDocsSearch:
    """The search tool from config options: `corpus` (a JSON-lines file, indexed locally; `index`:
    where), `url` (a retrieval server; `api_key_env`) or `task_docs` (a field of each task that holds
    its own documents: a `TaskDocsSearch`), and `top_k`, `max_chars`."""
    opts = dict(options)
    top_k, max_chars = int(opts.pop("top_k", 3)), int(opts.pop("max_chars", 1000))
    if sum(k in opts for k in ("corpus", "url", "task_docs")) != 1:
        raise ValueError(f"search needs one of corpus (a JSON-lines file), url (a retrieval server) or task_docs (a "
                         f"task field with its documents); got {sorted(opts)}")
    if "task_docs" in opts:
        key = opts.pop("task_docs")
        if opts:
            raise ValueError(f"unknown search options {sorted(opts)} with task_docs; valid: top_k, max_chars")
        return TaskDocsSearch(str(key), top_k, max_chars)
    if "corpus" in opts:
        corpus, index = Path(opts.pop("corpus")), opts.pop("index", None)
        st = corpus.stat()  # (a changed corpus is indexed again)
        backend = _index(str(corpus.resolve()), index and str(Path(index).resolve()), st.st_size, st.st_mtime_ns)
    else:
        env_key = opts.pop("api_key_env", None)
        key = os.environ.get(env_key) if env_key else None
        if env_key and not key:
            raise ValueError(f"search api_key_env {env_key!r} is not set")
        names = ("timeout_s", "retries", "max_batch", "max_inflight", "join_inflight")
        backend = RemoteSearch(opts.pop("url"), key, **{k: opts.pop(k) for k in names if k in opts})
    if opts:
        raise ValueError(f"unknown search options {sorted(opts)}; valid: corpus, index, url, api_key_env, timeout_s, "
                         f"retries, max_batch, max_inflight, join_inflight, task_docs, top_k, max_chars")
    return search_tool(backend, top_k, max_chars)
