"""SuffixCache: which suffix trees a request drafts from (the policy over the trees in `suffix_tree`).

Three sources, best score wins (ties: the earlier source):
- request: the request's own prompt and output so far (copied file content, repeated JSON keys);
- group: the responses of its prompt group, in-flight siblings included, so GRPO siblings draft
  from each other while they run; kept while the group is recent (LRU over groups);
- global: responses of other requests, in flight and finished, bounded to `max_cached_requests`
  with FIFO or LRU eviction (LRU: a new request of a group refreshes that group's responses).
  A request started with a `scope` (a cache salt) has its scope's own global tree instead: it
  drafts from the requests of its scope only, and they alone from it (the bound counts them all).

Imports no torch. The C++ trees are used when built (`backend="cpp"`), the Python ones otherwise.
"""
from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from rollwise.spec.suffix_tree import SuffixTree
from rollwise.types import Draft

try:
    from rollwise.spec import _C
except ImportError:  # the package was installed without its native build
    _C = None

SOURCES = ("request", "group", "global")
EVICTIONS = ("fifo", "lru")
BACKENDS = ("cpp", "python")


@dataclass(slots=True)
class _Request:
    seq_id: int
    group_id: str | None
    tree: object  # this request's own tree: prompt + output
    context: list[int] = field(default_factory=list)  # the last max_depth tokens (Python backend)
    session: str | None = None
    tokens: list[int] | None = None  # everything in `tree`, kept when the tree outlives the request
    scope: str | None = None  # whose global tree it drafts from and feeds (None: the common one)


class SuffixCache:
    def __init__(self, *, max_depth: int = 24, max_spec_tokens: int = 16, alpha: float = 1.0,
                 offset: float = 0.0, min_token_prob: float = 0.1, max_cached_requests: int = 10000,
                 eviction: str = "fifo", use_group_tree: bool = True, max_groups: int = 128,
                 tree: bool = False, backend: str = "cpp", max_session_tokens: int = 4_000_000) -> None:
        if eviction not in EVICTIONS:
            raise ValueError(f"eviction must be one of {EVICTIONS}, got {eviction!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if backend == "cpp" and _C is None:
            raise ValueError("the C++ core rollwise.spec._C is not built; reinstall rollwise or use backend='python'")
        if max_depth < 1 or max_spec_tokens < 0 or max_cached_requests < 0 or not 0 <= min_token_prob <= 1:
            raise ValueError("need max_depth >= 1, max_spec_tokens >= 0, max_cached_requests >= 0, "
                             "0 <= min_token_prob <= 1")
        self.max_depth, self.max_spec_tokens = max_depth, max_spec_tokens
        self.alpha, self.offset, self.min_token_prob = alpha, offset, min_token_prob
        self.max_cached_requests, self.eviction = max_cached_requests, eviction
        self.use_group_tree, self.max_groups, self.tree = use_group_tree, max_groups, tree
        self.backend = backend
        self._new_tree = (lambda: _C.SuffixTree(max_depth)) if backend == "cpp" else (lambda: SuffixTree(max_depth))
        self.global_tree = self._new_tree()
        self._cached: OrderedDict[int, str | None] = OrderedDict()  # seq id in a global tree -> group
        self._scopes: dict[str, object] = {}  # scope -> its global tree, while it holds or serves any request
        self._scope_of: dict[int, str] = {}  # seq id in a scope's tree -> the scope
        self._scope_n: Counter[str] = Counter()  # scope -> how many sequences its tree holds
        self.groups: OrderedDict[str, object] = OrderedDict()  # group id -> tree of its responses
        self.requests: dict[str, _Request] = {}
        # trees of finished requests kept for their session's next request, LRU, bounded in tokens
        self.max_session_tokens, self._session_tokens = max_session_tokens, 0
        self._sessions: OrderedDict[str, tuple[object, list[int]]] = OrderedDict()  # session -> (tree, its tokens)
        self._ids = itertools.count()
        # cpp: active requests also live natively, so a step crosses into C++ once with handles only
        self._native = _C.Requests(max_depth) if backend == "cpp" else None
        self._by_seq: dict[int, str] = {}

    # lifecycle -----------------------------------------------------------------------------------
    def start_request(self, request_id: str, prompt_token_ids: list[int], group_id: str | None = None,
                      session: str | None = None, scope: str | None = None) -> None:
        """`session` (e.g. the trajectory): when this prompt extends the previous request of the same
        session (prompt + output + observation), that request's tree is extended instead of rebuilt.
        `scope`: it drafts from and feeds its scope's global tree, not the common one."""
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} is already active")
        tree, tokens = None, None
        prev = self._sessions.pop(session, None) if session is not None else None
        if prev is not None:
            self._session_tokens -= len(prev[1])
        if prev is not None and len(prev[1]) <= len(prompt_token_ids) and prompt_token_ids[:len(prev[1])] == prev[1]:
            tree, tokens = prev
            delta = list(prompt_token_ids[len(tokens):])
            if delta:
                tree.append(0, delta)
                tokens.extend(delta)
        if tree is None:
            tree = self._new_tree()
            tree.append(0, list(prompt_token_ids))
            tokens = list(prompt_token_ids) if session is not None else None
        req = _Request(next(self._ids), group_id, tree, list(prompt_token_ids[-self.max_depth:]), session, tokens,
                       scope)
        self.requests[request_id] = req
        self._by_seq[req.seq_id] = request_id
        if group_id is not None and self.use_group_tree:
            if group_id not in self.groups:
                self.groups[group_id] = self._new_tree()
            self.groups.move_to_end(group_id)
            self._evict_groups()
        if self.max_cached_requests > 0:
            if self.eviction == "lru" and group_id is not None:
                for sid in [s for s, g in self._cached.items() if g == group_id]:
                    self._cached.move_to_end(sid)
            self._cache(req.seq_id, group_id, scope)
            self._evict_cached()
        if self._native is not None:
            self._native.set(req.seq_id, self._sources(req), list(self._targets(req)), req.context)

    def append(self, request_id: str, token_ids: list[int]) -> None:
        self.append_batch({request_id: token_ids})

    def append_batch(self, items: dict[str, list[int]]) -> None:
        """Extend running requests' outputs (in one native call with the C++ trees)."""
        reqs = [self.requests[rid] for rid in items]
        for req, toks in zip(reqs, items.values()):
            if req.tokens is not None:
                req.tokens.extend(toks)
        if self._native is not None:
            self._native.append([r.seq_id for r in reqs], [list(t) for t in items.values()])
            return
        for req, toks in zip(reqs, items.values()):
            toks = list(toks)
            req.context = (req.context + toks)[-self.max_depth:]
            for tree, sid in self._targets(req):
                tree.append(sid, toks)

    def stop_request(self, request_id: str) -> None:
        """The request's tree goes; its response stays in the global and group trees for others."""
        req = self.requests.pop(request_id, None)
        if req is not None:
            self._by_seq.pop(req.seq_id, None)
            if self._native is not None:
                self._native.drop(req.seq_id)
            self._drop_scope(req.scope)
            if req.session is not None and len(req.tokens) <= self.max_session_tokens:  # its next turn extends this tree
                self._sessions[req.session] = (req.tree, req.tokens)
                self._session_tokens += len(req.tokens)
                while self._session_tokens > self.max_session_tokens:
                    _, (_, toks) = self._sessions.popitem(last=False)
                    self._session_tokens -= len(toks)

    def add_sequence(self, token_ids: list[int], group_id: str | None = None, scope: str | None = None) -> None:
        """Shared drafting material from elsewhere (e.g. a trajectory finished on another replica); with
        a `scope`, for that scope's requests only."""
        sid = next(self._ids)
        if group_id is not None and self.use_group_tree:
            tree = self.groups.get(group_id)
            if tree is None:
                tree = self.groups[group_id] = self._new_tree()
                self._evict_groups()
            tree.append(sid, list(token_ids))
        if self.max_cached_requests > 0:
            self._cache(sid, group_id, scope)
            self._global(scope).append(sid, list(token_ids))
            self._evict_cached()

    # drafting ------------------------------------------------------------------------------------
    def speculate(self, request_id: str, max_spec_tokens: int | None = None, tree: bool | None = None) -> Draft:
        return self.speculate_batch([request_id], max_spec_tokens, tree)[0]

    def speculate_batch(self, request_ids: list[str], max_spec_tokens: int | list[int] | None = None,
                        tree: bool | None = None) -> list[Draft]:
        tree = self.tree if tree is None else tree
        n = self.max_spec_tokens if max_spec_tokens is None else max_spec_tokens
        budgets = n if isinstance(n, list) else [n] * len(request_ids)
        reqs = [self.requests[r] for r in request_ids]
        if self._native is not None:
            raw = self._native.speculate([r.seq_id for r in reqs], budgets, self.alpha, self.offset,
                                         self.min_token_prob, tree)
            return [Draft(t, p, pr, s, m, SOURCES[src] if src >= 0 else "") for t, p, pr, s, m, src in raw]
        out = []
        for srcs, ctx, b in zip([self._sources(r) for r in reqs], [r.context for r in reqs], budgets):
            best, name = Draft(), ""
            for i, t in enumerate(srcs):
                if t is None or b <= 0:
                    continue
                d = t.speculate(ctx, b, self.alpha, self.offset, self.min_token_prob, tree)
                if d.token_ids and (not name or d.score > best.score):
                    best, name = d, SOURCES[i]
            best.source = name
            out.append(best)
        return out

    # internals -----------------------------------------------------------------------------------
    def _sources(self, req: _Request) -> list:
        group = self.groups.get(req.group_id) if req.group_id is not None else None
        return [req.tree, group, self._global(req.scope) if self.max_cached_requests > 0 else None]

    def _targets(self, req: _Request):
        yield req.tree, 0
        group = self.groups.get(req.group_id) if req.group_id is not None else None
        if group is not None:
            yield group, req.seq_id
        if req.seq_id in self._cached:
            yield self._global(req.scope), req.seq_id

    def _global(self, scope: str | None):
        return self.global_tree if scope is None else self._scopes[scope]

    def _cache(self, sid: int, group_id: str | None, scope: str | None) -> None:
        """Sequence `sid` joins its scope's global tree's bookkeeping (the tree made if it is the first)."""
        self._cached[sid] = group_id
        if scope is not None:
            self._scope_of[sid] = scope
            self._scope_n[scope] += 1
            if scope not in self._scopes:
                self._scopes[scope] = self._new_tree()

    def _evict_cached(self) -> None:
        while len(self._cached) > self.max_cached_requests:
            sid, _ = self._cached.popitem(last=False)
            scope = self._scope_of.pop(sid, None)
            self._global(scope).remove(sid)
            if scope is not None:
                self._scope_n[scope] -= 1
            rid = self._by_seq.get(sid)
            if rid is not None and self._native is not None:  # still running: stop feeding the global tree
                self._native.set_targets(sid, list(self._targets(self.requests[rid])))
            self._drop_scope(scope)

    def _drop_scope(self, scope: str | None) -> None:
        """A scope's tree goes once it holds no sequence and no active request drafts from it (the
        native requests hold plain pointers to their trees)."""
        if scope in self._scopes and not self._scope_n[scope] and all(r.scope != scope for r in self.requests.values()):
            del self._scopes[scope], self._scope_n[scope]

    def _evict_groups(self) -> None:
        active = {r.group_id for r in self.requests.values()}
        for gid in list(self.groups):
            if len(self.groups) <= self.max_groups:
                break
            if gid not in active:
                del self.groups[gid]

    def check_integrity(self) -> None:
        self.global_tree.check_integrity()
        for t in [*self.groups.values(), *self._scopes.values()]:
            t.check_integrity()
        for r in self.requests.values():
            r.tree.check_integrity()
        assert len(self._cached) <= self.max_cached_requests and set(self._scope_of) <= set(self._cached)
        assert +self._scope_n == Counter(self._scope_of.values())
        serving = {r.scope for r in self.requests.values() if r.scope is not None and self.max_cached_requests > 0}
        assert set(self._scopes) == {*self._scope_of.values(), *serving}
        assert self._session_tokens == sum(len(t) for _, t in self._sessions.values()) <= self.max_session_tokens

    def metrics(self) -> dict[str, float]:
        nodes = self.global_tree.num_nodes + sum(t.num_nodes for t in [*self.groups.values(), *self._scopes.values()])
        return {"spec_cached_requests": float(len(self._cached)), "spec_groups": float(len(self.groups)),
                "spec_tree_nodes": float(nodes + sum(r.tree.num_nodes for r in self.requests.values()))}
