"""Formats whose markup is the tokenizer's special tokens, JSON arguments inside: Kimi-K2's
(`kimi_k2`), DeepSeek-V3.1's (`deepseek_v31`), DeepSeek-V3's and R1's (`deepseek_v3`) and
Mistral's (`mistral`). Their text is only there when the reply is decoded with special tokens kept
(`special_tokens`: the server, the envs and the gateway then decode so, as vLLM's parsers ask). In
the first three a reply's calls stand in one section after its content: section begin, each call
(begin, a header naming the function, a separator, the arguments, end), section end; Mistral's
calls follow the content, each behind its own `[TOOL_CALLS]`."""
from __future__ import annotations

import json
import re
import string

from rollwise.agent.parsing.base import HermesParser, Parsed, ToolCall, one_of, tag_ref


class SectionParser(HermesParser):
    """The shared reading and writing; a format sets its five tokens and its call's inside
    (`_split`, `_join`, `_header_grammar`)."""
    special_tokens = True
    section_begin = section_end = call_begin = call_end = sep = ""

    def __init__(self) -> None:
        b, e = re.escape(self.section_begin), re.escape(self.section_end)
        self.pattern = re.compile(f"{b}(.*?)(?:{e}|$)", re.S)
        self.call = re.compile(f"{re.escape(self.call_begin)}(.*?)(?:{re.escape(self.call_end)}|$)", re.S)
        self.tag = self.section_begin
        self.tags = (self.section_begin, self.section_end, self.call_begin, self.call_end, self.sep)

    def parse(self, text: str) -> Parsed:
        calls, errors = [], []
        for m in self.pattern.finditer(text):
            if not m.group(0).endswith(self.section_end):
                errors.append(f"malformed tool calls: missing {self.section_end}")
                continue
            body = m.group(1)
            if not self.call.search(body):
                errors.append("malformed tool calls: an empty section")
            elif self.call.sub("", body).strip():
                errors.append(f"malformed tool calls: text between calls "
                              f"(each is {self.call_begin} ... {self.call_end})")
            for c in self.call.finditer(body):
                got = self._call(c) if c.group(0).endswith(self.call_end) else f"missing {self.call_end}"
                if isinstance(got, str):
                    errors.append(f"malformed tool call: {got}")
                else:
                    calls.append(got)
        return Parsed(calls, errors, self.content(text).strip())

    def _call(self, c: re.Match) -> ToolCall | str:
        head, sep, raw = c.group(1).partition(self.sep)
        if not sep:
            return f"expected {self.sep} between the function and its arguments"
        got = self._split(head.strip(), raw.strip())
        if isinstance(got, str):
            return got
        name, args, call_id = got
        try:
            obj = json.loads(args)
        except json.JSONDecodeError as e:
            return f"invalid JSON arguments of {name!r} ({e.msg} at char {e.pos})"
        if not isinstance(obj, dict):
            return f"the arguments of {name!r} are not a JSON object"
        return ToolCall(name, obj, call_id)

    def write(self, calls: list[ToolCall]) -> str:
        return self.section_begin + "".join(
            f"{self.call_begin}{self._join(c, i)}{self.call_end}" for i, c in enumerate(calls)) + self.section_end

    def grammar(self, fns: list[dict], single: bool, tag_tokens: bool) -> str:
        """The section with one call (`single`) or more, each of an offered function with its
        parameters' schema; `tag_tokens`: the markup as the tokenizer's special tokens (`tag_ref`)."""
        tag = tag_ref(tag_tokens)
        alts = [f"{self._header_grammar(f['name'])} {tag(self.sep)} {self._args_grammar(f)}" for f in fns]
        calls = "call" if single else "call+"
        return (f"start: {tag(self.section_begin)} {calls} {tag(self.section_end)}\n"
                f"call: {tag(self.call_begin)} ({' | '.join(alts)}) {tag(self.call_end)}\n")

    def _args_grammar(self, fn: dict) -> str:
        schema = one_of([fn.get("parameters") or {"type": "object"}])
        return f"%json {json.dumps(schema)}"

    def _split(self, head: str, args: str) -> tuple[str, str, str | None] | str:
        raise NotImplementedError

    def _join(self, call: ToolCall, index: int) -> str:
        raise NotImplementedError

    def _header_grammar(self, name: str) -> str:
        raise NotImplementedError


class KimiK2Parser(SectionParser):
    """Kimi-K2's (vLLM's `kimi_k2`): `<|tool_calls_section_begin|>`, then per call
    `<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{JSON}<|tool_call_end|>`,
    then `<|tool_calls_section_end|>`. The call's id is the header as written (Kimi's template
    writes it back, and the result's `## Return of ID`)."""
    section_begin, section_end = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    call_begin, call_end, sep = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"
    header = re.compile(r"(?:functions\.)?([\w\-.]+):\d+")

    def _split(self, head, args):
        m = self.header.fullmatch(head)
        if m is None:
            return f"expected functions.NAME:INDEX before {self.sep}, got {head[:60]!r}"
        return m.group(1), args, head

    def _join(self, call, index):
        return f"functions.{call.name}:{index}{self.sep}{json.dumps(call.arguments)}"

    def _header_grammar(self, name):
        return f"{json.dumps(f'functions.{name}:')} /[0-9]{{1,4}}/"


class DeepSeekV31Parser(SectionParser):
    """DeepSeek-V3.1's (vLLM's `deepseek_v31`): `<｜tool▁calls▁begin｜>`, then per call
    `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{JSON}<｜tool▁call▁end｜>`, then `<｜tool▁calls▁end｜>`."""
    section_begin, section_end = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    call_begin, call_end, sep = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"

    def _split(self, head, args):
        if not head or re.search(r"\s", head):
            return f"expected a function name before {self.sep}, got {head[:60]!r}"
        return head, args, None

    def _join(self, call, index):
        return f"{call.name}{self.sep}{json.dumps(call.arguments)}"

    def _header_grammar(self, name):
        return json.dumps(name)


class DeepSeekV3Parser(DeepSeekV31Parser):
    """DeepSeek-V3's and R1's (vLLM's `deepseek_v3`): as V3.1's, but each call is
    `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` newline, the arguments in a fenced JSON block
    (three backticks and `json`), then `<｜tool▁call▁end｜>`."""
    fence = re.compile(r"([^\s`]+)\s*```(?:json)?\s*(.*?)\s*```", re.S)

    def _split(self, head, args):
        m = self.fence.fullmatch(args)
        if head != "function" or m is None:
            return f"expected function{self.sep}NAME and the arguments in a ```json block"
        return m.group(1), m.group(2), None

    def _join(self, call, index):
        return f"function{self.sep}{call.name}\n```json\n{json.dumps(call.arguments)}\n```"

    def _header_grammar(self, name):
        return json.dumps("function")

    def _args_grammar(self, fn):
        return f'{json.dumps(fn["name"] + chr(10) + "```json" + chr(10))} {super()._args_grammar(fn)} "\\n```"'


class MistralParser(HermesParser):
    """Mistral's (vLLM's `mistral`; Mistral-Small 3.x, Devstral, Magistral): after the content, each
    call is `[TOOL_CALLS]NAME[ARGS]{JSON}` (tokenizer v11+; `[CALL_ID]ID` may come before `[ARGS]`),
    or, from older models, one `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}`. Calls get
    Mistral's 9-character ids, which its chat template checks when they come back."""
    special_tokens = True
    tag, tags = "[TOOL_CALLS]", ("[TOOL_CALLS]", "[ARGS]")
    v11 = re.compile(r"\s*([^\[\]{}\s]+)\s*(?:\[CALL_ID\]\s*([A-Za-z0-9]+)\s*)?(?:\[ARGS\])?\s*(.*)", re.S)

    def parse(self, text: str) -> Parsed:
        at = text.find(self.tag)
        if at < 0:
            return Parsed([], [], text.strip())
        calls, errors = [], []
        pieces = text[at + len(self.tag):].split(self.tag)
        if len(pieces) == 1 and pieces[0].lstrip().startswith("["):  # before v11: one JSON list
            try:
                listed = json.loads(pieces[0])
            except json.JSONDecodeError as e:
                why = f"malformed tool calls: invalid JSON ({e.msg} at char {e.pos})"
                return Parsed([], [why], text[:at].strip())
            got = [(c.get("name"), c.get("arguments", {}), None) for c in listed if isinstance(c, dict)]
            if len(got) != len(listed):
                errors.append('malformed tool calls: expected a list of {"name", "arguments"}')
        else:
            got = []
            for piece in pieces:
                m = self.v11.fullmatch(piece)
                try:
                    got.append((m.group(1), json.loads(m.group(3)), m.group(2)) if m else (None, None, None))
                except json.JSONDecodeError as e:
                    errors.append(f"malformed tool call {m.group(1)!r}: invalid JSON arguments "
                                  f"({e.msg} at char {e.pos})")
        for name, args, call_id in got:
            if not isinstance(name, str) or not isinstance(args, dict):
                errors.append("malformed tool call: expected [TOOL_CALLS]NAME[ARGS]{JSON object}")
            else:
                calls.append(ToolCall(name, args, call_id))
        return Parsed(calls, errors, text[:at].strip())

    def content(self, text: str) -> str:
        at = text.find(self.tag)
        return text if at < 0 else text[:at]

    def new_id(self, rng) -> str:
        """Mistral's tool-call id: 9 letters and digits."""
        return "".join(rng.choices(string.ascii_letters + string.digits, k=9))

    def write(self, calls: list[ToolCall]) -> str:
        return "".join(f"{self.tag}{c.name}[ARGS]{json.dumps(c.arguments)}" for c in calls)

    def grammar(self, fns: list[dict], single: bool, tag_tokens: bool) -> str:
        """`[TOOL_CALLS]NAME[ARGS]` then the arguments (their schema), once (`single`) or more."""
        tag = tag_ref(tag_tokens)
        alts = [f"{json.dumps(f['name'])} {tag('[ARGS]')} %json {json.dumps(one_of([f.get('parameters') or {}]))}"
                for f in fns]
        return f"start: call{'' if single else '+'}\ncall: {tag(self.tag)} ({' | '.join(alts)})\n"
