"""Agents written against the OpenAI API (the real openai SDK over real HTTP to the gateway):
the same token ids as the built-in env, plain-function agents, histories that are not extended,
agents that fail, episodes cut off under a request in wait, the endpoint's errors and streaming."""
from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from rollwise.agent.envs import make_env
from rollwise.agent.episode import ChatRenderer, collect, run_episode
from rollwise.agent.gateway import Gateway
from rollwise.agent.generator import ForcedGenerator, RecordingGenerator, ScriptedGenerator, expert_policy
from rollwise.engine.async_engine import AsyncEngine
from rollwise.engine.tokenizer import Tokenizer
from rollwise.types import SamplingParams

AGENT = f"{Path(__file__).parents[2] / 'examples' / 'phonebook_agent.py'}:PhonebookAgent"
P = SamplingParams(temperature=1.0, max_tokens=64)


def phonebook():
    return make_env("phonebook")


def agent_env(agent=AGENT, **kw):
    return make_env("agent", agent=agent, **kw)


def _scripted(tok, turns):
    return ScriptedGenerator(tok, lambda req: turns[min(req.turn, len(turns) - 1)])


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_an_openai_sdk_agent_gives_the_builtin_envs_token_ids_on_the_engine(model_dir, api):
    """The example agent (its own messages, tools and scoring, over the openai SDK's chat completions
    or Responses API, or the anthropic SDK's Messages API) and the built-in phonebook env,
    teacher-forced to the same expert replies on a real engine: identical trajectories."""
    tasks = phonebook().sample_tasks(3, seed=4)
    engine = AsyncEngine(model_dir, max_num_seqs=8)
    try:
        gen = ForcedGenerator(engine, expert_policy(phonebook, tasks))

        async def go(make):
            return [await run_episode(gen, make(), t, P, trajectory_id=f"{t['id']}/0", group_id=str(t["id"]))
                    for t in tasks]
        client = {"client": "anthropic"} if api == "messages" else {}
        native = asyncio.run(go(phonebook))
        agent = asyncio.run(go(lambda: agent_env(agent_options={"api": api}, **client)))
    finally:
        engine.shutdown()
    for a, b in zip(native, agent):
        assert b.status == "done" and b.reward == a.reward == 1.0 and len(b.turns) == len(a.turns) == 2
        assert b.token_ids == a.token_ids and b.loss_mask == a.loss_mask
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5) and b.num_generated > 0
        assert [m["role"] for m in b.messages] == [m["role"] for m in a.messages]


def test_a_plain_function_agent_runs_in_a_thread_with_a_sync_client(model_dir):
    tok = Tokenizer(model_dir)
    seen = []

    def agent(client, task):  # a blocking agent: openai.OpenAI
        assert isinstance(client, openai.OpenAI)
        messages = [{"role": "user", "content": task["q"]}]
        for _ in range(3):
            reply = client.chat.completions.create(model="anything", messages=messages)
            seen.append((reply.choices[0].finish_reason, reply.usage.completion_tokens))
            messages += [reply.choices[0].message.model_dump(), {"role": "user", "content": "again"}]
        return len(messages)

    traj = asyncio.run(run_episode(_scripted(tok, ["one", "two", "three"]), agent_env(agent), {"q": "count"}, P))
    assert traj.status == "done" and traj.reward == 7.0 and len(traj.turns) == 3
    assert [m["content"] for m in traj.messages if m["role"] == "assistant"] == ["one", "two", "three"]
    assert seen == [("stop", len(tok.encode(w, add_special_tokens=False)) + 1) for w in ("one", "two", "three")]


def test_a_rewritten_history_starts_a_new_context_with_exactly_what_the_model_sees(model_dir):
    """An agent that summarises (drops its history) and then changes its tools: each request that
    does not continue the conversation is the first prompt of a new token sequence."""
    tok = Tokenizer(model_dir)
    r = ChatRenderer(tok)
    tools = [{"type": "function", "function": {"name": "look", "description": "Look.",
                                               "parameters": {"type": "object", "properties": {}}}}]
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    summary = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "so far: hello"}]

    async def agent(client, task):
        reply = await client.chat.completions.create(model="p", messages=first)
        again = summary + [{"role": "user", "content": "go on"}]
        reply2 = await client.chat.completions.create(model="p", messages=again)  # rewritten: context 2
        follow = again + [reply2.choices[0].message, {"role": "user", "content": "and?"}]  # extends it
        await client.chat.completions.create(model="p", messages=follow)
        reply4 = await client.chat.completions.create(model="p", messages=follow[:1], tools=tools)  # new tools
        return float(reply.choices[0].message.content == "hello" and reply4.choices[0].message.content == "d")

    gen = RecordingGenerator(_scripted(tok, ["hello", "b", "c", "d"]))
    traj = asyncio.run(run_episode(gen, agent_env(agent), {}, P, trajectory_id="e"))
    assert traj.status == "done" and traj.reward == 1.0 and traj.num_turns == 4 and len(traj.earlier) == 2
    prompts = [req.prompt_token_ids for req, _ in gen.calls]
    c1, c2, c3 = traj.sequences()
    assert prompts[0] == r.prompt_ids(first, None) and c1.token_ids == prompts[0] + gen.calls[0][1].token_ids
    assert prompts[1] == r.prompt_ids(summary + [{"role": "user", "content": "go on"}], None)
    assert prompts[2][:len(prompts[1])] == prompts[1] and c2.token_ids == prompts[2] + gen.calls[2][1].token_ids
    assert [len(c.turns) for c in (c1, c2, c3)] == [1, 2, 1]
    assert prompts[3] == r.prompt_ids(first[:1], tools) and c3.token_ids == prompts[3] + gen.calls[3][1].token_ids


def test_notes_agent_runs_each_turn_after_a_tool_call_in_a_fresh_context(model_dir):
    """The example agent with memory="notes": the question and what the tools returned, instead of
    the history; its first context is the built-in env's first prompt and reply, token for token."""
    tok = Tokenizer(model_dir)
    tasks = phonebook().sample_tasks(4, seed=6)
    gen = ScriptedGenerator(tok, expert_policy(phonebook, tasks))

    async def go(make):
        return [await run_episode(gen, make(), t, P, trajectory_id=f"{t['id']}/0", group_id=str(t["id"]))
                for t in tasks]
    native = asyncio.run(go(phonebook))
    notes = asyncio.run(go(lambda: agent_env(agent_options={"memory": "notes"})))
    for t, a, b in zip(tasks, native, notes):
        assert b.status == "done" and b.reward == a.reward == 1.0 and len(b.earlier) == 1 and b.num_turns == 2
        first = b.earlier[0]
        assert first.token_ids == a.token_ids[:a.turns[0].start + a.turns[0].num_generated]
        found = f"Found so far:\nlookup({t['name']!r}): {json.dumps(t['directory'][t['name']])}\n"
        assert found in b.messages[1]["content"] and b.messages[0] == a.messages[0]


def test_a_rewritten_history_ends_the_episode_with_on_rewrite_error_and_the_agent_hears_why(model_dir):
    tok = Tokenizer(model_dir)
    errors = []

    def agent(client, task):  # (a plain function: it hears the refusal; a coroutine is cancelled)
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        reply = client.chat.completions.create(model="p", messages=messages)
        summary = [{"role": "user", "content": "summary: " + reply.choices[0].message.content}]  # drops history
        try:
            client.chat.completions.create(model="p", messages=summary)
        except openai.BadRequestError as e:
            errors.append(e.body["message"])
        return 1.0

    traj = asyncio.run(run_episode(_scripted(tok, ["hello"]), agent_env(agent, on_rewrite="error"), {}, P))
    assert traj.status == "error" and "does not continue the conversation" in traj.error
    assert "message 0 (system) differs" in traj.error
    assert traj.reward == 0.0 and len(traj.turns) == 1
    for _ in range(200):
        if errors:
            break
        time.sleep(0.01)
    assert errors and "this episode has ended: the agent's request does not continue" in errors[0]


@pytest.mark.parametrize("case", ["raises", "not a number", "never asks"])
def test_an_agent_that_fails_ends_its_episode_not_the_run(model_dir, case):
    tok = Tokenizer(model_dir)

    async def agent(client, task):
        if case != "never asks":
            await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}])
        if case == "raises":
            raise KeyError("tool broke")
        return "yes" if case == "not a number" else 1.0

    traj = asyncio.run(run_episode(_scripted(tok, ["a"]), agent_env(agent), {}, P))
    assert traj.status == "error"
    want = {"raises": "KeyError: 'tool broke'", "not a number": "reward as a number, got str",
            "never asks": "ended without asking the model"}[case]
    assert want in traj.error
    ok = asyncio.run(run_episode(_scripted(tok, ["a"]), agent_env(), phonebook().sample_tasks(1, 0)[0], P))
    assert ok.status == "done"  # the gateway goes on serving


def test_turn_limit_and_deadline_end_the_agent_and_its_key(model_dir):
    tok = Tokenizer(model_dir)
    state = {}

    async def chatty(client, task):
        state["key"] = client.api_key
        messages = [{"role": "user", "content": "go"}]
        try:
            while True:
                reply = await client.chat.completions.create(model="p", messages=messages)
                messages += [reply.choices[0].message, {"role": "user", "content": "more"}]
        except asyncio.CancelledError:
            state["cancelled"] = True
            raise

    async def then_knock():
        traj = await run_episode(_scripted(tok, ["m"]), agent_env(chatty, max_turns=3), {}, P)
        async with httpx.AsyncClient() as h:  # the episode's key, once it has ended
            r = await h.post((await Gateway.running()).url + "/chat/completions", json={"messages": [
                {"role": "user", "content": "x"}]}, headers={"Authorization": f"Bearer {state['key']}"})
        return traj, r
    traj, r = asyncio.run(then_knock())
    assert traj.status == "max_turns" and len(traj.turns) == 3 and state["cancelled"]
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"

    async def slow_tool(client, task):
        await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "go"}])
        await asyncio.sleep(60)

    traj = asyncio.run(run_episode(_scripted(tok, ["m"]), agent_env(slow_tool), {}, P, deadline_s=0.5))
    assert traj.status == "timeout" and traj.total_s < 5


def test_the_endpoint_rejects_bad_requests_with_json_errors_and_streams(model_dir):
    tok = Tokenizer(model_dir)
    got = {}

    async def agent(client, task):
        url, auth = str(client.base_url).rstrip("/"), {"Authorization": f"Bearer {client.api_key}"}
        async with httpx.AsyncClient() as h:
            # (a malformed message is refused here, before the episode sees it: the agent may send another)
            for name, body in [("n", {"messages": [{"role": "user", "content": "x"}], "n": 2}),
                               ("role", {"messages": [{"role": "robot", "content": "x"}]}),
                               ("empty", {"messages": []}), ("json", b"{not json"),
                               ("content", {"messages": [{"role": "user", "content": 5}]}),
                               ("call", {"messages": [{"role": "user", "content": "x"},
                                                      {"role": "assistant", "tool_calls": [{"function": True}]}]}),
                               ("nan", b'{"model": NaN, "messages": [{"role": "user", "content": "x"}]}')]:
                r = await (h.post(url + "/chat/completions", headers=auth, content=body) if isinstance(body, bytes)
                           else h.post(url + "/chat/completions", headers=auth, json=body))
                got[name] = (r.status_code, r.json()["error"]["message"])
            got["models"] = (await h.get(url + "/models")).json()["data"][0]["id"]
        tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]
        stream = await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}],
                                                      tools=tools, stream=True, stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        got["calls"] = [(d.function.name, d.function.arguments) for c in chunks if c.choices
                        for d in c.choices[0].delta.tool_calls or []]
        got["finish"] = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        got["usage"] = chunks[-1].usage.completion_tokens
        return 0.5

    call = '<tool_call>{"name": "lookup", "arguments": {"name": "Ana Berg"}}</tool_call>'
    traj = asyncio.run(run_episode(_scripted(tok, [call]), agent_env(agent), {}, P))
    assert traj.status == "done" and traj.reward == 0.5
    assert got["n"][0] == got["role"][0] == got["empty"][0] == got["json"][0] == 400
    assert "n must be 1" in got["n"][1] and "unknown message roles ['robot']" in got["role"][1]
    assert "non-empty list" in got["empty"][1] and "not JSON" in got["json"][1]
    assert got["content"] == (400, "message 0: content must be a string or a list of text parts")
    assert got["call"][0] == 400 and got["call"][1].startswith("message 1: tool_calls must be")
    assert got["nan"][0] == 400 and "NaN is not a JSON value" in got["nan"][1]
    assert got["models"] == "policy"
    assert got["calls"] == [("lookup", json.dumps({"name": "Ana Berg"}))] and got["finish"] == ["tool_calls"]
    assert got["usage"] == len(tok.encode(call, add_special_tokens=False)) + 1


def test_responses_api_continues_a_response_by_id_streams_and_rejects_what_it_cannot_serve(model_dir):
    """previous_response_id: only the new items are sent, and the tokens are those of sending the
    whole history; a streamed response carries the same output; unsupported input gets a 400."""
    tok = Tokenizer(model_dir)
    call = '<tool_call>{"name": "lookup", "arguments": {"name": "Ana Berg"}}</tool_call>'
    tools = [{"type": "function", "name": "lookup", "description": "Find someone.",
              "parameters": {"type": "object", "properties": {"name": {"type": "string"}}}}]
    got = {}

    async def by_id(client, task):
        r1 = await client.responses.create(model="p", instructions="be brief", input="who is Ana?", tools=tools)
        fc = r1.output[0]
        got["first"] = (fc.type, fc.name, json.loads(fc.arguments), r1.status, r1.usage.output_tokens)
        out = {"type": "function_call_output", "call_id": fc.call_id, "output": '{"room": 7}'}
        stream = await client.responses.create(model="p", instructions="be brief", previous_response_id=r1.id,
                                               input=[out], tools=tools, stream=True)
        events = [e async for e in stream]
        done = events[-1].response
        got["stream"] = ([e.type for e in events][:2], done.status, done.output_text,
                         "".join(e.delta for e in events if e.type == "response.output_text.delta"))
        r3 = await client.responses.create(model="p", instructions="be brief", tools=tools, previous_response_id=done.id,
                                           input=[{"role": "user", "content": [{"type": "input_text", "text": "and?"}]}],
                                           max_output_tokens=2)
        got["cut"] = (r3.status, r3.incomplete_details.reason, r3.usage.output_tokens)
        return 1.0

    async def whole(client, task):  # the same conversation, sent whole each time
        items = [{"role": "user", "content": "who is Ana?"}]
        r1 = await client.responses.create(model="p", instructions="be brief", input=items, tools=tools)
        items += r1.output + [{"type": "function_call_output", "call_id": r1.output[0].call_id, "output": '{"room": 7}'}]
        r2 = await client.responses.create(model="p", instructions="be brief", input=items, tools=tools)
        items += r2.output + [{"role": "user", "content": "and?"}]
        await client.responses.create(model="p", instructions="be brief", input=items, tools=tools, max_output_tokens=2)
        return 1.0

    replies = [call, "Room 7.", "one two three four"]
    a = asyncio.run(run_episode(_scripted(tok, replies), agent_env(by_id), {}, P))
    b = asyncio.run(run_episode(_scripted(tok, replies), agent_env(whole), {}, P))
    assert a.status == b.status == "done" and a.num_turns == b.num_turns == 3 and not a.earlier and not b.earlier
    assert a.token_ids == b.token_ids and a.loss_mask == b.loss_mask
    assert a.messages[0] == {"role": "system", "content": "be brief"}
    assert got["first"] == ("function_call", "lookup", {"name": "Ana Berg"}, "completed",
                            len(tok.encode(call, add_special_tokens=False)) + 1)
    assert got["stream"] == (["response.created", "response.in_progress"], "completed", "Room 7.", "Room 7.")
    assert got["cut"] == ("incomplete", "max_output_tokens", 2)

    bad = {}

    async def wrong(client, task):
        url, auth = str(client.base_url).rstrip("/") + "/responses", {"Authorization": f"Bearer {client.api_key}"}
        async with httpx.AsyncClient() as h:
            for name, body in [("tool", {"input": "x", "tools": [{"type": "web_search"}]}),
                               ("item", {"input": [{"type": "web_search_call", "id": "ws_1"}]}),
                               ("previous", {"input": "x", "previous_response_id": "resp_nope"}),
                               ("image", {"input": [{"role": "user", "content": [{"type": "input_image"}]}]})]:
                r = await h.post(url, headers=auth, json=body)
                bad[name] = (r.status_code, r.json()["error"]["message"])
        r = await client.responses.create(model="p", input="x")  # the gateway goes on serving
        return float(r.output_text == "ok")

    t = asyncio.run(run_episode(_scripted(tok, ["ok"]), agent_env(wrong), {}, P))
    assert t.status == "done" and t.reward == 1.0
    assert {v[0] for v in bad.values()} == {400} and "only function tools" in bad["tool"][1]
    assert "'web_search_call' is not supported" in bad["item"][1] and "not a response of this episode" in bad["previous"][1]
    assert "text parts" in bad["image"][1]


def test_an_openai_agents_sdk_agent_trains_through_the_gateway_on_either_api(model_dir):
    """The OpenAI Agents SDK (Agent, function_tool, Runner) as a user writes it, on its Responses
    model and on its chat-completions model: one context per episode (the SDK sends the history as
    the model saw it), the same token ids both ways, the tool run by the SDK."""
    import agents
    agents.set_tracing_disabled(True)  # (traces would go to OpenAI's servers)
    tok = Tokenizer(model_dir)
    tasks = phonebook().sample_tasks(2, seed=8)
    looked_up = []

    def make(model_class):
        async def run(client, task):
            @agents.function_tool
            def lookup(name: str) -> str:
                """Find a staff member by full name; returns their details as JSON."""
                looked_up.append(name)
                entry = task["directory"].get(name)
                return json.dumps(entry) if entry else "no such person"
            agent = agents.Agent(name="phonebook", instructions="Use the lookup tool.", tools=[lookup],
                                 model=model_class(model="policy", openai_client=client))
            result = await agents.Runner.run(agent, f"What is the {task['field']} of {task['name']}?", max_turns=4)
            return float(str(task["answer"]) in str(result.final_output))
        return run

    gen = ScriptedGenerator(tok, expert_policy(phonebook, tasks))

    async def go(model_class):
        return [await run_episode(gen, agent_env(make(model_class)), t, P, trajectory_id=f"{t['id']}/0",
                                  group_id=str(t["id"])) for t in tasks]
    via_responses, via_chat = asyncio.run(go(agents.OpenAIResponsesModel)), asyncio.run(go(agents.OpenAIChatCompletionsModel))
    for t, a, b in zip(tasks, via_responses, via_chat):
        assert a.status == b.status == "done" and a.reward == b.reward == 1.0, (a.error, b.error)
        assert a.num_turns == b.num_turns == 2 and not a.earlier and not b.earlier
        assert a.token_ids == b.token_ids and a.loss_mask == b.loss_mask
        assert a.messages[0] == {"role": "system", "content": "Use the lookup tool."}
        assert a.messages[3]["role"] == "tool" and str(t["answer"]) in a.messages[3]["content"]
    assert looked_up == [t["name"] for t in tasks] * 2


def test_an_agents_sdk_sub_agent_runs_in_a_context_of_its_own(model_dir):
    """Agents as tools (a sub-agent with a conversation of its own): the sub-agent's turn reads a
    context of its own; back in the main conversation, whose earlier tokens render again exactly
    as generated, the main context goes on (one sequence per conversation, not one per switch)."""
    import agents
    agents.set_tracing_disabled(True)
    tok = Tokenizer(model_dir)
    call = '<tool_call>\n{"name": "ask_directory", "arguments": {"input": "the room of Ana Berg"}}\n</tool_call>'

    async def run(client, task):
        model = agents.OpenAIResponsesModel(model="policy", openai_client=client)
        sub = agents.Agent(name="directory", instructions="You know the staff directory.", model=model)
        main = agents.Agent(name="main", instructions="Answer with the directory's help.", model=model,
                            tools=[sub.as_tool(tool_name="ask_directory", tool_description="Ask the directory.")])
        result = await agents.Runner.run(main, "Which room is Ana Berg in?", max_turns=4)
        return float("7" in str(result.final_output))

    gen = RecordingGenerator(_scripted(tok, [call, "Room 7.", "Ana Berg is in room 7."]))
    traj = asyncio.run(run_episode(gen, agent_env(run), {}, P))
    assert traj.status == "done" and traj.reward == 1.0 and traj.num_turns == 3, traj.error
    sub, main = traj.sequences()
    assert [len(sub.turns), len(main.turns)] == [1, 2]
    prompts = [req.prompt_token_ids for req, _ in gen.calls]
    assert prompts == [main.token_ids[:main.turns[0].start], sub.token_ids[:sub.turns[0].start],
                       main.token_ids[:main.turns[1].start]]
    assert prompts[2][:len(prompts[0])] == prompts[0]  # the main conversation, taken up again
    assert main.turns[0].num_observation == main.turns[1].start - main.turns[0].start - main.turns[0].num_generated > 0
    assert main.loss_mask.count(1) == main.turns[0].num_generated + main.turns[1].num_generated
    assert sub.messages[0]["content"] == "You know the staff directory." and "the room of Ana Berg" in sub.messages[1]["content"]
    assert main.messages[-2]["role"] == "tool" and main.messages[-2]["content"] == "Room 7."


def test_an_agent_program_runs_per_episode_with_the_gateway_in_its_environment(model_dir):
    """examples/phonebook_agent_cli.py, a program that knows nothing of rollwise (OPENAI_BASE_URL and
    OPENAI_API_KEY, the task on stdin, the reward on stdout): the same token ids as the in-process agent."""
    tok = Tokenizer(model_dir)
    tasks = phonebook().sample_tasks(3, seed=11)
    gen = ScriptedGenerator(tok, expert_policy(phonebook, tasks))
    command = [sys.executable, str(Path(AGENT.split(":")[0]).with_name("phonebook_agent_cli.py"))]

    async def go(make):
        return [g[0] async for g in collect(gen, make, tasks, P, group_size=1)]
    program = asyncio.run(go(lambda: agent_env(None, command=command)))
    inproc = asyncio.run(go(agent_env))
    key = lambda t: t.group_id  # noqa: E731
    for a, b in zip(sorted(program, key=key), sorted(inproc, key=key)):
        assert a.status == "done" and a.reward == b.reward == 1.0, a.error
        assert a.token_ids == b.token_ids and a.num_turns == b.num_turns == 2


@pytest.mark.parametrize("case", ["exits 3", "prints no number", "hangs", "leaves a child"])
def test_an_agent_program_that_fails_or_hangs_ends_its_episode_and_is_killed(model_dir, tmp_path, case):
    tok = Tokenizer(model_dir)
    pid_file = tmp_path / "pid"
    body = {"exits 3": "sys.exit(3)", "prints no number": "print('done!')",
            "hangs": "import subprocess; subprocess.Popen(['sleep', '60']); time.sleep(60)",
            "leaves a child": "import subprocess; subprocess.Popen(['sleep', '60']); print(1.0)"}[case]
    script = (f"import os, sys, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
              f"print('to stderr', file=sys.stderr)\n{body}\n")
    env = agent_env(None, command=[sys.executable, "-c", script])
    t = asyncio.run(run_episode(_scripted(tok, ["x"]), env, {}, P, deadline_s=3.0))
    want = {"exits 3": "exited with status 3: to stderr", "prints no number": "print its reward (a number)",
            "hangs": None, "leaves a child": "ended without asking the model anything (returned 1.0)"}[case]
    if want is None:
        assert t.status == "timeout"
    else:
        assert t.status == "error" and want in t.error
    pid = int(pid_file.read_text())
    for _ in range(100):  # the program's process group is gone (killed, or it had ended)
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.02)
    else:
        raise AssertionError("the agent program's processes outlived its episode")


@pytest.mark.parametrize("transport", ["asgi", "http"])
def test_collect_runs_a_group_of_agents_concurrently(model_dir, transport):
    """Coroutine agents call the gateway's app on the loop (asgi) or go through its socket (http)."""
    tok = Tokenizer(model_dir)
    tasks = phonebook().sample_tasks(3, seed=9)
    gen = ScriptedGenerator(tok, expert_policy(phonebook, tasks), delay=0.02)

    async def go():
        return [g async for g in collect(gen, lambda: agent_env(transport=transport), tasks, P, group_size=8,
                                         max_concurrency=24)]
    groups = asyncio.run(go())
    assert sorted(g[0].group_id for g in groups) == sorted(str(t["id"]) for t in tasks)
    for g in groups:
        assert [t.status for t in g] == ["done"] * 8 and all(t.reward == 1.0 for t in g)
        assert len({t.trajectory_id for t in g}) == 8 and len({tuple(t.token_ids) for t in g}) == 1
    assert gen.max_in_flight > 8  # episodes of different groups generated at once


def test_agent_env_names_its_problems():
    with pytest.raises(ValueError, match="needs agent .* or command"):
        agent_env(None)
    with pytest.raises(ValueError, match="one of them"):
        agent_env(command=["python"])
    with pytest.raises(ValueError, match="not an executable on PATH"):
        agent_env(None, command=["no-such-program-here"])
    with pytest.raises(ValueError, match="non-empty list of strings"):
        agent_env(None, command="python agent.py")
    with pytest.raises(ValueError, match="is not of the form"):
        agent_env("no_colon")
    with pytest.raises(ValueError, match="valid are 'asgi'"):
        agent_env(transport="grpc")
    with pytest.raises(ValueError, match="need an agent class"):
        agent_env(lambda client, task: 1.0, agent_options={"x": 1})
    env = agent_env(agent_options={"max_turns": 3})
    assert env.sample_tasks(2, 0) == phonebook().sample_tasks(2, 0)
    assert env.expert(env.sample_tasks(1, 0)[0]) == phonebook().expert(phonebook().sample_tasks(1, 0)[0])


def test_a_react_agents_stop_strings_and_max_tokens_reach_the_generator(model_dir):
    """A text agent (no tools) that stops the model at "Observation:" and lowers max_tokens: both
    reach the generate request (on top of the run's sampling), and the reply's content ends before
    the stop string, as OpenAI's does, while the trajectory keeps every generated token."""
    tok = Tokenizer(model_dir)
    replies = []

    async def react(client, task):
        messages = [{"role": "user", "content": "Find Ana's room."}]
        for limit in (None, 3):
            reply = await client.chat.completions.create(model="p", messages=messages, stop="Observation:",
                                                         max_tokens=limit, temperature=0.0)
            replies.append((reply.choices[0].message.content, reply.choices[0].finish_reason))
            messages += [reply.choices[0].message, {"role": "user", "content": "Observation: room 12"}]
        return 1.0

    gen = RecordingGenerator(_scripted(tok, ["Action: lookup[Ana]\nObservation: made up"]))
    traj = asyncio.run(run_episode(gen, agent_env(react), {}, SamplingParams(temperature=0.7, max_tokens=64,
                                                                             stop=["<end>"])))
    assert traj.status == "done" and len(traj.turns) == 2
    (r1, _), (r2, _) = gen.calls
    assert r1.params.stop == r2.params.stop == ["<end>", "Observation:"]
    assert (r1.params.max_tokens, r2.params.max_tokens) == (64, 3)
    assert r1.params.temperature == r2.params.temperature == 0.7  # the run's, not the request's
    assert replies[0] == ("Action: lookup[Ana]\n", "stop") and replies[1][1] == "length"
    first = traj.turns[0]
    # (the scripted generator stops after the stop string, as an engine does: its tokens stay in the trajectory)
    assert tok.decode(traj.token_ids[first.start:first.start + first.num_generated]) == "Action: lookup[Ana]\nObservation:"
    assert traj.turns[1].num_generated == 3


@pytest.mark.parametrize("api", ["chat", "chat_stream", "responses"])
def test_an_agent_that_asks_for_logprobs_gets_its_turns_tokens_and_the_trajectorys_logprobs(model_dir, api):
    """`logprobs` + `top_logprobs` (chat, whole or streamed) or `include` + `top_logprobs` (Responses)
    on a real engine: the reply's tokens spell the turn's generated tokens, their logprobs are the
    trajectory's, each position's top tokens come best first, sampled from the same distribution;
    bad values get a 400 and the episode goes on."""
    tok = Tokenizer(model_dir)
    got, errors = [], []

    def rows(entries):
        return [(x.token, x.logprob, [(t.token, t.logprob) for t in x.top_logprobs]) for x in entries]

    async def agent(client, task):
        msgs = [{"role": "user", "content": "Say something."}]
        for bad in ({"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 21}, {"logprobs": "yes"}):
            try:
                await client.chat.completions.create(model="p", messages=msgs, **bad)
            except openai.BadRequestError as e:
                errors.append(e.body["message"])
        if api == "responses":
            r = await client.responses.create(model="p", input="Say something.", top_logprobs=3,
                                              include=["message.output_text.logprobs"])
            got.extend(rows(r.output[0].content[0].logprobs))
        elif api == "chat":
            r = await client.chat.completions.create(model="p", messages=msgs, logprobs=True, top_logprobs=3)
            got.extend(rows(r.choices[0].logprobs.content))
        else:
            stream = await client.chat.completions.create(model="p", messages=msgs, logprobs=True, top_logprobs=3,
                                                          stream=True)
            async for c in stream:
                if c.choices and c.choices[0].logprobs:
                    got.extend(rows(c.choices[0].logprobs.content))
        return 1.0

    engine = AsyncEngine(model_dir, max_num_seqs=4)
    try:
        traj = asyncio.run(run_episode(engine, agent_env(agent), {}, SamplingParams(temperature=1.0, max_tokens=12,
                                                                                    seed=3)))
    finally:
        engine.shutdown()
    assert traj.status == "done" and len(traj.turns) == 1 and len(errors) == 3
    assert "needs logprobs: true" in errors[0] and "from 0 to 20" in errors[1] and "true or false" in errors[2]
    turn = traj.turns[0]
    ids = traj.token_ids[turn.start:turn.start + turn.num_generated]
    assert [t for t, _, _ in got] == [tok.decode([i], skip_special_tokens=False) for i in ids]
    assert [lp for _, lp, _ in got] == pytest.approx(traj.logprobs[turn.start:turn.start + turn.num_generated],
                                                     abs=1e-6)
    for token, lp, top in got:
        assert len(top) == 3 and [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        assert lp <= top[0][1] + 1e-6 and (token not in dict(top) or dict(top)[token] == pytest.approx(lp, abs=1e-6))


def test_the_gateway_takes_only_a_boolean_stream():
    """A chat request to an episode's endpoint asks for a stream with true, not with any value that
    reads as true (the Responses and Messages bodies share the check)."""
    from rollwise.agent.gateway import GatewayError, check_request
    msgs = [{"role": "user", "content": "hi"}]
    for ok in (True, False, None):
        check_request({"messages": msgs, "stream": ok})
    for bad in ("yes", [1], 1):
        with pytest.raises(GatewayError, match="stream must be true or false"):
            check_request({"messages": msgs, "stream": bad})
