"""A thinking model's reasoning apart from its reply (`--reasoning-parser`, rollwise.agent.reasoning):
the split of whole and streamed replies, in an env, and from `rollwise serve` on real HTTP."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from rollwise.agent.reasoning import ReasoningParser, ReasoningStream
from rollwise.config import ServerConfig
from rollwise.serve.process import ServerProcess
from tests.agent.test_tool_parsers import Adder


def streamed(parser: ReasoningParser, text: str) -> tuple[str, str]:
    """(reasoning, content) as a stream shows them, one character at a time."""
    thought, content = "", ""
    for i in range(1, len(text) + 1):
        at = parser.content_start(text[:i], final=i == len(text))
        said = parser.shown_reasoning(text[:i]) if at is None else parser.split(text[:i][:at])[0] or ""
        assert said.startswith(thought)  # nothing shown is taken back
        thought = said
        now = "" if at is None else text[:i][at:]
        assert now.startswith(content)
        content = now
    return thought, content


@pytest.mark.parametrize("text,qwen3,r1", [
    ("<think>\nadd 2 and 3</think>\n\nIt is 5.", ("\nadd 2 and 3", "\n\nIt is 5."), ("\nadd 2 and 3", "\n\nIt is 5.")),
    ("It is 5.", (None, "It is 5."), ("It is 5.", "")),  # R1's think opens in the prompt: all reasoning
    ("add 2 and 3</think>It is 5.", (None, "add 2 and 3</think>It is 5."), ("add 2 and 3", "It is 5.")),
    ("<think>cut off while thinking", ("cut off while thinking", ""), ("cut off while thinking", "")),
    ("<thin>k", (None, "<thin>k"), ("<thin>k", "")),
    ("", (None, ""), (None, "")),
])
def test_replies_split_alike_whole_and_streamed(text, qwen3, r1):
    for name, want in (("qwen3", qwen3), ("deepseek_r1", r1)):
        p = ReasoningParser(name)
        assert p.split(text) == want, name
        assert streamed(p, text) == (want[0] or "", want[1]), name
    with pytest.raises(ValueError, match="valid: \\['deepseek_r1', 'qwen3'\\]"):
        ReasoningParser("o1")
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        ServerConfig(reasoning_parser="o1")


def test_the_incremental_stream_shows_what_the_whole_text_methods_show():
    """ReasoningStream (each piece's work bounded by the piece) against content_start / shown_reasoning /
    split on the whole reply so far, over random replies of tag fragments cut at random places."""
    import random
    rng = random.Random(0)
    pieces = ["<think>", "</think>", "<th", "ink>", "</th", "<", "/", ">", " ", "\n", "abc", "think", "k>"]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8)))
        cuts = sorted(set(rng.sample(range(1, len(text) + 1), rng.randint(0, len(text))) + [len(text)]))
        for name in ("qwen3", "deepseek_r1"):
            p = ReasoningParser(name)
            stream, thought, want, got = ReasoningStream(p), 0, "", ""
            for i in cuts:
                at = p.content_start(text[:i], final=i == len(text))
                said = p.shown_reasoning(text[:i]) if at is None else p.split(text[:i][:at])[0] or ""
                want, thought = want + said[thought:], max(thought, len(said))
                new, at_now = stream.feed(text[:i], final=i == len(text))
                got += new
                assert (at_now, got) == (at, want), (name, text, cuts, i)


def test_an_env_reads_calls_and_answers_past_the_reasoning():
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'

    async def go(env, *turns):
        await env.reset({})
        return [await env.step(t) for t in turns]
    # a call written while thinking is not made; the answer after the reasoning is scored
    (obs, reward, done, info), = asyncio.run(go(Adder(), f"<think>maybe {call}? no.</think>5"))
    assert done and reward == 1.0 and info["answer"] == "5"
    (obs, _, done, _), (_, reward, end, _) = asyncio.run(go(Adder(), f"<think>I need the sum.</think>\n{call}", "5"))
    assert not done and obs[0]["content"] == "5" and end and reward == 1.0
    (_, reward, done, _), = asyncio.run(go(Adder(reasoning=None), "<think>x</think>5"))  # off: the whole text
    assert done and reward == 0.0
    (_, reward, done, _), = asyncio.run(go(Adder(reasoning="deepseek_r1"), "so 5</think>5"))
    assert done and reward == 1.0


def test_serve_with_a_reasoning_parser(model_dir):
    """A reply held (structured outputs) to reasoning then an answer, or reasoning then a tool
    call: the message's reasoning_content and content, and the stream's deltas, add up to them."""
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]
    think = "start: <think> /[a-z]{2,8}/ </think> "  # (the tags are tokens of their own: named, as Lark does)
    answer = {"messages": [{"role": "user", "content": "2 + 3?"}], "max_tokens": 40, "seed": 1,
              "structured_outputs": {"grammar": think + "/[A-Z][a-z]{2,6}/"}}
    call = json.dumps('\n{"name": "add", "arguments": {"a": 5}}\n')
    calling = {**answer, "tools": tools, "max_tokens": 60,
               "structured_outputs": {"grammar": f"{think} <tool_call> {call} </tool_call>"}}
    with ServerProcess(model_dir, "--reasoning-parser", "qwen3") as s:
        post = lambda body: httpx.post(s.url + "/v1/chat/completions", json=body, timeout=60)  # noqa: E731
        m = post(answer).json()["choices"][0]["message"]
        assert 2 <= len(m["reasoning_content"]) <= 8 and m["reasoning"] == m["reasoning_content"]
        assert m["content"][0].isupper() and "<think>" not in m["content"]
        chunks = [json.loads(x[6:]) for x in post(answer | {"stream": True}).text.splitlines()
                  if x.startswith("data: {")]
        deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == m["reasoning_content"]
        assert "".join(d.get("content") or "" for d in deltas) == m["content"]
        # SGLang's separate_reasoning false: no split, the reasoning left in the content, tags and all
        whole = post(answer | {"separate_reasoning": False}).json()["choices"][0]["message"]
        assert "reasoning_content" not in whole and whole["content"].startswith("<think>")
        assert m["reasoning_content"] in whole["content"] and whole["content"].endswith(m["content"])
        # its stream_reasoning false: the reasoning held and sent as one delta once it ends
        held = post(answer | {"stream": True, "stream_reasoning": False}).text
        chunks = [json.loads(x[6:]) for x in held.splitlines() if x.startswith("data: {")]
        deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
        assert [d["reasoning_content"] for d in deltas if d.get("reasoning_content")] == [m["reasoning_content"]]
        assert "".join(d.get("content") or "" for d in deltas) == m["content"]
        c = post(calling).json()["choices"][0]
        assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
        assert c["message"]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 5}'}
        assert c["message"]["reasoning_content"].isalpha()
        chunks = [json.loads(x[6:]) for x in post(calling | {"stream": True}).text.splitlines()
                  if x.startswith("data: {")]
        deltas = [ch["choices"][0]["delta"] for ch in chunks if ch.get("choices")]
        assert not "".join(d.get("content") or "" for d in deltas)
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == c["message"]["reasoning_content"]
        assert [d["tool_calls"][0]["function"] for d in deltas if d.get("tool_calls")] == \
            [c["message"]["tool_calls"][0]["function"]]
    with ServerProcess(model_dir) as s:  # no parser: the reply as it is
        m = httpx.post(s.url + "/v1/chat/completions", json=answer, timeout=60).json()["choices"][0]["message"]
        assert m["content"].startswith("<think>") and "reasoning_content" not in m


def test_the_responses_api_gives_the_reasoning_an_item_of_its_own():
    """A chat reply with reasoning as a Response (whole, and from a chat stream's deltas): a
    reasoning item first, then the message; a reasoning item sent back as input is taken."""
    from rollwise.agent.responses_api import chat_body, response, streamed_events
    reply = {"model": "m", "choices": [{"finish_reason": "stop", "message": {
        "role": "assistant", "content": "It is 5.", "reasoning_content": "2 + 3"}}]}
    out = response(reply, {})["output"]
    assert [i["type"] for i in out] == ["reasoning", "message"] and out[0]["content"][0]["text"] == "2 + 3"

    async def events(deltas):
        async def chunks():
            for d in deltas:
                yield {"model": "m", "choices": [{"delta": d, "finish_reason": None}]}
        return [e async for e in streamed_events(chunks(), {"model": "m"})]
    got = asyncio.run(events([{"role": "assistant", "reasoning_content": "2 + "}, {"reasoning_content": "3"},
                              {"content": "It is "}, {"content": "5."}]))
    kinds = [(e["type"], e.get("output_index")) for e in got]
    assert kinds.index(("response.reasoning_text.done", 0)) < kinds.index(("response.output_item.added", 1))
    assert "".join(e["delta"] for e in got if e["type"] == "response.reasoning_text.delta") == "2 + 3"
    assert "".join(e["delta"] for e in got if e["type"] == "response.output_text.delta") == "It is 5."
    final = got[-1]["response"]["output"]
    assert [i["type"] for i in final] == ["reasoning", "message"]
    added = [e["item"]["id"] for e in got if e["type"] == "response.output_item.added"]
    assert added == [i["id"] for i in final]  # the stream's items are the Response's
    body, messages = chat_body({"input": [{"role": "user", "content": "2 + 3?"}, out[0], out[1],
                                          {"role": "user", "content": "and 4 + 4?"}]}, {})
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]


def test_an_agent_gets_the_policys_reasoning_apart_and_its_history_still_continues(model_dir):
    """Through the agent gateway: the reply's reasoning as reasoning_content, the call made after
    it; the agent sends the message back (without the reasoning, as chat templates drop it) and the
    episode stays one token sequence with the reasoning's tokens in it."""
    from rollwise.agent.envs import make_env
    from rollwise.agent.episode import run_episode
    from rollwise.agent.generator import RecordingGenerator, ScriptedGenerator
    from rollwise.engine.tokenizer import Tokenizer
    from rollwise.types import SamplingParams
    tok = Tokenizer(model_dir)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 5}}\n</tool_call>'
    turns = [f"<think>not {call} yet</think>\n{call}", "<think>done</think>It is 5."]
    seen = []

    async def agent(client, task):
        messages = [{"role": "user", "content": "2 + 3?"}]
        r = await client.chat.completions.create(model="p", messages=messages, tools=tools)
        m = r.choices[0].message
        seen.append((m.content, m.tool_calls[0].function.arguments, m.model_extra.get("reasoning_content")))
        messages += [{"role": "assistant", "content": m.content, "tool_calls": [t.model_dump() for t in m.tool_calls]},
                     {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "5"}]
        r = await client.chat.completions.create(model="p", messages=messages, tools=tools)
        seen.append((r.choices[0].message.content, r.choices[0].message.model_extra.get("reasoning_content")))
        return 1.0
    gen = RecordingGenerator(ScriptedGenerator(tok, lambda req: turns[min(req.turn, 1)]))
    traj = asyncio.run(run_episode(gen, make_env("agent", agent=agent), {}, SamplingParams(max_tokens=64)))
    assert traj.status == "done" and traj.num_turns == 2 and not traj.earlier  # one context: it continued
    assert seen == [(None, '{"a": 5}', f"not {call} yet"), ("It is 5.", "done")]
    assert tok.decode(gen.calls[1][0].prompt_token_ids).count("not") == 1  # the reasoning's tokens stay in it


def test_route_with_a_reasoning_parser(model_dir):
    """`rollwise route --reasoning-parser qwen3` in front of a replica without one: the route splits
    the reasoning off, whole and streamed, in chat and as the Messages API's thinking block."""
    from tests.router.test_real_replicas import start_route
    think = "start: <think> /[a-z]{2,8}/ </think> /[A-Z][a-z]{2,6}/"
    answer = {"messages": [{"role": "user", "content": "2 + 3?"}], "max_tokens": 40, "seed": 1,
              "structured_outputs": {"grammar": think}}
    with ServerProcess(model_dir) as replica:
        proc, url = start_route([replica], model_dir, "round_robin", "--reasoning-parser", "qwen3")
        try:
            m = httpx.post(url + "/v1/chat/completions", json=answer, timeout=60).json()["choices"][0]["message"]
            assert 2 <= len(m["reasoning_content"]) <= 8 and m["content"][0].isupper()
            chunks = [json.loads(x[6:]) for x in httpx.post(url + "/v1/chat/completions", json=answer | {
                "stream": True}, timeout=60).text.splitlines() if x.startswith("data: {")]
            deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
            assert "".join(d.get("reasoning_content") or "" for d in deltas) == m["reasoning_content"]
            assert "".join(d.get("content") or "" for d in deltas) == m["content"]
        finally:
            proc.terminate()
            proc.wait(10)


def test_the_messages_api_gives_the_reasoning_a_thinking_block():
    """A chat reply with reasoning as a Message (whole, and from a chat stream's deltas): a thinking
    block first, then the text and the calls; a thinking block sent back is left out of the chat."""
    from rollwise.agent.messages_api import chat_body, message, streamed_events
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 5}'}}
    reply = {"model": "m", "usage": {"prompt_tokens": 7, "completion_tokens": 9}, "choices": [{
        "finish_reason": "tool_calls", "message": {"role": "assistant", "content": "Adding.",
                                                   "reasoning_content": "2 + 3", "tool_calls": [call]}}]}
    m = message(reply, {})
    assert [b["type"] for b in m["content"]] == ["thinking", "text", "tool_use"] and m["stop_reason"] == "tool_use"
    assert m["content"][0]["thinking"] == "2 + 3" and m["content"][2]["input"] == {"a": 5}
    chunks = [{"choices": [{"delta": {"reasoning_content": "2 + "}}]},
              {"choices": [{"delta": {"reasoning_content": "3"}}]},
              {"choices": [{"delta": {"content": "Add"}}]}, {"choices": [{"delta": {"content": "ing."}}]},
              {"choices": [{"delta": {"tool_calls": [call]}, "finish_reason": "tool_calls"}]},
              {"choices": [], "usage": reply["usage"]}]

    async def events():
        async def gen():
            for c in chunks:
                yield c
        return [e async for e in streamed_events(gen(), {})]
    got = asyncio.run(events())
    starts = [d["content_block"]["type"] for name, d in got if name == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"] and got[-1][0] == "message_stop"
    text = "".join(d["delta"].get("thinking", "") + d["delta"].get("text", "") for name, d in got
                   if name == "content_block_delta")
    assert text == "2 + 3Adding." and got[-2][1]["delta"]["stop_reason"] == "tool_use"
    assert got[-2][1]["usage"] == {"input_tokens": 7, "output_tokens": 9}
    body = chat_body({"max_tokens": 5, "messages": [{"role": "user", "content": "2 + 3?"}, {
        "role": "assistant", "content": [{"type": "thinking", "thinking": "2 + 3", "signature": ""},
                                         {"type": "text", "text": "5"}]}]})
    assert body["messages"][1] == {"role": "assistant", "content": "5"}
