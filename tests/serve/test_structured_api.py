"""Structured outputs over HTTP (a `rollwise serve` subprocess): OpenAI's response_format, vLLM's
structured_outputs and guided_* fields, SGLang's json_schema / regex on /generate; bad specs 400."""
from __future__ import annotations

import json
import re

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["city", "n"], "additionalProperties": False}


def _chat(client, **extra):
    return client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a city?"}],
                                                      "max_tokens": 80, "seed": 1, **extra})


def test_chat_response_format_json_schema_and_json_object(client):
    r = _chat(client, n=3, response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}})
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop", choice
        v = json.loads(choice["message"]["content"])
        assert set(v) == {"city", "n"} and isinstance(v["n"], int) and len(v["city"]) <= 8
    r = _chat(client, response_format={"type": "json_object"}, max_tokens=200)
    c = r.json()["choices"][0]
    assert r.status_code == 200 and (c["finish_reason"] != "stop" or isinstance(json.loads(c["message"]["content"]), dict))
    assert _chat(client, response_format={"type": "text"}).status_code == 200


def test_vllm_and_sglang_fields(client):
    r = client.post("/v1/completions", json={"prompt": "code:", "max_tokens": 20, "seed": 2,
                                             "structured_outputs": {"regex": r"[a-z]{3}-\d{2}"}})
    assert r.status_code == 200 and re.fullmatch(r"[a-z]{3}-\d{2}", r.json()["choices"][0]["text"]), r.text
    r = _chat(client, guided_choice=["north", "south"], stream=True)
    text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                   for line in r.text.splitlines() if line.startswith("data: {") and '"choices": [{' in line)
    assert r.status_code == 200 and text in ("north", "south"), r.text[-300:]
    r = client.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 60, "temperature": 1.0,
                                                                        "json_schema": json.dumps(SCHEMA)}})
    assert r.status_code == 200, r.text
    assert set(json.loads(r.json()["text"])) == {"city", "n"}


def test_bad_structured_requests_are_400s_and_the_server_keeps_serving(client):
    for extra, why in [({"response_format": {"type": "xml"}}, "json_object"),
                       ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema"),
                       ({"structured_outputs": {"regex": "(("}}, "unclosed"),
                       ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "one way")]:
        r = _chat(client, **extra)
        assert r.status_code == 400 and why in r.json()["error"]["message"], (extra, r.text)
    r = client.post("/generate", json={"text": "x", "sampling_params": {"ebnf": "root ::= \"a\""}})
    assert r.status_code == 400 and "Lark" in r.text
    assert _chat(client).status_code == 200


TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
            "type": "object", "properties": {"name": {"type": "string", "maxLength": 10}}, "required": ["name"],
            "additionalProperties": False}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                              "b": {"type": "integer", "minimum": 0, "maximum": 99}},
             "required": ["a", "b"], "additionalProperties": False}}}]


def test_tool_choice_required_or_named_gives_tool_calls_of_the_offered_functions(client):
    r = _chat(client, n=4, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=60)
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        assert c["finish_reason"] == "tool_calls", c
        [call] = c["message"]["tool_calls"]
        assert call["function"]["name"] == "add" and set(json.loads(call["function"]["arguments"])) == {"a", "b"}
    r = _chat(client, n=4, tools=TOOLS, tool_choice="required", max_tokens=120)
    for c in r.json()["choices"]:
        if c["finish_reason"] == "length":  # (a random model may go on calling)
            continue
        calls = c["message"]["tool_calls"]
        assert calls and all(x["function"]["name"] in ("lookup", "add") for x in calls)
    for extra, why in [({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among"),
                       ({"tool_choice": "required"}, "no tools are offered"),
                       ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "already structures")]:
        r = _chat(client, **extra)
        assert r.status_code == 400 and why in r.json()["error"]["message"], (extra, r.text)
