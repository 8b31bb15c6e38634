"""Tool-call formats whose markup is special tokens (Kimi-K2's, DeepSeek's, Mistral's): parsed, read
by an env from an episode decoded with special tokens kept, and served by `rollwise serve
--tool-call-parser` on a model whose tokenizer has them as special tokens, as the real ones do."""
from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from rollwise.agent.episode import ChatRenderer, run_episode
from rollwise.agent.generator import ScriptedGenerator
from rollwise.agent.parsing import (DeepSeekV31Parser, DeepSeekV3Parser, KimiK2Parser, MistralParser, ToolCall,
                                   make_parser, openai_tool_calls)
from rollwise.engine.tokenizer import Tokenizer
from rollwise.make_model import make_model
from rollwise.serve.process import ServerProcess
from rollwise.types import SamplingParams

from tests.agent.test_tool_parsers import ADD_TOOLS, Adder

KIMI, V31, V3, MISTRAL = KimiK2Parser(), DeepSeekV31Parser(), DeepSeekV3Parser(), MistralParser()


@pytest.fixture(scope="module")
def special_dir(tmp_path_factory) -> str:
    """A Qwen3 test model whose tokenizer has the formats' tool-call markup as special tokens."""
    return str(make_model(tmp_path_factory.mktemp("special"), family="qwen3", layers=2, hidden=64, heads=4,
                          kv_heads=2, vocab=1024, std=0.1, seed=2, tie=True, head_dim=32,
                          special_tokens=KIMI.tags + V31.tags + MISTRAL.tags))


def test_kimi_k2_calls_are_parsed_with_their_ids():
    text = ("Let me add.<|tool_calls_section_begin|><|tool_call_begin|>functions.add:0<|tool_call_argument_begin|>"
            '{"a": 2, "b": 3}<|tool_call_end|><|tool_call_begin|> functions.neg:1 <|tool_call_argument_begin|>'
            '{"x": -1}<|tool_call_end|><|tool_calls_section_end|>')
    got = KIMI.parse(text)
    assert not got.errors and got.text == "Let me add."
    assert got.calls == [ToolCall("add", {"a": 2, "b": 3}, "functions.add:0"),
                         ToolCall("neg", {"x": -1}, "functions.neg:1")]
    content, calls = openai_tool_calls(text, KIMI)  # the model's own ids, which Kimi's template writes back
    assert content == "Let me add." and [c["id"] for c in calls] == ["functions.add:0", "functions.neg:1"]
    calls = [ToolCall("edit", {"path": "a b", "n": [1, None]}), ToolCall("ping", {})]
    back = KIMI.parse(KIMI.write(calls)).calls
    assert [(c.name, c.arguments) for c in back] == [(c.name, c.arguments) for c in calls]
    assert KIMI.parse("42").calls == [] and KIMI.parse("42").text == "42" and not KIMI.parse("42").errors
    s, call, arg = "<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>"
    bad = {f"{s}{call}functions.add:0{arg}{{": "invalid JSON",
           f"{s}{call}add{arg}{{}}<|tool_call_end|><|tool_calls_section_end|>": "functions.NAME:INDEX",
           f"{s}{call}functions.add:0{{}}<|tool_call_end|><|tool_calls_section_end|>": f"{arg} between",
           f"{s}<|tool_calls_section_end|>": "an empty section"}
    for text, why in bad.items():
        errors = KIMI.parse(text + ("" if text.endswith("end|>") else "<|tool_call_end|><|tool_calls_section_end|>"))
        assert errors.errors and why in errors.errors[0], (text, errors)
    assert KIMI.parse("<|tool_calls_section_begin|>").errors == [
        "malformed tool calls: missing <|tool_calls_section_end|>"]
    # streaming: content stops where the section begins (or may begin, spelled out)
    assert KIMI.content_end("Hi<|tool_calls_section_begin|><|tool") == 2 and KIMI.content_end("Hi <|tool_") == 3


def test_deepseek_calls_are_parsed():
    text = ("Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{\"a\": 2}<｜tool▁call▁end｜>"
            "<｜tool▁call▁begin｜>ping<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    got = V31.parse(text)
    assert not got.errors and got.text == "Sure." and got.calls == [ToolCall("add", {"a": 2}), ToolCall("ping", {})]
    v3 = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n{\"a\": 2}\n```"
          "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    assert V3.parse(v3).calls == [ToolCall("add", {"a": 2})] and not V3.parse(v3).errors
    assert "```json block" in V3.parse(text).errors[0]
    assert "invalid JSON arguments of 'function'" in V31.parse(v3).errors[0]
    calls = [ToolCall("edit", {"path": "a b", "n": [1, None]}), ToolCall("ping", {})]
    assert V31.parse(V31.write(calls)).calls == calls and V3.parse(V3.write(calls)).calls == calls
    assert make_parser("deepseek_v31").special_tokens and not make_parser("hermes").special_tokens


def test_mistral_calls_are_parsed_in_either_generation():
    text = 'Sure.[TOOL_CALLS]add[ARGS]{"a": 2}[TOOL_CALLS]neg[CALL_ID]abcDEF123[ARGS]{"x": 1}'
    got = MISTRAL.parse(text)
    assert not got.errors and got.text == "Sure." and [(c.name, c.arguments) for c in got.calls] == [
        ("add", {"a": 2}), ("neg", {"x": 1})]
    assert got.calls[1].id == "abcDEF123" and got.calls[0].id is None  # (the model's id, or none)
    old = MISTRAL.parse('Sure.[TOOL_CALLS] [{"name": "add", "arguments": {"a": 2}}, {"name": "ping"}]')
    assert [(c.name, c.arguments) for c in old.calls] == [("add", {"a": 2}), ("ping", {})] and old.text == "Sure."
    assert "invalid JSON arguments" in MISTRAL.parse('[TOOL_CALLS]add[ARGS]{"a": ').errors[0]
    assert "invalid JSON" in MISTRAL.parse('[TOOL_CALLS] [{"name": ').errors[0]
    assert "expected [TOOL_CALLS]NAME[ARGS]" in MISTRAL.parse("[TOOL_CALLS]add[ARGS][1]").errors[0]
    calls = [ToolCall("edit", {"path": "a b", "n": [1, None]}), ToolCall("ping", {})]
    assert [(c.name, c.arguments) for c in MISTRAL.parse(MISTRAL.write(calls)).calls] == [
        (c.name, c.arguments) for c in calls]
    assert MISTRAL.content_end("Hi [TOOL_") == 3 and MISTRAL.content_end("Hi [x") == 5
    assert MISTRAL.parse("42").calls == [] and MISTRAL.content("42[TOOL_CALLS]x[ARGS]{}") == "42"


def test_call_ids_the_model_wrote_none_for_are_drawn_in_the_parsers_shape():
    text = '[TOOL_CALLS]add[ARGS]{"a": 2}[TOOL_CALLS]neg[CALL_ID]abcDEF123[ARGS]{"x": 1}'
    first, second = (openai_tool_calls(text, MISTRAL)[1] for _ in range(2))
    assert second[1]["id"] == first[1]["id"] == "abcDEF123"  # the model's own
    assert len(first[0]["id"]) == 9 and first[0]["id"].isalnum() and first[0]["id"] != second[0]["id"]  # (random)
    again = [openai_tool_calls(text, MISTRAL, random.Random(key))[1][0]["id"] for key in (3, 3, 5)]
    assert again[0] == again[1] != again[2]  # seeded: the same key, the same ids
    hermes = openai_tool_calls('<tool_call>{"name": "add", "arguments": {}}</tool_call>')[1][0]["id"]
    assert hermes.startswith("call_") and len(hermes) == 29 and int(hermes[5:], 16) >= 0


def test_an_agents_calls_get_the_same_ids_in_a_run_that_repeats(model_dir):
    """Mistral's template writes call ids back into the next prompt: through the agent gateway the
    ids come from the reply and its place, so the same episode gives the same tokens."""
    from rollwise.agent.envs import make_env
    tok = Tokenizer(model_dir)
    call = '[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}'

    def run() -> list[str]:
        ids: list[str] = []

        async def agent(client, task):
            messages = [{"role": "user", "content": "add"}]
            for _ in range(2):
                reply = await client.chat.completions.create(model="p", messages=messages, tools=ADD_TOOLS)
                m = reply.choices[0].message
                ids.extend(c.id for c in m.tool_calls)
                messages += [m.model_dump(exclude_none=True),
                             {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "3"}]
            return 1.0
        gen = ScriptedGenerator(tok, lambda req: call)
        env = make_env("agent", agent=agent, parser="mistral")
        traj = asyncio.run(run_episode(gen, env, {}, SamplingParams(max_tokens=64)))
        assert traj.status == "done", traj.status
        return ids
    a, b = run(), run()
    assert a == b and len(a) == 2 and a[0] != a[1] and all(len(i) == 9 and i.isalnum() for i in a)


@pytest.mark.parametrize("parser", ["kimi_k2", "deepseek_v31", "mistral"])
def test_an_episode_reads_calls_written_in_special_tokens(special_dir, parser):
    """The model writes its call's markup as special tokens; the env asks for them kept
    (`turn_params`), so the episode's text holds the call, and the end-of-turn token's text stays out."""
    tok = Tokenizer(special_dir)
    call = make_parser(parser).write([ToolCall("add", {"a": 2, "b": 3})])
    markup = [tok.added_token_id(t) for t in make_parser(parser).tags]
    assert None not in markup and set(markup) <= set(tok.encode(call, add_special_tokens=False))
    gen = ScriptedGenerator(tok, lambda req: call if req.turn == 0 else "5")
    traj = asyncio.run(run_episode(gen, Adder(parser=parser), {}, SamplingParams(max_tokens=64),
                                   renderer=ChatRenderer(tok)))
    assert traj.status == "done" and traj.reward == 1.0 and traj.num_turns == 2
    first = traj.messages[2]
    assert first["role"] == "assistant" and first["content"] == call  # (no <|im_end|>)
    assert traj.messages[3] == {"role": "tool", "content": "5", **{k: traj.messages[3][k] for k in traj.messages[3]
                                                                   if k not in ("role", "content")}}
    # decoded as by default, the markup is gone and the call would have been read as the answer
    assert tok.decode(tok.encode(call, add_special_tokens=False)) != call


@pytest.mark.parametrize("parser", ["kimi_k2", "deepseek_v31", "deepseek_v3", "mistral"])
def test_serve_with_a_special_token_tool_call_parser(special_dir, parser):
    # (Mistral's calls have no closing tag: a random model asked for "one or more" goes on calling)
    choice = {"type": "function", "function": {"name": "add"}} if parser == "mistral" else "required"
    body = {"messages": [{"role": "user", "content": "2 + 3?"}], "tools": ADD_TOOLS, "max_tokens": 80, "seed": 3,
            "tool_choice": choice, "return_token_ids": True}
    tok = Tokenizer(special_dir)
    markup = {tok.added_token_id(t) for t in make_parser(parser).tags}
    with ServerProcess(special_dir, "--tool-call-parser", parser) as s:
        r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=60).json()
        c = r["choices"][0]
        assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None, c
        assert markup <= set(c["token_ids"])  # the grammar wrote the markup as the special tokens
        call = c["message"]["tool_calls"][0]
        args = json.loads(call["function"]["arguments"])
        assert call["function"]["name"] == "add" and set(args) == {"a", "b"}
        ids = {"kimi_k2": lambda i: i.startswith("functions.add:"), "mistral": lambda i: len(i) == 9 and i.isalnum()}
        assert ids.get(parser, lambda i: i.startswith("call_"))(call["id"]), call["id"]
        streamed = httpx.post(s.url + "/v1/chat/completions", json=body | {"stream": True}, timeout=60).text
        chunks = [json.loads(x[6:]) for x in streamed.splitlines() if x.startswith("data: {")]
        deltas = [ch["choices"][0]["delta"] for ch in chunks if ch.get("choices")]
        assert not "".join(d.get("content") or "" for d in deltas)  # the markup is never shown as content
        assert [d["tool_calls"][0]["function"] for d in deltas if d.get("tool_calls")] == [call["function"]]
        # without tools, special tokens are skipped as before; vLLM's two flags for a completion
        plain = {"prompt": "2 + 3 =", "max_tokens": 8, "structured_outputs": {"choice": ["5", "6"]}, "seed": 1}
        for extra, ends in (({}, [""]), ({"skip_special_tokens": False}, [""]),
                            ({"skip_special_tokens": False, "include_stop_str_in_output": True},
                             ["<|im_end|>", "<|endoftext|>"])):  # (either of the model's EOS tokens ends it)
            got = httpx.post(s.url + "/v1/completions", json=plain | extra, timeout=60).json()["choices"][0]
            assert got["finish_reason"] == "stop" and got["text"][:1] in "56" and got["text"][1:] in ends, (extra, got)


def test_the_agent_gateway_keeps_special_tokens_while_tools_are_offered():
    from rollwise.agent.envs.agent import AgentEnv
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    for parser, body, kept in (("kimi_k2", {"tools": tools}, True), ("kimi_k2", {}, False),
                               ("kimi_k2", {"tools": tools, "tool_choice": "none"}, False),
                               ("hermes", {"tools": tools}, False)):
        env = AgentEnv(agent=lambda client, task: None, parser=parser)
        env._context(body, [{"role": "user", "content": "hi"}])
        assert env.turn_params(SamplingParams(max_tokens=8)).skip_special_tokens is not kept, (parser, body)
