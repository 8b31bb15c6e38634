"""Tool-call formats (`PARSERS`): Hermes and Llama 3's JSON calls, parsed, streamed and enforced,
in an env, and from `rollwise serve --tool-call-parser llama3_json` on real HTTP."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from rollwise.agent.env import ToolEnv
from rollwise.agent.parsing import HermesParser, Llama3JsonParser, make_parser, openai_tool_calls
from rollwise.agent.tools import Tool
from rollwise.serve.process import ServerProcess


def test_llama3_json_calls_are_parsed_and_text_stays_text():
    p = Llama3JsonParser()
    got = p.parse('<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "get", "arguments": "{\\"q\\": \\"x\\"}"}')
    assert [(c.name, c.arguments) for c in got.calls] == [("add", {"a": 1}), ("get", {"q": "x"})] and not got.errors
    assert p.parse("The answer is {42}.").calls == [] and p.parse("The answer is {42}.").text == "The answer is {42}."
    assert p.parse('{"name": 3}').errors and p.parse('{"name": "f", "parameters": {"a": ').errors
    text, calls = openai_tool_calls('{"name": "add", "parameters": {"a": 1}}', p)
    assert text == "" and calls[0]["function"] == {"name": "add", "arguments": '{"a": 1}'}
    # streaming: a reply that starts as a call shows no content; text shows at once
    assert p.content_end('  {"na') == 0 == p.content_end("<|pyth") and p.content_end("Hello") == 5
    assert HermesParser().content_end("Hi <tool_c") == 0 and HermesParser().content_end("Hi there, friend") == 6
    with pytest.raises(ValueError, match="valid: \\['hermes', 'llama3_json'\\]"):
        make_parser("mistral")


class Adder(ToolEnv):
    name = "adder"

    def make_tools(self, task):
        def add(a: int, b: int) -> int:
            """Adds."""
            return a + b
        return [Tool(add)]

    def prompt(self, task):
        return "add"

    def score(self, task, answer):
        return float(answer.strip() == "5")


def test_an_env_reads_its_models_tool_call_format_by_name():
    env = Adder(parser="llama3_json")

    async def go():
        await env.reset({})
        obs, _, done, _ = await env.step('{"name": "add", "parameters": {"a": 2, "b": 3}}')
        return obs, done, await env.step("5")
    obs, done, (_, reward, end, _) = asyncio.run(go())
    assert not done and obs[0]["role"] == "tool" and obs[0]["content"] == "5" and end and reward == 1.0


def test_serve_with_the_llama3_json_parser(model_dir):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a", "b"], "additionalProperties": False}}}]
    body = {"messages": [{"role": "user", "content": "2 + 3?"}], "tools": tools, "max_tokens": 40, "seed": 3,
            "tool_choice": {"type": "function", "function": {"name": "add"}}}
    with ServerProcess(model_dir, "--tool-call-parser", "llama3_json") as s:
        r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=60).json()
        c = r["choices"][0]
        assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None, c
        call = c["message"]["tool_calls"][0]["function"]
        assert call["name"] == "add" and set(json.loads(call["arguments"])) == {"a", "b"}
        streamed = httpx.post(s.url + "/v1/chat/completions", json=body | {"stream": True}, timeout=60).text
        chunks = [json.loads(x[6:]) for x in streamed.splitlines() if x.startswith("data: {")]
        deltas = [ch["choices"][0]["delta"] for ch in chunks if ch.get("choices")]
        assert not "".join(d.get("content") or "" for d in deltas)  # the call's JSON is never shown as content
        assert [d["tool_calls"][0]["function"] for d in deltas if d.get("tool_calls")] == [call]
