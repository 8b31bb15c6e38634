"""OpenAI's Responses API on `rollwise serve` (a subprocess, real HTTP), through the openai SDK:
text, structured output by text.format, function calls and their outputs continued by
previous_response_id, streaming events, errors; the OpenAI Agents SDK's default model on it."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from rollwise.serve.process import ServerProcess

TOOLS = [{"type": "function", "name": "lookup", "description": "Looks a name up.", "strict": True,
          "parameters": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}},
                         "required": ["name"], "additionalProperties": False}}]


@pytest.fixture(scope="module")
def server(model_dir):
    with ServerProcess(model_dir, "--max-num-seqs", "8", "--max-model-len", "1024") as s:
        yield s


def test_text_structured_and_streamed_responses(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0)
    r = client.responses.create(model="m", input="Hello there", max_output_tokens=12, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens" and r.usage.output_tokens == 12
    again = client.responses.create(model="m", input="Hello there", max_output_tokens=12, temperature=0)
    assert again.output_text == r.output_text  # greedy: the same text
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
              "required": ["city"], "additionalProperties": False}
    s = client.responses.create(model="m", input="A city?", max_output_tokens=40, temperature=1.0,
                                text={"format": {"type": "json_schema", "name": "c", "schema": schema}})
    assert set(json.loads(s.output_text)) == {"city"}
    events = list(client.responses.create(model="m", input="Hello there", max_output_tokens=12, temperature=0,
                                          stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == r.output_text and len(deltas) > 1  # token by token, not the reply at once
    assert events[-1].response.output_text == r.output_text and events[-1].response.usage.output_tokens == 12
    assert [e.sequence_number for e in events] == list(range(len(events)))
    called = list(client.responses.create(model="m", input="Where is Ana?", tools=TOOLS, max_output_tokens=60,
                                          tool_choice="required", stream=True, temperature=0))
    [call] = [o for o in called[-1].response.output if o.type == "function_call"]
    done = [e for e in called if e.type == "response.function_call_arguments.done"]
    assert call.name == "lookup" and [d.arguments for d in done] == [call.arguments]
    follow = client.responses.create(model="m", previous_response_id=called[-1].response.id, tools=TOOLS,
                                     max_output_tokens=4, temperature=0, input=[{"type": "function_call_output",
                                                                  "call_id": call.call_id, "output": "room 7"}])
    assert follow.previous_response_id == called[-1].response.id  # a streamed response is stored too


def test_responses_give_the_output_texts_logprobs_when_included(server):
    """include + top_logprobs: each output token with its logprob and k alternatives best first
    (greedy: the token is the first), the same streamed (per delta, and whole at the end)."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0)
    ask = dict(model="m", input="Hello there", max_output_tokens=6, temperature=0, top_logprobs=2,
               include=["message.output_text.logprobs"])
    r = client.responses.create(**ask)
    lps = r.output[0].content[0].logprobs
    assert len(lps) == r.usage.output_tokens == 6 and "".join(x.token for x in lps) == r.output_text
    for x in lps:
        assert len(x.top_logprobs) == 2 and x.top_logprobs[0].logprob >= x.top_logprobs[1].logprob
        assert x.top_logprobs[0].token == x.token and x.top_logprobs[0].logprob == pytest.approx(x.logprob)
    events = list(client.responses.create(**ask, stream=True))
    streamed = [(x.token, x.logprob) for e in events if e.type == "response.output_text.delta" for x in e.logprobs]
    assert streamed == [(x.token, pytest.approx(x.logprob, abs=1e-5)) for x in lps]
    [done] = [e for e in events if e.type == "response.output_text.done"]
    assert [x.token for x in done.logprobs] == [x.token for x in events[-1].response.output[0].content[0].logprobs]
    assert [x.token for x in done.logprobs] == [x.token for x in lps]
    assert client.responses.create(model="m", input="Hello", max_output_tokens=2).output[0].content[0].logprobs in (None, [])


def test_function_calls_continue_by_previous_response_id(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0)
    first = client.responses.create(model="m", input="Where is Ana?", tools=TOOLS, max_output_tokens=60,
                                    tool_choice="required", instructions="Use the tools.")
    [call] = [o for o in first.output if o.type == "function_call"]
    assert call.name == "lookup" and set(json.loads(call.arguments)) == {"name"}
    second = client.responses.create(model="m", previous_response_id=first.id, tools=TOOLS, max_output_tokens=8,
                                     input=[{"type": "function_call_output", "call_id": call.call_id, "output": "room 7"}])
    assert second.previous_response_id == first.id and second.usage.input_tokens > first.usage.input_tokens
    r = httpx.post(f"{server.url}/v1/responses", json={"model": "m", "input": "x", "previous_response_id": "resp_nope"})
    assert r.status_code == 400 and "previous_response_id" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/responses", json={"model": "m", "input": [{"type": "web_search_call"}]})
    assert r.status_code == 400 and "error" in r.json()


def test_the_openai_agents_sdk_runs_on_rollwise_serve(server):
    """An Agents SDK agent on its default (Responses) model with a structured output type: the
    SDK's schema becomes the request's text.format, so even the random test model answers in it."""
    import agents
    import pydantic
    from agents import Agent, OpenAIResponsesModel, Runner

    class Answer(pydantic.BaseModel):
        room: int = pydantic.Field(ge=0, le=99)

    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0)
    agent = Agent(name="a", instructions="Answer.", output_type=Answer,
                  model=OpenAIResponsesModel(model="m", openai_client=client),
                  model_settings=agents.ModelSettings(max_tokens=24, temperature=1.0))
    result = Runner.run_sync(agent, "Which room is Ana in?", max_turns=2)
    assert isinstance(result.final_output, Answer) and 0 <= result.final_output.room <= 99
