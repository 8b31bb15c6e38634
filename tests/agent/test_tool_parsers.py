"""Tool-call formats (`PARSERS`): Hermes, Llama 3's JSON calls, pythonic ones, Qwen3-Coder's and GLM-4.5's XML ones, parsed,
streamed and enforced, in an env, and from `rollwise serve --tool-call-parser ...` on real HTTP."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from rollwise.agent.env import ToolEnv
from rollwise.agent.parsing import (Glm45Parser, HermesParser, Llama3JsonParser, PythonicParser, Qwen3CoderParser,
                                   PARSERS, ToolCall, bind, make_parser, openai_tool_calls)
from rollwise.agent.tools import Tool
from rollwise.serve.process import ServerProcess


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_streamed_content_ends_alike_from_where_it_was_shown(name):
    """content_end(text, start), `start` the end shown before (the stream's linear-time form), gives
    what content_end(text) gives, over random replies of the format's markup cut at random places."""
    import random
    p, rng = make_parser(name), random.Random(name)
    marks = [m for m in (getattr(p, "tag", None), *getattr(p, "openers", ())) if m]
    pieces = [x for m in marks for x in (m, m[:len(m) // 2], m[len(m) // 2:]) if x] + [" ", "\n", "Hi", "<", "[", "{"]
    for _ in range(2000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 8)))
        shown_whole = shown = 0
        for i in sorted(set(rng.sample(range(1, len(text) + 1), rng.randint(1, len(text))))):
            shown_whole = max(p.content_end(text[:i]), shown_whole)
            shown = max(p.content_end(text[:i], shown), shown)
            assert shown == shown_whole, (text, i)


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
    assert HermesParser().content_end("Hi <tool_c") == 3 and HermesParser().content_end("Hi there, friend") == 16
    assert HermesParser().content_end("a < b <") == 6 and HermesParser().content_end("x <tool_call> y") == 2
    with pytest.raises(ValueError, match="valid: \\['deepseek_v3', 'deepseek_v31', 'glm45', 'hermes', 'kimi_k2', "
                                         "'llama3_json', 'llama4_pythonic', 'mistral', 'pythonic', 'qwen3_coder', "
                                         "'qwen3_xml'\\]"):
        make_parser("granite")
    assert type(make_parser("qwen3_xml")) is Qwen3CoderParser and type(make_parser("llama4_pythonic")) is PythonicParser


EDIT = [{"type": "function", "function": {"name": "edit", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "line": {"type": "integer"}, "scale": {"type": "number"},
    "dry": {"type": "boolean"}, "opts": {"type": "object"}, "tags": {"type": ["array", "null"]},
    "note": {"type": ["string", "null"]}}, "required": ["path", "line"]}}}]


def xml_call(name: str, **params) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_qwen3_coder_calls_are_parsed_and_typed_by_the_tools_schemas():
    code = 'if a < b:\n    print("</x>")'
    text = "I will edit it.\n" + xml_call("edit", path="src/a.py", line="12", scale="2.5", dry="True",
                                        opts="{'x': [1, 2]}", tags="null", note="null", code=code, line2="x")
    p = bind(make_parser("qwen3_coder"), EDIT)
    got = p.parse(text)
    assert not got.errors and got.text == "I will edit it."
    assert [c.name for c in got.calls] == ["edit"] and got.calls[0].arguments == {
        "path": "src/a.py", "line": 12, "scale": 2.5, "dry": True, "opts": {"x": [1, 2]}, "tags": None,
        "note": None, "code": code, "line2": "x"}  # (unknown parameters stay text)
    # unbound, every value is text; a value that is not its type stays text, for the tool's check to refuse
    assert Qwen3CoderParser().parse(text).calls[0].arguments["line"] == "12"
    assert p.parse(xml_call("edit", path="p", line="twelve")).calls[0].arguments["line"] == "twelve"
    # two calls; a missing </parameter> is read up to the next parameter, as vLLM does
    two = p.parse(xml_call("edit", path="a", line="1") + "\n<tool_call>\n<function=edit>\n<parameter=path>\nb\n"
                  "<parameter=line>\n2\n</function>\n</tool_call>")
    assert [c.arguments for c in two.calls] == [{"path": "a", "line": 1}, {"path": "b", "line": 2}] and not two.errors
    assert p.parse("<tool_call>\n<function=edit>\n").errors == ["malformed tool call: missing </tool_call>"]
    assert "expected one <function=NAME>" in p.parse("<tool_call>\nedit\n</tool_call>").errors[0]
    text, calls = openai_tool_calls(xml_call("edit", path="a", line="3"), p)
    assert text == "" and json.loads(calls[0]["function"]["arguments"]) == {"path": "a", "line": 3}
    assert p.content_end("Hi <tool_c") == 3 and p.content_end("Hi there, friend") == 16  # (Hermes's tag)


def glm_call(name: str, **args) -> str:
    return f"<tool_call>{name}\n" + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n"
                                            for k, v in args.items()) + "</tool_call>"


def test_glm45_calls_are_parsed_and_typed_by_the_tools_schemas():
    code = 'if a < b:\n    print("</x>")'
    text = "Editing.\n" + glm_call("edit", path="src/a.py", line="12", scale="2.5", dry="true",
                                   opts='{"x": [1, 2]}', tags="null", code=code)
    p = bind(make_parser("glm45"), EDIT)
    got = p.parse(text)
    assert not got.errors and got.text == "Editing."
    assert got.calls == [ToolCall("edit", {"path": "src/a.py", "line": 12, "scale": 2.5, "dry": True,
                                           "opts": {"x": [1, 2]}, "tags": None, "code": code})]
    assert Glm45Parser().parse(text).calls[0].arguments["line"] == "12"  # unbound: text
    # GLM-4.7 writes no newlines between the pieces; a call without arguments; two calls
    tight = ("<tool_call>edit<arg_key>path</arg_key><arg_value>b</arg_value><arg_key>line</arg_key>"
             "<arg_value>2</arg_value></tool_call>")
    two = p.parse(glm_call("edit", path="a", line="1") + "\n" + tight + "<tool_call>ping</tool_call>")
    assert [(c.name, c.arguments) for c in two.calls] == [("edit", {"path": "a", "line": 1}),
                                                          ("edit", {"path": "b", "line": 2}), ("ping", {})]
    assert p.parse("<tool_call>edit\n<arg_key>path").errors == ["malformed tool call: missing </tool_call>"]
    assert "expected NAME then <arg_key>" in p.parse("<tool_call>edit<arg_key>path</arg_key></tool_call>").errors[0]
    assert "expected NAME" in p.parse("<tool_call>\n</tool_call>").errors[0]
    calls = [ToolCall("edit", {"path": "a b", "line": 3, "opts": {"k": [True, None]}}), ToolCall("ping", {})]
    assert p.parse(p.write(calls)).calls == calls  # what the experts write reads back
    text, out = openai_tool_calls(glm_call("edit", path="a", line="3"), p)
    assert text == "" and json.loads(out[0]["function"]["arguments"]) == {"path": "a", "line": 3}
    assert p.content_end("Hi <tool_c") == 3 and p.content_end("Hi there, friend") == 16  # (Hermes's tag)


def test_pythonic_calls_are_parsed_and_text_stays_text():
    p = make_parser("pythonic")
    got = p.parse("[get_weather(city='Paris', unit=\"C\"), add(a=1, b=2.5, ok=True, none=None, xs=[1, {'k': true}])]")
    assert not got.errors and [(c.name, c.arguments) for c in got.calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"}),
        ("add", {"a": 1, "b": 2.5, "ok": True, "none": None, "xs": [1, {"k": True}]})]  # (JSON's true too)
    assert p.parse("<|python_start|>[f(x=1)]<|python_end|>").calls == [ToolCall("f", {"x": 1})]  # Llama 4's tags
    for text in ("[1, 2]", "The answer is [f(x=1)].", "Paris"):
        assert p.parse(text).calls == [] and not p.parse(text).errors and p.parse(text).text == text
    assert "by keyword" in p.parse("[f(1)]").errors[0] and "not a literal" in p.parse("[f(x=y)]").errors[0]
    assert "not a Python list" in p.parse("[f(x=1").errors[0] and "by keyword" in p.parse("[f(x=1), 3]").errors[0]
    calls = [ToolCall("edit", {"code": "print('a\\n')\n", "n": 3, "d": {"a": [True, None]}}), ToolCall("ping", {})]
    assert p.parse(p.write(calls)).calls == calls  # what the experts write reads back
    assert p.content_end("  [get") == 0 == p.content_end("<|python") and p.content_end("Paris") == 5
    assert PythonicParser().content("[f(x=1)]") == "" and PythonicParser().content("Hi") == "Hi"


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


@pytest.mark.parametrize("parser,call", [("llama3_json", '{"name": "add", "parameters": {"a": 2, "b": 3}}'),
                                         ("qwen3_coder", xml_call("add", a="2", b="3")),
                                         ("glm45", glm_call("add", a="2", b="3")),
                                         ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.add:0"
                                          '<|tool_call_argument_begin|>{"a": 2, "b": 3}<|tool_call_end|>'
                                          "<|tool_calls_section_end|>"),
                                         ("pythonic", "[add(a=2, b=3)]")])
def test_an_env_reads_its_models_tool_call_format_by_name(parser, call):
    env = Adder(parser=parser)

    async def go():
        await env.reset({})
        obs, _, done, _ = await env.step(call)
        return obs, done, await env.step("5")
    obs, done, (_, reward, end, _) = asyncio.run(go())
    assert not done and obs[0]["role"] == "tool" and obs[0]["content"] == "5" and end and reward == 1.0


ADD_TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a", "b"], "additionalProperties": False}}}]  # (digits: a random model's calls stay short)


@pytest.mark.parametrize("parser", ["llama3_json", "qwen3_coder", "glm45", "pythonic"])
def test_serve_with_a_tool_call_parser(model_dir, parser):
    body = {"messages": [{"role": "user", "content": "2 + 3?"}], "tools": ADD_TOOLS, "max_tokens": 80, "seed": 3,
            "tool_choice": {"type": "function", "function": {"name": "add"}}}
    with ServerProcess(model_dir, "--tool-call-parser", parser) as s:
        r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=60).json()
        c = r["choices"][0]
        assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None, c
        call = c["message"]["tool_calls"][0]["function"]
        args = json.loads(call["arguments"])
        assert call["name"] == "add" and set(args) == {"a", "b"} and all(type(v) is int for v in args.values())
        streamed = httpx.post(s.url + "/v1/chat/completions", json=body | {"stream": True}, timeout=60).text
        chunks = [json.loads(x[6:]) for x in streamed.splitlines() if x.startswith("data: {")]
        deltas = [ch["choices"][0]["delta"] for ch in chunks if ch.get("choices")]
        assert not "".join(d.get("content") or "" for d in deltas)  # the call's JSON is never shown as content
        assert [d["tool_calls"][0]["function"] for d in deltas if d.get("tool_calls")] == [call]


@pytest.mark.parametrize("parser", ["llama3_json", "qwen3_coder", "glm45", "pythonic", "kimi_k2", "deepseek_v31",
                                    "deepseek_v3", "mistral"])
def test_experts_write_their_calls_in_the_envs_format(expert_rewards, parser):
    """A warm start teaches the format the policy is parsed by: every built-in env's expert writes
    its calls with the env's parser (`ToolEnv.call_text`) and solves its tasks in it; Hermes's
    transcripts are what they were."""
    from rollwise.agent.envs import make_env
    for name in ("calculator", "code", "countdown", "frozenlake", "phonebook", "search", "sql", "bugfix"):
        tasks = make_env(name).sample_tasks(3, seed=2)
        assert expert_rewards(lambda: make_env(name, parser=parser), tasks) == [1.0] * 3, name
        first = make_env(name, parser=parser).expert(tasks[0])[0]
        start = {"qwen3_coder": "<tool_call>\n<function=", "llama3_json": '{"name": ', "pythonic": "[",
                 "glm45": "<tool_call>", "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.",
                 "deepseek_v31": "<｜tool▁calls▁begin｜>", "deepseek_v3": "<｜tool▁calls▁begin｜>",
                 "mistral": "[TOOL_CALLS]"}[parser]
        assert first.startswith(start), first
    calc = make_env("calculator")
    task = calc.sample_tasks(1, seed=0)[0]
    call = json.dumps({"name": "calculator", "arguments": {"expression": task["expression"]}})
    assert calc.expert(task)[0] == f"<tool_call>\n{call}\n</tool_call>"
