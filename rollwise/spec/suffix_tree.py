"""Depth-limited suffix tree with occurrence counts: the Python reference (and test oracle) of the
C++ core in `_C`. This one keeps a node per trie position; the C++ tree stores the same trie
path-compressed (suffix_tree.h) and must give the same counts and drafts.

The tree indexes every substring of up to `max_depth` tokens of the sequences it holds; a node's
count is how often the substring spelled by its path occurs. A sequence is extended in O(max_depth)
per token by keeping the nodes of its active suffixes (those ending at its last token), and can be
removed again. Each node keeps its most frequent child (ties: smaller token id), so a chain draft
follows it in O(1) per token.

Drafting follows SuffixDecoding (arXiv 2411.04975): for every match length m of the context's
suffix found in the tree, draft up to `min(max_spec_tokens, alpha * m + offset)` tokens whose path
probability (product of count ratios) stays >= `min_token_prob`, either as a chain of most frequent
children or best-first as a tree; keep the draft with the highest score (sum of path
probabilities = expected accepted tokens; ties go to the longer match).
"""
from __future__ import annotations

import heapq

from rollwise.types import Draft


class _Node:
    __slots__ = ("token", "count", "parent", "depth", "children", "best")

    def __init__(self, token: int, parent: _Node | None, depth: int) -> None:
        self.token = token
        self.count = 0
        self.parent = parent
        self.depth = depth
        self.children: dict[int, _Node] = {}
        self.best: _Node | None = None

    def bump(self, child: _Node) -> None:
        """child's count went up by one: it may now be the most frequent."""
        b = self.best
        if b is None or child.count > b.count or (child.count == b.count and child.token < b.token):
            self.best = child

    def rescan(self) -> None:
        self.best = min(self.children.values(), key=lambda c: (-c.count, c.token), default=None)


class SuffixTree:
    def __init__(self, max_depth: int = 24) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.root = _Node(-1, None, 0)
        self.seqs: dict[int, list[int]] = {}
        self._active: dict[int, list[_Node]] = {}  # per sequence: nodes of its suffixes, shortest first
        self.num_nodes = 0

    def append(self, seq_id: int, tokens: list[int]) -> None:
        seq = self.seqs.setdefault(seq_id, [])
        active = self._active.setdefault(seq_id, [])
        for t in tokens:
            seq.append(t)
            new = []
            for node in [self.root, *active]:
                if node.depth >= self.max_depth:
                    continue
                child = node.children.get(t)
                if child is None:
                    child = node.children[t] = _Node(t, node, node.depth + 1)
                    self.num_nodes += 1
                child.count += 1
                node.bump(child)
                new.append(child)
            self.root.count += 1
            active[:] = new

    def remove(self, seq_id: int) -> None:
        seq = self.seqs.pop(seq_id, None)
        self._active.pop(seq_id, None)
        if seq is None:
            return
        dead, touched = [], set()
        for s in range(len(seq)):
            node = self.root
            for t in seq[s:s + self.max_depth]:
                node = node.children[t]
                node.count -= 1
                if node.count == 0:
                    dead.append(node)
                touched.add(node.parent)
        self.root.count -= len(seq)
        for node in dead:  # a dead node's subtree is dead too: detach the topmost ones only
            if node.parent is self.root or node.parent.count > 0:
                del node.parent.children[node.token]
                self.num_nodes -= _size(node)
        for node in touched:
            node.rescan()

    def speculate(self, context: list[int], max_spec_tokens: int, alpha: float = 1.0, offset: float = 0.0,
                  min_token_prob: float = 0.1, tree: bool = False) -> Draft:
        best = Draft()
        context = context[-self.max_depth:]
        for m in range(1, len(context) + 1):
            node = self.root
            for t in context[len(context) - m:]:
                node = node.children.get(t)
                if node is None:
                    return best  # longer suffixes cannot match either
            budget = min(max_spec_tokens, int(alpha * m + offset))
            if budget <= 0:
                continue
            draft = (_tree_draft if tree else _chain_draft)(node, budget, min_token_prob)
            draft.match_len = m
            if draft.token_ids and draft.score >= best.score:
                best = draft
        return best

    def check_integrity(self) -> None:
        n = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            for tok, c in node.children.items():
                n += 1
                assert c.token == tok and c.parent is node and c.depth == node.depth + 1 <= self.max_depth
                assert 0 < c.count <= node.count, f"count {c.count} under parent count {node.count}"
                stack.append(c)
            if node.children:
                top = min(node.children.values(), key=lambda c: (-c.count, c.token))
                assert node.best is top, "stale most-frequent child"
            else:
                assert node.best is None
        assert n == self.num_nodes, f"{n} nodes reachable, {self.num_nodes} counted"
        assert self.root.count == sum(len(s) for s in self.seqs.values())

    def path_counts(self) -> dict[tuple[int, ...], int]:
        """Every stored substring with its count (for tests against a brute-force count)."""
        out, stack = {}, [(self.root, ())]
        while stack:
            node, path = stack.pop()
            for t, c in node.children.items():
                out[path + (t,)] = c.count
                stack.append((c, path + (t,)))
        return out


def _size(node: _Node) -> int:
    n, stack = 0, [node]
    while stack:
        x = stack.pop()
        n += 1
        stack.extend(x.children.values())
    return n


def _chain_draft(node: _Node, budget: int, min_prob: float) -> Draft:
    d = Draft()
    p = 1.0
    parent = -1
    while len(d.token_ids) < budget and node.best is not None:
        child = node.best
        p *= child.count / node.count
        if p < min_prob:
            break
        d.token_ids.append(child.token)
        d.parents.append(parent)
        d.probs.append(p)
        d.score += p
        parent = len(d.token_ids) - 1
        node = child
    return d


def _tree_draft(node: _Node, budget: int, min_prob: float) -> Draft:
    d = Draft()
    heap: list[tuple[float, int, _Node, int]] = []
    pushed = 0

    def push(parent_node: _Node, parent_p: float, parent_idx: int) -> None:
        nonlocal pushed
        for c in sorted(parent_node.children.values(), key=lambda c: (-c.count, c.token)):
            p = parent_p * (c.count / parent_node.count)
            if p < min_prob:
                break  # sorted by count: the rest are less likely still
            heapq.heappush(heap, (-p, pushed, c, parent_idx))
            pushed += 1

    push(node, 1.0, -1)
    while heap and len(d.token_ids) < budget:
        neg_p, _, c, parent_idx = heapq.heappop(heap)
        d.token_ids.append(c.token)
        d.parents.append(parent_idx)
        d.probs.append(-neg_p)
        d.score += -neg_p
        push(c, -neg_p, len(d.token_ids) - 1)
    return d
