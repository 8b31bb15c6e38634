"""Tool-call parsing from model text. The default is the Hermes/Qwen format
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; another format is another class with
the same `parse` method."""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Protocol


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


class HermesParser:
    pattern = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)

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
        return Parsed(calls, errors, self.pattern.sub("", text).strip())


def openai_tool_calls(text: str) -> tuple[str, list[dict]] | None:
    """A reply's Hermes tool calls as OpenAI's `tool_calls` (and the text around them), as vLLM's
    hermes parser gives them; None if it has none or a malformed one (the reply stays text)."""
    got = HermesParser().parse(text)
    if not got.calls or got.errors:
        return None
    return got.text, [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                       "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in got.calls]


def forced_tool_calls(tools: list[dict], tool_choice, tag_tokens: bool = False) -> dict | None:
    """The structured output (a Lark grammar, `structured_outputs`) that makes a reply Hermes tool
    calls, for OpenAI's tool_choice "required" (one or more calls, each of an offered function with
    its parameters' schema) or {"type": "function", "function": {"name": N}} (exactly one call of N),
    as vLLM enforces them; None for "auto", "none" or no choice. ValueError for a name not offered.
    `tag_tokens`: the tokenizer has `<tool_call>` and `</tool_call>` as tokens of their own (Qwen's),
    which the grammar then names as tokens, so the reply is tokenized as the model writes it."""
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
        raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                "arguments": f.get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False} for f in fns if f.get("name")]
    if not calls:
        raise ValueError("tool_choice asks for a tool call, but no function is offered")
    schema = {"anyOf": calls} if len(calls) > 1 else calls[0]
    schema["x-guidance"] = {"whitespace_flexible": False}
    nl = '"\\n"'  # a newline, as a Lark string literal
    tag = (lambda t: t) if tag_tokens else (lambda t: f'"{t}"')  # a token by name, or the text
    call = f'{tag("<tool_call>")} {nl} %json {json.dumps(schema)} {nl} {tag("</tool_call>")}'
    more = "" if name else f" ({nl} call)*"
    return {"grammar": f"start: call{more}\ncall: {call}\n"}
