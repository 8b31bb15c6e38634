"""Tool-call parsing from model text, by the format the model was trained on (`PARSERS`, vLLM's
names): `hermes` (Qwen, Hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks
in the text), `llama3_json` (Llama 3.1+: the reply is the call, `{"name": ..., "parameters":
{...}}`, several joined by "; ", optionally after `<|python_tag|>`), `qwen3_coder` (Qwen3-Coder's
XML: `<tool_call><function=NAME><parameter=KEY>value</parameter>...</function></tool_call>`, each
value raw text, typed by the tool's schema) and `pythonic` (Llama 3.2's and 4's: the reply is
`[name(key=value, ...)]`, Python literals). Each parser also says how much of a reply being
streamed can be shown as content (`content_end`) and writes the grammar that holds a reply to calls
of given functions (`grammar`, for tool_choice "required" or a named one). `for_tools(tools)` gives
the parser for a request's tools (their schemas type qwen3_coder's values; the others need none)."""
from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Protocol

from rollwise.agent.call_values import literal, sequence, typed, value_grammar


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)


@dataclass(slots=True)
class Parsed:
    calls: list[ToolCall]
    errors: list[str]  # malformed calls, reported back to the model
    text: str  # the message without its tool-call blocks


class ToolCallParser(Protocol):
    def parse(self, text: str) -> Parsed: ...

    def for_tools(self, tools: list[dict] | None) -> ToolCallParser: ...  # bound to a request's tool schemas

    def content(self, text: str) -> str: ...  # the text outside the calls (unstripped)

    def content_end(self, text: str) -> int: ...  # streaming: the prefix of the text so far that is content

    def grammar(self, fns: list[dict], single: bool, tag_tokens: bool) -> str: ...  # Lark: calls of these

    def write(self, calls: list[ToolCall]) -> str: ...  # the calls as the model writes them (experts' transcripts)


class HermesParser:
    pattern = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)
    tag = "<tool_call>"

    def for_tools(self, tools: list[dict] | None) -> HermesParser:
        return self

    def write(self, calls: list[ToolCall]) -> str:
        return "\n".join(f"<tool_call>\n{json.dumps({'name': c.name, 'arguments': c.arguments})}\n</tool_call>"
                         for c in calls)

    def parse(self, text: str) -> Parsed:
        calls, errors = [], []
        for m in self.pattern.finditer(text):
            body = m.group(1).strip()
            if not m.group(0).endswith("</tool_call>"):
                errors.append("malformed tool call: missing </tool_call>")
                continue
            try:
                obj = json.loads(body)
            except json.JSONDecodeError as e:
                errors.append(f"malformed tool call: invalid JSON ({e.msg} at char {e.pos})")
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                errors.append('malformed tool call: expected {"name": <string>, "arguments": <object>}')
                continue
            args = obj.get("arguments", {})
            if isinstance(args, str):  # some models send the arguments JSON-encoded
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    errors.append(f"malformed tool call {obj['name']!r}: arguments are not JSON")
                    continue
            calls.append(ToolCall(obj["name"], args))
        return Parsed(calls, errors, self.content(text).strip())

    def content(self, text: str) -> str:
        return self.pattern.sub("", text)

    def content_end(self, text: str) -> int:
        """Content stops before the first `<tool_call>`, and holds back what may begin one."""
        at = text.find(self.tag)
        return at if at >= 0 else max(len(text) - len(self.tag) + 1, 0)

    def grammar(self, fns: list[dict], single: bool, tag_tokens: bool) -> str:
        """`<tool_call>` newline {"name", "arguments"} newline `</tool_call>`, one or more joined by
        newlines; `tag_tokens`: the tokenizer's own tag tokens (named as tokens, not spelled)."""
        schema = _one_of([_call_schema(f, "arguments") for f in fns])
        tag = (lambda t: t) if tag_tokens else (lambda t: f'"{t}"')  # a token by name, or the text
        nl = '"\\n"'  # a newline, as a Lark string literal
        call = f'{tag("<tool_call>")} {nl} %json {json.dumps(schema)} {nl} {tag("</tool_call>")}'
        more = "" if single else f" ({nl} call)*"
        return f"start: call{more}\ncall: {call}\n"


class _WholeReply:
    """Content for the formats where the reply is the calls (Llama 3's JSON, pythonic): a reply that
    starts (or may yet start) as one of `openers` shows nothing while streamed; text shows all of it."""
    openers: tuple[str, ...] = ()

    def content(self, text: str) -> str:
        return "" if self.content_end(text) == 0 and text.strip() else text

    def content_end(self, text: str) -> int:
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
        schema = _one_of([_call_schema(f, "parameters") for f in fns])
        more = "" if single else ' ("; " call)*'
        return f"start: call{more}\ncall: %json {json.dumps(schema)}\n"


class Qwen3CoderParser(HermesParser):
    """Qwen3-Coder's XML tool calls (vLLM's `qwen3_coder`): `<tool_call>` newline `<function=NAME>`
    newline, then `<parameter=KEY>` newline VALUE newline `</parameter>` for each argument, then
    `</function>` newline `</tool_call>`. Values are raw text (code needs no JSON escapes), typed by
    the tool's JSON schema when the parser is bound to the tools (`for_tools`): integers, numbers,
    booleans, `null`, objects and arrays (JSON, or Python literals) become what the schema says; a
    value that does not read as its type stays text (the tool's argument check then says so), as
    does every value of a parameter the schema does not name. Content and streaming as Hermes's."""
    function = re.compile(r"<function=([^>\n]*)>(.*?)(?:</function>|$)", re.S)
    parameter = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.S)

    def __init__(self, schemas: dict[str, dict] | None = None) -> None:
        self.schemas = schemas or {}  # function name -> its parameters' schema

    def for_tools(self, tools: list[dict] | None) -> Qwen3CoderParser:
        fns = [t.get("function", t) for t in tools or []]
        return Qwen3CoderParser({f["name"]: f.get("parameters") or {} for f in fns if f.get("name")})

    def write(self, calls: list[ToolCall]) -> str:
        """Each value as text: a string as it is, anything else as JSON."""
        def param(k, v):
            return f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
        return "\n".join(f"<tool_call>\n<function={c.name}>\n{''.join(param(k, v) for k, v in c.arguments.items())}"
                         "</function>\n</tool_call>" for c in calls)

    def parse(self, text: str) -> Parsed:
        calls, errors = [], []
        for m in self.pattern.finditer(text):
            if not m.group(0).endswith("</tool_call>"):
                errors.append("malformed tool call: missing </tool_call>")
                continue
            fns = list(self.function.finditer(m.group(1)))
            if len(fns) != 1 or not fns[0].group(0).endswith("</function>") or not fns[0].group(1).strip():
                errors.append("malformed tool call: expected one <function=NAME> ... </function> in <tool_call>")
                continue
            name, body = fns[0].group(1).strip(), fns[0].group(2)
            props = (self.schemas.get(name) or {}).get("properties") or {}
            args = {}
            for p in self.parameter.finditer(body):
                key, value = p.group(1).strip(), p.group(2)
                value = value[1:] if value.startswith("\n") else value
                value = value[:-1] if value.endswith("\n") else value
                args[key] = typed(value, props.get(key))
            calls.append(ToolCall(name, args))
        return Parsed(calls, errors, self.content(text).strip())

    def grammar(self, fns: list[dict], single: bool, tag_tokens: bool) -> str:
        """Calls of these functions, their parameters in schema order (the required ones always),
        each value written as its schema allows (`call_values.value_grammar`), free text up to `</parameter>`."""
        tag = (lambda t: t) if tag_tokens else (lambda t: f'"{t}"')
        lit = json.dumps  # a Lark string literal
        rules = ['text[suffix="</parameter>"]: /(.|\\n)*/']  # (text ends at the first </parameter>, as parsed)
        alts = []
        for i, fn in enumerate(fns):
            params = fn.get("parameters") or {}
            required = set(params.get("required") or [])
            parts = []
            for j, (key, schema) in enumerate((params.get("properties") or {}).items()):
                value = value_grammar(schema or {})
                tail = f"text {lit(chr(10))}" if value is None else f"{value} {lit(chr(10) + '</parameter>' + chr(10))}"
                rules.append(f"p{i}_{j}: {lit(f'<parameter={key}>' + chr(10))} {tail}")
                parts.append(f"p{i}_{j}" + ("" if key in required else "?"))
            name = fn["name"]
            rules.append(f"f{i}: {lit(f'<function={name}>' + chr(10))} {' '.join(parts)} {lit('</function>')}")
            alts.append(f"f{i}")
        nl = lit("\n")
        call = f'{tag("<tool_call>")} {nl} ({" | ".join(alts)}) {nl} {tag("</tool_call>")}'
        more = "" if single else f" ({nl} call)*"
        return "\n".join([f"start: call{more}", f"call: {call}", *rules]) + "\n"


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


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "qwen3_coder": Qwen3CoderParser,
           "pythonic": PythonicParser}


def bind(parser: ToolCallParser, tools: list[dict] | None) -> ToolCallParser:
    """The parser for a request's tools (OpenAI's function schemas): `parser.for_tools(tools)`, or
    the parser itself if it has no such method (a user's parser written before it)."""
    for_tools = getattr(parser, "for_tools", None)
    return parser if for_tools is None else for_tools(tools)


def make_parser(name: str) -> ToolCallParser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; valid: {sorted(PARSERS)}")
    return PARSERS[name]()


def _call_schema(fn: dict, args_key: str) -> dict:
    return {"type": "object", "properties": {"name": {"const": fn["name"]},
                                             args_key: fn.get("parameters") or {"type": "object"}},
            "required": ["name", args_key], "additionalProperties": False}


def _one_of(schemas: list[dict]) -> dict:
    schema = {"anyOf": schemas} if len(schemas) > 1 else dict(schemas[0])
    return {**schema, "x-guidance": {"whitespace_flexible": False}}


def openai_tool_calls(text: str, parser: ToolCallParser | None = None) -> tuple[str, list[dict]] | None:
    """A reply's Hermes tool calls as OpenAI's `tool_calls` (and the text around them), as vLLM's
    hermes parser gives them; None if it has none or a malformed one (the reply stays text)."""
    got = (parser or HermesParser()).parse(text)
    if not got.calls or got.errors:
        return None
    return got.text, [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                       "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in got.calls]


def forced_tool_calls(tools: list[dict], tool_choice, tag_tokens: bool = False,
                      parser: ToolCallParser | None = None) -> dict | None:
    """The structured output (a Lark grammar, `structured_outputs`) that makes a reply tool calls in
    the parser's format (default Hermes), for OpenAI's tool_choice "required" (one or more calls,
    each of an offered function with its parameters' schema) or {"type": "function", "function":
    {"name": N}} (exactly one call of N), as vLLM enforces them; None for "auto", "none" or no
    choice. ValueError for a name not offered. `tag_tokens`: the tokenizer has `<tool_call>` and
    `</tool_call>` as tokens of their own (Qwen's): the grammar names them as tokens, so the reply
    is tokenized as the model writes it."""
    if tool_choice in (None, "auto", "none"):
        return None
    fns = [t.get("function") or {} for t in tools if t.get("type", "function") == "function"]
    if tool_choice == "required":
        name = None
    elif isinstance(tool_choice, dict) and isinstance((tool_choice.get("function") or {}).get("name"), str):
        name = tool_choice["function"]["name"]
        fns = [f for f in fns if f.get("name") == name]
        if not fns:
            raise ValueError(f"tool_choice names function {name!r}, which is not among the tools offered")
    else:
        raise ValueError('tool_choice must be "none", "auto", "required" or '
                         '{"type": "function", "function": {"name": ...}}')
    fns = [f for f in fns if f.get("name")]
    if not fns:
        raise ValueError("tool_choice asks for a tool call, but no function is offered")
    return {"grammar": (parser or HermesParser()).grammar(fns, name is not None, tag_tokens)}
