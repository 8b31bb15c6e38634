"""Tool-call parsing from model text, by the format the model was trained on (`PARSERS`, vLLM's
names): `hermes` (Qwen, Hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks
in the text), `llama3_json` (Llama 3.1+: the reply is the call, `{"name": ..., "parameters":
{...}}`, several joined by "; ", optionally after `<|python_tag|>`), `pythonic` (Llama 3.2's and
4's: the reply is `[name(key=value, ...)]`, Python literals), `qwen3_coder` (Qwen3-Coder's XML:
`<tool_call><function=NAME><parameter=KEY>value</parameter>...</function></tool_call>`, each value
raw text, typed by the tool's schema), `glm45` (GLM-4.5's: `<tool_call>NAME<arg_key>KEY</arg_key>
<arg_value>value</arg_value>...</tool_call>`, typed as qwen3_coder's), and the formats whose markup
is special tokens, read from replies decoded with them kept: `kimi_k2` (`<|tool_calls_section_begin|>
<|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}<|tool_call_end|>...`),
`deepseek_v31` (`<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}...`) and
`deepseek_v3` (V3's and R1's: `function<｜tool▁sep｜>NAME` and a fenced JSON block) and `mistral`
(`[TOOL_CALLS]NAME[ARGS]{...}`, or older models' `[TOOL_CALLS]` and a JSON list). Each parser
also says how much of a reply being streamed can be shown as content (`content_end`), writes the
grammar that holds a reply to calls of given functions (`grammar`, for tool_choice "required" or
a named one) and writes calls as the model does (`write`, for experts' transcripts).
`for_tools(tools)` gives the parser for a request's tools (their schemas type qwen3_coder's and
glm45's values; the others need none). The formats live in `base` (the types, Hermes),
`whole_reply` (Llama 3's JSON, pythonic), `xml_calls` (qwen3_coder, glm45) and `special_calls`
(kimi_k2, deepseek_v31, deepseek_v3, mistral)."""
from __future__ import annotations

import json
import random

from rollwise.agent.parsing.base import HermesParser, Parsed, ToolCall, ToolCallParser, openai_id
from rollwise.agent.parsing.special_calls import DeepSeekV31Parser, DeepSeekV3Parser, KimiK2Parser, MistralParser
from rollwise.agent.parsing.whole_reply import Llama3JsonParser, PythonicParser
from rollwise.agent.parsing.xml_calls import Glm45Parser, Qwen3CoderParser

__all__ = ["PARSERS", "DeepSeekV31Parser", "DeepSeekV3Parser", "Glm45Parser", "HermesParser", "KimiK2Parser",
           "Llama3JsonParser", "MistralParser", "Parsed", "PythonicParser", "Qwen3CoderParser", "ToolCall", "ToolCallParser", "bind",
           "forced_tool_calls", "make_parser", "openai_tool_calls"]

PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "qwen3_coder": Qwen3CoderParser,
           "glm45": Glm45Parser, "pythonic": PythonicParser, "kimi_k2": KimiK2Parser,
           "deepseek_v31": DeepSeekV31Parser, "deepseek_v3": DeepSeekV3Parser, "mistral": MistralParser,
           # vLLM's other names for the same formats
           "qwen3_xml": Qwen3CoderParser, "llama4_pythonic": PythonicParser}


def bind(parser: ToolCallParser, tools: list[dict] | None) -> ToolCallParser:
    """The parser for a request's tools (OpenAI's function schemas): `parser.for_tools(tools)`, or
    the parser itself if it has no such method (a user's parser written before it)."""
    for_tools = getattr(parser, "for_tools", None)
    return parser if for_tools is None else for_tools(tools)


def make_parser(name: str) -> ToolCallParser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; valid: {sorted(PARSERS)}")
    return PARSERS[name]()


def openai_tool_calls(text: str, parser: ToolCallParser | None = None,
                      rng: random.Random | None = None) -> tuple[str, list[dict]] | None:
    """A reply's tool calls (the parser's format, Hermes by default) as OpenAI's `tool_calls` (and the
    text around them), as vLLM's parsers give them; None if it has none or a malformed one (the reply
    stays text). A call the model wrote no id for gets one in the parser's shape (`new_id`) from
    `rng`: random by default, as vLLM's; a seeded one where the ids must repeat (a template that
    writes them back into the next prompt, in a run that must repeat)."""
    parser = parser or HermesParser()
    got = parser.parse(text)
    if not got.calls or got.errors:
        return None
    rng = rng or _ids
    new_id = getattr(parser, "new_id", openai_id)  # (a user's parser written before it: OpenAI's)
    return got.text, [{"id": c.id or new_id(rng), "type": "function",
                       "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in got.calls]


_ids = random.Random()  # (seeded from the OS)


def forced_tool_calls(tools: list[dict], tool_choice, tag_tokens=False,
                      parser: ToolCallParser | None = None) -> dict | None:
    """The structured output (a Lark grammar, `structured_outputs`) that makes a reply tool calls in
    the parser's format (default Hermes), for OpenAI's tool_choice "required" (one or more calls,
    each of an offered function with its parameters' schema) or {"type": "function", "function":
    {"name": N}} (exactly one call of N), as vLLM enforces them; None for "auto", "none" or no
    choice. ValueError for a name not offered. `tag_tokens`: the tokenizer has the format's tags
    (Qwen's `<tool_call>`, Kimi's and Mistral's special tokens) as tokens of their own, {tag: id}
    (or true: by name): the grammar names them as tokens (`base.tag_ref`), so the reply is
    tokenized as the model writes it."""
    if tool_choice in (None, "auto", "none"):
        return None
    fns = [t.get("function") or {} for t in tools if t.get("type", "function") == "function"]
    if tool_choice == "required":
        name = None
    elif isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict) \
            and isinstance(tool_choice["function"].get("name"), str):
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
