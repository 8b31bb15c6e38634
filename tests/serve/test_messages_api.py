"""Anthropic's Messages API on `rollwise serve` (the real anthropic SDK over real HTTP): text, tool
use and its results, streaming, stop sequences, token counting, its error bodies, its API-key
header; and on the agent gateway, the same streamed and refused."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import anthropic
import httpx
import pytest

from rollwise.agent.episode import run_episode
from rollwise.agent.envs import make_env
from rollwise.agent.generator import ScriptedGenerator
from rollwise.engine.tokenizer import Tokenizer
from rollwise.serve.process import ServerProcess
from rollwise.types import SamplingParams

ADD = {"name": "add", "description": "Adds two digits.", "input_schema": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a", "b"], "additionalProperties": False}}
GREEDY = {"extra_body": {"temperature": 0}}  # (the SDK has no temperature of its own any more; the server takes it)


@pytest.fixture(scope="module")
def served(model_dir):
    with ServerProcess(model_dir, "--api-key", "sk-test", "--max-model-len", "1024") as s:
        yield s


def test_messages_text_tools_and_results_through_the_anthropic_sdk(served, model_dir):
    client = anthropic.Anthropic(base_url=served.url, api_key="sk-test", max_retries=0)  # (its x-api-key header)
    msgs = [{"role": "user", "content": "Hello there"}]
    m = client.messages.create(model="m", max_tokens=12, system="Be brief.", messages=msgs, **GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.content[0].type == "text"
    assert m.stop_reason in ("end_turn", "max_tokens") and 0 < m.usage.output_tokens <= 12
    tok = Tokenizer(model_dir)
    rendered = tok.encode_chat([{"role": "system", "content": "Be brief."}, *msgs])
    assert m.usage.input_tokens == len(rendered)
    assert client.messages.count_tokens(model="m", system="Be brief.", messages=msgs).input_tokens == len(rendered)
    listed = client.models.list()  # (the Messages API's shape for it; OpenAI's for an openai client)
    assert [m.id for m in listed] == [m.display_name for m in listed] == [Path(model_dir).name]
    assert httpx.get(served.url + "/v1/models", headers={"Authorization": "Bearer sk-test"}).json()["object"] == "list"
    # a forced call: a tool_use block whose input follows the schema, then its result sent back
    m = client.messages.create(model="m", max_tokens=60, messages=[{"role": "user", "content": "2 + 3?"}],
                               tools=[ADD], tool_choice={"type": "tool", "name": "add"}, **GREEDY)
    use = m.content[-1]
    assert m.stop_reason == "tool_use" and use.type == "tool_use" and use.name == "add"
    assert set(use.input) == {"a", "b"} and all(type(v) is int for v in use.input.values())
    history = [{"role": "user", "content": "2 + 3?"}, {"role": "assistant", "content": m.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"},
                                            {"type": "text", "text": "So?"}]}]
    again = client.messages.create(model="m", max_tokens=8, messages=history, tools=[ADD], **GREEDY)
    add = {"name": "add", "description": ADD["description"], "parameters": ADD["input_schema"]}
    rendered = tok.encode_chat([{"role": "user", "content": "2 + 3?"},
                                {"role": "assistant", "content": None, "tool_calls": [{
                                    "id": use.id, "type": "function",
                                    "function": {"name": "add", "arguments": json.dumps(use.input)}}]},
                                {"role": "tool", "tool_call_id": use.id, "content": "5"},
                                {"role": "user", "content": "So?"}],
                               tools=[{"type": "function", "function": add}])
    assert again.usage.input_tokens == len(rendered)  # the blocks became exactly these chat messages
    # a stop sequence: the text up to it, and which one
    text = client.messages.create(model="m", max_tokens=16, messages=msgs, **GREEDY).content[0].text
    stop = text[4:7]
    cut = client.messages.create(model="m", max_tokens=16, messages=msgs, **GREEDY, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop and stop not in cut.content[0].text
    # a prefill: the reply goes on writing the last, the assistant's message
    prefill = [*msgs, {"role": "assistant", "content": text[:5]}]
    more = client.messages.create(model="m", max_tokens=4, messages=prefill, **GREEDY)
    rendered = tok.encode(tok.apply_chat_template(msgs) + text[:5], add_special_tokens=False)
    assert more.usage.input_tokens == len(rendered)


def test_messages_stream_as_the_sdk_reads_them(served):
    client = anthropic.Anthropic(base_url=served.url, api_key="sk-test", max_retries=0)
    msgs = [{"role": "user", "content": "Hello there"}]
    whole = client.messages.create(model="m", max_tokens=24, messages=msgs, **GREEDY)
    with client.messages.stream(model="m", max_tokens=24, messages=msgs, **GREEDY) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens
    with client.messages.stream(model="m", max_tokens=60, messages=[{"role": "user", "content": "2 + 3?"}],
                                tools=[ADD], tool_choice={"type": "any"}, **GREEDY) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    use = final.content[-1]
    assert final.stop_reason == "tool_use" and use.type == "tool_use" and set(use.input) == {"a", "b"}
    from rollwise.agent.messages_api import chat_body  # (chat's parallel_tool_calls: false, tested there)
    body = {"max_tokens": 9, "messages": [{"role": "user", "content": "hi"}], "tools": [ADD]}
    assert chat_body(body | {"tool_choice": {"type": "any", "disable_parallel_tool_use": True}}) == {
        "model": None, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, "tool_choice": "required",
        "parallel_tool_calls": False, "tools": [{"type": "function", "function": {
            "name": "add", "description": ADD["description"], "parameters": ADD["input_schema"]}}]}
    assert events[0] == "message_start" and events[-1] == "message_stop" and "content_block_start" in events


def test_bad_messages_get_the_apis_error_body_and_the_server_keeps_serving(served):
    auth = {"x-api-key": "sk-test"}
    ok = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    bad = {"no max_tokens": ({k: v for k, v in ok.items() if k != "max_tokens"}, "max_tokens is required"),
           "image": (ok | {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
                     "'image' is not supported"),
           "server tool": (ok | {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
                           "only custom tools"),
           "role": (ok | {"messages": [{"role": "system", "content": "x"}]}, "top-level system field"),
           "unknown field": (ok | {"seed": 3}, "unknown fields ['seed']"),
           "tool_choice": (ok | {"tool_choice": {"type": "sometimes"}}, "'auto', 'any', 'tool' or 'none'"),
           "named tool not offered": (ok | {"tools": [ADD], "tool_choice": {"type": "tool", "name": "mul"}},
                                      "not among the tools offered")}
    for name, (body, why) in bad.items():
        r = httpx.post(served.url + "/v1/messages", json=body, headers=auth, timeout=30)
        assert r.status_code == 400 and r.json()["type"] == "error", name
        assert r.json()["error"]["type"] == "invalid_request_error" and why in r.json()["error"]["message"], name
    wrong = httpx.post(served.url + "/v1/messages", json=ok, headers={"x-api-key": "wrong"}, timeout=30)
    assert wrong.status_code == 401
    r = httpx.post(served.url + "/v1/messages", json=ok, headers=auth, timeout=30)
    assert r.status_code == 200 and r.json()["type"] == "message"


def test_an_anthropic_agent_on_the_gateway_streams_and_is_refused_as_the_api_refuses(model_dir):
    """Through the agent gateway: a streamed Message the SDK reassembles (a tool call, then text),
    and a request the API would refuse gets its error body; the episode's turns are the model's."""
    tok = Tokenizer(model_dir)
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    got = {}

    async def agent(client, task):
        async with client.messages.stream(model="p", max_tokens=64, tools=[ADD],
                                          messages=[{"role": "user", "content": "2 + 3?"}]) as stream:
            first = await stream.get_final_message()
        use = first.content[-1]
        got["first"] = (first.stop_reason, use.type, use.name, use.input)
        try:
            await client.messages.create(model="p", max_tokens=8, messages=[{"role": "user", "content": [
                {"type": "document", "source": {}}]}])
        except anthropic.BadRequestError as e:
            got["refused"] = (e.status_code, e.body["error"]["type"], e.body["error"]["message"])
        try:  # a prefill: the policy writes whole turns of its own
            await client.messages.create(model="p", max_tokens=8, messages=[{"role": "user", "content": "2 + 3?"},
                                                                            {"role": "assistant", "content": "It"}])
        except anthropic.BadRequestError as e:
            got["prefill"] = e.body["error"]["message"]
        reply = await client.messages.create(model="p", max_tokens=64, tools=[ADD], messages=[
            {"role": "user", "content": "2 + 3?"}, {"role": "assistant", "content": first.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}]}])
        got["second"] = (reply.stop_reason, reply.content[0].text)
        history = [{"role": "user", "content": "2 + 3?"}, {"role": "assistant", "content": first.content},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}]},
                   {"role": "assistant", "content": reply.content}, {"role": "user", "content": "Say it again."}]
        last = await client.messages.create(model="p", max_tokens=64, tools=[ADD], messages=history,
                                            stop_sequences=["END"])
        got["third"] = (last.stop_reason, last.stop_sequence, last.content[0].text)
        return float(reply.content[0].text == "5")

    gen = ScriptedGenerator(tok, lambda req: [call, "5", "It is 5 END of it"][min(req.turn, 2)])
    t = asyncio.run(run_episode(gen, make_env("agent", agent=agent, client="anthropic"), {},
                                SamplingParams(max_tokens=64)))
    assert t.status == "done" and t.reward == 1.0 and t.num_turns == 3 and not t.earlier
    assert got["first"] == ("tool_use", "tool_use", "add", {"a": 2, "b": 3}) and got["second"] == ("end_turn", "5")
    assert got["third"] == ("stop_sequence", "END", "It is 5 ")
    assert got["refused"][:2] == (400, "invalid_request_error") and "'document' is not supported" in got["refused"][2]
    assert "prefilled assistant message is not taken here" in got["prefill"]


def test_thinking_budget_tokens_is_vllms_thinking_token_budget(served):
    """Anthropic's `thinking: {"type": "enabled", "budget_tokens": n}` becomes the chat request's
    thinking_token_budget (as vLLM maps it); "disabled" sets none; a bad budget is the API's 400."""
    from rollwise.agent.messages_api import chat_body
    body = {"max_tokens": 9, "messages": [{"role": "user", "content": "hi"}]}
    assert chat_body(body | {"thinking": {"type": "enabled", "budget_tokens": 64}})["thinking_token_budget"] == 64
    assert "thinking_token_budget" not in chat_body(body | {"thinking": {"type": "disabled"}})
    auth = {"x-api-key": "sk-test"}
    r = httpx.post(served.url + "/v1/messages", json=body | {"thinking": {"type": "enabled", "budget_tokens": -5}},
                   headers=auth, timeout=30)
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "budget_tokens" in r.json()["error"]["message"]
    ok = httpx.post(served.url + "/v1/messages", json=body | {"thinking": {"type": "enabled", "budget_tokens": 2}},
                    headers=auth, timeout=30)
    assert ok.status_code == 200 and ok.json()["type"] == "message"
