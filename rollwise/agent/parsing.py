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
