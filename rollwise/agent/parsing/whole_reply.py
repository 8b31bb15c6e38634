"""The formats where the reply is the calls: Llama 3's JSON (`llama3_json`) and Python's call
syntax (`pythonic`, Llama 3.2's and 4's)."""
from __future__ import annotations

import ast
import json
import re

from rollwise.agent.call_values import literal, sequence
from rollwise.agent.parsing.base import Parsed, ToolCall, call_schema, one_of


class _WholeReply:
    """Content for the formats where the reply is the calls (Llama 3's JSON, pythonic): a reply that
    starts (or may yet start) as one of `openers` shows nothing while streamed; text shows all of it."""
    openers: tuple[str, ...] = ()
    tags: tuple[str, ...] = ()  # (no markup the grammar names as tokens)
    special_tokens = False

    def content(self, text: str) -> str:
        return "" if self.content_end(text) == 0 and text.strip() else text

    def content_end(self, text: str, start: int = 0) -> int:
        if start:  # (it was content: no longer the beginning of a call, it never becomes one)
            return len(text)
        s = text.lstrip()
        maybe_call = s.startswith(self.openers) or any(o.startswith(s) for o in self.openers)
        return 0 if maybe_call else len(text)


class Llama3JsonParser(_WholeReply):
    """Llama 3.1+'s JSON tool calls (vLLM's `llama3_json`): a reply that is one or more
    `{"name": ..., "parameters": {...}}` objects ("arguments" is taken too), joined by ";", maybe
    after `<|python_tag|>`. A reply that does not start with one is text."""
    python_tag = "<|python_tag|>"
    openers = ("{", python_tag)

    def for_tools(self, tools: list[dict] | None) -> Llama3JsonParser:
        return self

    def write(self, calls: list[ToolCall]) -> str:
        return "; ".join(json.dumps({"name": c.name, "parameters": c.arguments}) for c in calls)

    def parse(self, text: str) -> Parsed:
        s = text.strip()
        if s.startswith(self.python_tag):
            s = s[len(self.python_tag):].lstrip()
        if not s.startswith("{"):
            return Parsed([], [], text.strip())
        calls, errors, dec, i = [], [], json.JSONDecoder(), 0
        while i < len(s):
            try:
                obj, i = dec.raw_decode(s, i)
            except json.JSONDecodeError as e:
                errors.append(f"malformed tool call: invalid JSON ({e.msg} at char {e.pos})")
                break
            args = obj.get("parameters", obj.get("arguments", {})) if isinstance(obj, dict) else None
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    args = None
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(args, dict):
                errors.append('malformed tool call: expected {"name": <string>, "parameters": <object>}')
                break
            calls.append(ToolCall(obj["name"], args))
            while i < len(s) and s[i] in "; \n\t":
                i += 1
        return Parsed(calls, errors, "")

    def grammar(self, fns: list[dict], single: bool, tag_tokens: bool) -> str:
        """{"name", "parameters"} objects, one or more joined by "; "."""
        schema = one_of([call_schema(f, "parameters") for f in fns])
        more = "" if single else ' ("; " call)*'
        return f"start: call{more}\ncall: %json {json.dumps(schema)}\n"


class PythonicParser(_WholeReply):
    """Python call lists (vLLM's `pythonic`: Llama 3.2's and Llama 4's format, ToolACE's): a reply that
    is `[name(key=value, ...), ...]`, each value a Python literal (strings, numbers, True / False /
    None, lists, dicts; JSON's true / false / null taken too), maybe between `<|python_start|>` and
    `<|python_end|>`. A reply that does not start with `[name(` is text."""
    start, end = "<|python_start|>", "<|python_end|>"
    openers = ("[", start)

    def for_tools(self, tools: list[dict] | None) -> PythonicParser:
        return self

    def _body(self, text: str) -> str:
        s = text.strip()
        if s.startswith(self.start):
            s = s[len(self.start):]
            s = s[:s.index(self.end)] if self.end in s else s
        return s.strip()

    looks_like_calls = re.compile(r"\[\s*[A-Za-z_]\w*\s*\(")

    def parse(self, text: str) -> Parsed:
        s = self._body(text)
        if not self.looks_like_calls.match(s):  # ("[1, 2]" is an answer, not a call)
            return Parsed([], [], text.strip())
        try:
            tree = ast.parse(s, mode="eval").body
        except SyntaxError as e:
            return Parsed([], [f"malformed tool call: not a Python list of calls ({e.msg})"], "")
        if not isinstance(tree, ast.List) or not tree.elts:
            return Parsed([], ["malformed tool call: expected [name(key=value, ...), ...]"], "")
        calls, errors = [], []
        for node in tree.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
                    and all(k.arg for k in node.keywords)):
                errors.append("malformed tool call: each call is name(key=value, ...), by keyword")
                continue
            try:
                calls.append(ToolCall(node.func.id, {k.arg: literal(k.value) for k in node.keywords}))
            except ValueError as e:
                errors.append(f"malformed tool call {node.func.id!r}: {e}")
        return Parsed(calls, errors, "")

    def write(self, calls: list[ToolCall]) -> str:
        return "[" + ", ".join(f"{c.name}({', '.join(f'{k}={v!r}' for k, v in c.arguments.items())})"
                               for c in calls) + "]"

    def grammar(self, fns: list[dict], single: bool, tag_tokens: bool) -> str:
        """`[` calls `]`, each of an offered function with its parameters by keyword in schema order
        (the required ones always), strings and numbers as JSON writes them (Python reads them
        alike), booleans as True / False, objects and arrays as JSON of their schema."""
        rules, alts = [], []
        for i, fn in enumerate(fns):
            params = fn.get("parameters") or {}
            required = set(params.get("required") or [])
            items = []
            for j, (key, schema) in enumerate((params.get("properties") or {}).items()):
                value = ('("True" | "False")' if (schema or {}).get("type") == "boolean"
                         else f"%json {json.dumps({**(schema or {}), 'x-guidance': {'whitespace_flexible': False}})}")
                rules.append(f"p{i}_{j}: {json.dumps(key + '=')} {value}")
                items.append((f"p{i}_{j}", key in required))
            rules += sequence(f"a{i}", items, json.dumps(", "))
            args = f"a{i}_0" + ("?" if all(not r for _, r in items) else "") if items else ""
            rules.append(f"f{i}: {json.dumps(fn['name'] + '(')} {args} \")\"")
            alts.append(f"f{i}")
        more = "" if single else ' (", " call)*'
        return "\n".join([f'start: "[" call{more} "]"', f"call: {' | '.join(alts)}", *rules]) + "\n"
