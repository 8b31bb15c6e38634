"""The parsed call's types, the parser protocol, Hermes's format (the default, and the base of the
XML ones) and the JSON-schema pieces the grammars share."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)
    id: str | None = None  # the id the model wrote (Kimi-K2's `functions.NAME:INDEX`); None: one is made


@dataclass(slots=True)
class Parsed:
    calls: list[ToolCall]
    errors: list[str]  # malformed calls, reported back to the model
    text: str  # the message without its tool-call blocks


class ToolCallParser(Protocol):
    def parse(self, text: str) -> Parsed: ...

    def for_tools(self, tools: list[dict] | None) -> ToolCallParser: ...  # bound to a request's tool schemas

    def content(self, text: str) -> str: ...  # the text outside the calls (unstripped)

    # streaming: the prefix of the text so far that is content (`start`: the end it gave before, which only grows)
    def content_end(self, text: str, start: int = 0) -> int: ...

    def grammar(self, fns: list[dict], single: bool, tag_tokens) -> str: ...  # Lark: calls of these (tag_ref)

    def write(self, calls: list[ToolCall]) -> str: ...  # the calls as the model writes them (experts' transcripts)

    # optional attributes: `tags`, the markup's pieces (the grammar names them as tokens where the
    # tokenizer has each), and `special_tokens`, true where they are special tokens (replies are
    # then decoded with special tokens kept)


def openai_id(rng) -> str:
    """An id for a call the model wrote none for (OpenAI's shape), drawn from `rng` (`random.Random`)."""
    return f"call_{rng.getrandbits(96):024x}"


class HermesParser:
    pattern = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)
    tag = "<tool_call>"
    tags = ("<tool_call>", "</tool_call>")  # the markup the grammar names as tokens where the tokenizer has them
    special_tokens = False  # the markup is special tokens: decode replies with them kept

    def for_tools(self, tools: list[dict] | None) -> HermesParser:
        return self

    def new_id(self, rng) -> str:
        return openai_id(rng)

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

    def content_end(self, text: str, start: int = 0) -> int:
        """Content stops before the first `<tool_call>`, and holds back an end that may begin one."""
        at = text.find(self.tag, start)  # (none before `start`: content up to there)
        if at >= 0:
            return at
        return len(text) - next((k for k in range(min(len(self.tag) - 1, len(text)), 0, -1)
                                 if text.endswith(self.tag[:k])), 0)

    def grammar(self, fns: list[dict], single: bool, tag_tokens: bool) -> str:
        """`<tool_call>` newline {"name", "arguments"} newline `</tool_call>`, one or more joined by
        newlines; `tag_tokens`: the tokenizer's own tag tokens (named as tokens, not spelled)."""
        schema = one_of([call_schema(f, "arguments") for f in fns])
        tag = tag_ref(tag_tokens)
        nl = '"\\n"'  # a newline, as a Lark string literal
        call = f'{tag("<tool_call>")} {nl} %json {json.dumps(schema)} {nl} {tag("</tool_call>")}'
        more = "" if single else f" ({nl} call)*"
        return f"start: call{more}\ncall: {call}\n"


def tag_ref(tag_tokens):
    """How a grammar writes a format's tag: as the tokenizer's own token, by id where `tag_tokens`
    maps the tags to their ids (llguidance's `<[ID]>`), by name where it is just true (llguidance
    reads `<...>` as a token's name), or else as the text."""
    if isinstance(tag_tokens, dict):
        return lambda t: f"<[{tag_tokens[t]}]>"
    return (lambda t: t) if tag_tokens else json.dumps


def call_schema(fn: dict, args_key: str) -> dict:
    return {"type": "object", "properties": {"name": {"const": fn["name"]},
                                             args_key: fn.get("parameters") or {"type": "object"}},
            "required": ["name", args_key], "additionalProperties": False}


def one_of(schemas: list[dict]) -> dict:
    schema = {"anyOf": schemas} if len(schemas) > 1 else dict(schemas[0])
    return {**schema, "x-guidance": {"whitespace_flexible": False}}
