"""The XML-like formats whose values are raw text typed by the tool's schema: Qwen3-Coder's
(`qwen3_coder`) and GLM-4.5's (`glm45`)."""
from __future__ import annotations

import json
import re

from rollwise.agent.call_values import typed, value_grammar
from rollwise.agent.parsing.base import HermesParser, Parsed, ToolCall, tag_ref


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
        return type(self)({f["name"]: f.get("parameters") or {} for f in fns if f.get("name")})

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
            got = self._read(m.group(1))
            if isinstance(got, str):
                errors.append(got)
                continue
            name, raw = got
            props = (self.schemas.get(name) or {}).get("properties") or {}
            calls.append(ToolCall(name, {key: typed(value, props.get(key)) for key, value in raw}))
        return Parsed(calls, errors, self.content(text).strip())

    def _read(self, body: str) -> tuple[str, list[tuple[str, str]]] | str:
        """A call block's function name and raw (key, value) arguments, or why it is malformed."""
        fns = list(self.function.finditer(body))
        if len(fns) != 1 or not fns[0].group(0).endswith("</function>") or not fns[0].group(1).strip():
            return "malformed tool call: expected one <function=NAME> ... </function> in <tool_call>"
        raw = []
        for p in self.parameter.finditer(fns[0].group(2)):
            value = p.group(2)
            value = value[1:] if value.startswith("\n") else value
            raw.append((p.group(1).strip(), value[:-1] if value.endswith("\n") else value))
        return fns[0].group(1).strip(), raw

    text_end = "</parameter>"  # (free text ends at the first of these, as parsed)

    def _argument(self, key: str, value: str | None) -> str:
        """Lark for one argument: its value's (None: free text up to `text_end`) in its markup."""
        lit = json.dumps  # a Lark string literal
        tail = f"text {lit(chr(10))}" if value is None else f"{value} {lit(chr(10) + '</parameter>' + chr(10))}"
        return f"{lit(f'<parameter={key}>' + chr(10))} {tail}"

    def _function(self, name: str, arguments: str) -> str:
        return f"{json.dumps(f'<function={name}>' + chr(10))} {arguments} {json.dumps('</function>')}"

    def _call(self, functions: str, tag) -> str:
        return f'{tag("<tool_call>")} "\\n" ({functions}) "\\n" {tag("</tool_call>")}'

    def grammar(self, fns: list[dict], single: bool, tag_tokens: bool) -> str:
        """Calls of these functions, their arguments in schema order (the required ones always),
        each value written as its schema allows (`call_values.value_grammar`), free text up to the
        format's end of a value."""
        tag = tag_ref(tag_tokens)
        rules = [f'text[suffix="{self.text_end}"]: /(.|\\n)*/']
        alts = []
        for i, fn in enumerate(fns):
            params = fn.get("parameters") or {}
            required = set(params.get("required") or [])
            parts = []
            for j, (key, schema) in enumerate((params.get("properties") or {}).items()):
                rules.append(f"p{i}_{j}: {self._argument(key, value_grammar(schema or {}))}")
                parts.append(f"p{i}_{j}" + ("" if key in required else "?"))
            rules.append(f"f{i}: {self._function(fn['name'], ' '.join(parts))}")
            alts.append(f"f{i}")
        more = "" if single else ' ("\\n" call)*'
        return "\n".join([f"start: call{more}", f"call: {self._call(' | '.join(alts), tag)}", *rules]) + "\n"


class Glm45Parser(Qwen3CoderParser):
    """GLM-4.5's and 4.6's tool calls (vLLM's `glm45`): `<tool_call>NAME` newline, then
    `<arg_key>KEY</arg_key>` newline `<arg_value>VALUE</arg_value>` newline for each argument, then
    `</tool_call>` (GLM-4.7 leaves out the newlines: both read). Values as GLM's chat template
    writes them: a string raw, anything else JSON, typed by the tool's schema as qwen3_coder's are."""
    argument = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)

    def write(self, calls: list[ToolCall]) -> str:
        def arg(k, v):
            return f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else json.dumps(v)}</arg_value>\n"
        return "\n".join(f"<tool_call>{c.name}\n{''.join(arg(k, v) for k, v in c.arguments.items())}</tool_call>"
                         for c in calls)

    def _read(self, body: str) -> tuple[str, list[tuple[str, str]]] | str:
        at = body.find("<arg_key>")
        name, rest = (body, "") if at < 0 else (body[:at], body[at:])
        if not name.strip() or "<" in name or self.argument.sub("", rest).strip():
            return "malformed tool call: expected NAME then <arg_key>KEY</arg_key><arg_value>VALUE</arg_value> pairs"
        return name.strip(), [(k.strip(), v) for k, v in self.argument.findall(rest)]

    text_end = "</arg_value>"

    def _argument(self, key: str, value: str | None) -> str:
        lit = json.dumps
        tail = "text" if value is None else f"{value} {lit('</arg_value>')}"
        return f"{lit(f'<arg_key>{key}</arg_key>' + chr(10) + '<arg_value>')} {tail} {lit(chr(10))}"

    def _function(self, name: str, arguments: str) -> str:
        return f"{json.dumps(name + chr(10))} {arguments}"

    def _call(self, functions: str, tag) -> str:
        return f'{tag("<tool_call>")} ({functions}) {tag("</tool_call>")}'
