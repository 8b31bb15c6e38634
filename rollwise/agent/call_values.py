"""The values inside tool calls, for the formats that write them as text rather than JSON
(rollwise.agent.parsing's `qwen3_coder` and `pythonic`): a raw value typed by its JSON schema as
vLLM types it, a Python literal read safely, and the Lark pieces their tool_choice grammars use."""
from __future__ import annotations

import ast
import json
import re


def typed(value: str, schema: dict | None):
    """A qwen3_coder value as its schema's type says (vLLM's conversion); text if it does not read as one."""
    if not schema:
        return value
    types = schema.get("type")
    types = types if isinstance(types, list) else [types] if types else []
    if value.strip() == "null" and ("null" in types or not types):
        return None
    for t in types or ["any"]:
        if t == "string":
            return value
        try:
            if t == "integer":
                return int(value.strip())
            if t == "number":
                v = value.strip()
                return int(v) if re.fullmatch(r"-?\d+", v) else float(v)
            if t == "boolean" and value.strip().lower() in ("true", "false"):
                return value.strip().lower() == "true"
            if t in ("object", "array", "any"):
                try:
                    return json.loads(value)
                except json.JSONDecodeError:
                    return ast.literal_eval(value.strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    return value


def value_grammar(schema: dict) -> str | None:
    """A value's Lark by its schema; None: free text (a string, or a type the grammar does not write).
    Numbers, booleans, objects and arrays are written as JSON of their schema (bounds included); a
    string enum as one of its strings, unquoted."""
    enum = schema.get("enum")
    if enum and all(isinstance(v, str) for v in enum):
        return "(" + " | ".join(json.dumps(v) for v in enum) + ")"
    if schema.get("type") in ("integer", "number", "boolean", "object", "array"):
        return f"%json {json.dumps({**schema, 'x-guidance': {'whitespace_flexible': False}})}"
    return None


def literal(node: ast.expr):
    """A call's keyword value: a Python literal, or JSON's true / false / null where one stands."""
    names = {"true": True, "false": False, "null": None}

    class JsonNames(ast.NodeTransformer):
        def visit_Name(self, n):
            if n.id in names:
                return ast.copy_location(ast.Constant(names[n.id]), n)
            raise ValueError(f"{n.id} is not a literal")
    try:
        return ast.literal_eval(JsonNames().visit(node))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as e:
        raise ValueError(f"a value is not a literal ({e})") from None


def sequence(name: str, items: list[tuple[str, bool]], sep: str) -> list[str]:
    """Lark rules `{name}_k` for the items from k on, in order, joined by `sep`, each optional one
    optional: `{name}_k` writes at least one item (whether the whole may be empty is the caller's
    `?`); `{name}_k_more` the same after one already written (each item led by `sep`)."""
    n, rules = len(items), []

    def nullable(k):
        return all(not req for _, req in items[k:])

    def ref(rule, k):  # the rest from k, or nothing if it may be empty
        return "" if k == n else f"{rule}_{k}_more" + ("?" if nullable(k) else "")
    for k, (item, req) in enumerate(items):
        first = f"{item} {ref(name, k + 1)}".strip()
        more = f"{sep} {item} {ref(name, k + 1)}".strip()
        if not req and k + 1 < n:  # skipped: the rest, which must then write something
            first += f" | {name}_{k + 1}"
            more += f" | {name}_{k + 1}_more"
        rules += [f"{name}_{k}: {first}", f"{name}_{k}_more: {more}"]
    return rules
