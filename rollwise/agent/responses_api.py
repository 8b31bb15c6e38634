"""OpenAI's Responses API on the agent gateway (`client.responses.create`, the API of the OpenAI
Agents SDK): a request is turned into the chat-completions body the episode loop takes, and the
chat reply into a Response, so an agent on either API runs its episodes token-in-token-out alike.

Input items map to chat messages: a `message` (or a bare `{"role", "content"}`) to itself, text
parts joined; `function_call` items to the tool calls of an assistant message (the one before
them, if they follow one); `function_call_output` to a `tool` message; a `reasoning` item sent
back is left out (chat templates drop earlier reasoning). A reply's reasoning (a reasoning parser's
`reasoning_content`) is a `reasoning` item before its message, streamed as reasoning_text events.
`instructions` become the system message in front; `previous_response_id` continues a response of
the same episode (the gateway keeps the episode's conversations until it ends) with the new items
after it. Only function tools: the model has no built-in ones. `include:
["message.output_text.logprobs"]` (and `top_logprobs`) give the output text's logprobs: the turn's
generated tokens', as chat's.
"""
from __future__ import annotations

import time
import uuid

from rollwise.agent.gateway import GatewayError, check_stream

_ROLES = ("system", "developer", "user", "assistant")
LOGPROBS = "message.output_text.logprobs"  # what `include` names to get them


def chat_body(body, conversations: dict[str, list[dict]]) -> tuple[dict, list[dict]]:
    """The chat-completions body of a Responses request, and its messages without the instructions
    (what a response to it continues). conversations: response id -> the messages it ended with."""
    if not isinstance(body, dict):
        raise GatewayError(400, "the body must be a JSON object")
    check_stream(body)
    previous = body.get("previous_response_id")
    if previous is not None and previous not in conversations:
        raise GatewayError(400, f"previous_response_id {previous!r} is not a response of this episode")
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise GatewayError(400, "input must be a string or a list of input items")
    messages = [dict(m) for m in conversations[previous]] if previous is not None else []
    for item in items:
        _add(messages, item)
    if not messages:
        raise GatewayError(400, "input must hold at least one item")
    out = {"messages": messages, "model": body.get("model")}
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise GatewayError(400, "instructions must be a string")
        out["messages"] = [{"role": "system", "content": instructions}] + messages
    if body.get("tools"):
        if not isinstance(body["tools"], list):
            raise GatewayError(400, "tools must be a list of tools")
        out["tools"] = [_tool(t) for t in body["tools"]]
    if body.get("tool_choice") is not None:
        out["tool_choice"] = body["tool_choice"] if isinstance(body["tool_choice"], str) else "auto"
    if body.get("max_output_tokens") is not None:
        out["max_completion_tokens"] = body["max_output_tokens"]
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise GatewayError(400, "include must be a list of strings")
    if LOGPROBS in include or body.get("top_logprobs") is not None:  # the output text's logprobs
        out["logprobs"] = True
        if body.get("top_logprobs") is not None:
            out["top_logprobs"] = body["top_logprobs"]
    return out, messages


def _add(messages: list[dict], item: dict) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise GatewayError(400, f"message role {role!r}: valid are {list(_ROLES)}")
        messages.append({"role": role, "content": _text(item.get("content"))})
    elif kind == "function_call":
        call = {"id": _str(item, "call_id"), "type": "function",
                "function": {"name": _str(item, "name"), "arguments": _str(item, "arguments")}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last["tool_calls"] = [*(last.get("tool_calls") or []), call]
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "reasoning":  # an earlier reply's reasoning, sent back: chat templates drop it from the history
        return
    elif kind == "function_call_output":
        output = item.get("output")
        messages.append({"role": "tool", "tool_call_id": _str(item, "call_id"),
                         "content": output if isinstance(output, str) else _text(output)})
    else:
        raise GatewayError(400, f"input item type {kind!r} is not supported: valid are 'message', "
                                "'function_call', 'function_call_output' and 'reasoning'")


def _str(item: dict, key: str) -> str:
    v = item.get(key)
    if not isinstance(v, str):
        raise GatewayError(400, f"a {item.get('type')} item needs {key} as a string")
    return v


def _text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
                                         for p in content):
        return "\n".join(str(p.get("text", "")) for p in content)  # (as text_content: vLLM's join)
    raise GatewayError(400, "message content must be a string or a list of text parts (input_text, output_text)")


def _tool(t) -> dict:
    if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
        raise GatewayError(400, "only function tools ({'type': 'function', 'name', 'parameters'}): the model "
                                "has no built-in tools")
    fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
    return {"type": "function", "function": fn}


def response(reply: dict, body: dict) -> dict:
    """A chat-completions reply as a Response: a reasoning item for a thinking model's reasoning
    (`reasoning_content`, a server's reasoning parser), a message item for its text, a
    function_call item per tool call."""
    choice = reply["choices"][0]
    msg, output = choice["message"], []
    if msg.get("reasoning_content"):
        output.append({"type": "reasoning", "id": f"rs_{uuid.uuid4().hex[:24]}", "summary": [],
                       "content": [{"type": "reasoning_text", "text": msg["reasoning_content"]}]})
    if msg.get("content"):
        part = {"type": "output_text", "text": msg["content"], "annotations": []}
        if choice.get("logprobs"):
            part["logprobs"] = _logprobs(choice["logprobs"]["content"])
        output.append({"type": "message", "id": f"msg_{uuid.uuid4().hex[:24]}", "status": "completed",
                       "role": "assistant", "content": [part]})
    for c in msg.get("tool_calls") or []:
        output.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}", "call_id": c["id"],
                       "name": c["function"]["name"], "arguments": c["function"]["arguments"],
                       "status": "completed"})
    cut = choice["finish_reason"] == "length"
    u = reply.get("usage") or {}
    usage = {"input_tokens": u.get("prompt_tokens", 0), "output_tokens": u.get("completion_tokens", 0),
             "total_tokens": u.get("total_tokens", 0),
             "input_tokens_details": {"cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)},
             "output_tokens_details": {"reasoning_tokens": 0}}
    now = time.time()
    return {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": now, "completed_at": now,
            "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "error": None,
            "model": reply["model"], "output": output, "usage": usage,
            "instructions": body.get("instructions"), "previous_response_id": body.get("previous_response_id"),
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": body.get("parallel_tool_calls", True), "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"), "metadata": body.get("metadata") or {},
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "store": body.get("store", True)}


def _logprobs(content: list[dict]) -> list[dict]:
    """Chat's `logprobs.content` in the Responses API's shape (no token ids)."""
    return [{"token": x["token"], "logprob": x["logprob"], "bytes": x["bytes"],
             "top_logprobs": [{k: y[k] for k in ("token", "logprob", "bytes")} for y in x["top_logprobs"]]}
            for x in content]


async def events(resp: dict):
    """A whole Response as the Responses API's stream events (created, each output item with its
    text or arguments, completed)."""
    n = iter(range(1 << 30))
    head = {**resp, "status": "in_progress", "output": [], "usage": None}
    yield {"type": "response.created", "sequence_number": next(n), "response": head}
    yield {"type": "response.in_progress", "sequence_number": next(n), "response": head}
    for i, item in enumerate(resp["output"]):
        at = {"output_index": i, "item_id": item["id"]}
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            yield {"type": "response.output_item.added", "sequence_number": next(n), "output_index": i,
                   "item": {**item, "content": []}}
            yield {"type": "response.reasoning_text.delta", "sequence_number": next(n), **at, "content_index": 0,
                   "delta": text}
            yield {"type": "response.reasoning_text.done", "sequence_number": next(n), **at, "content_index": 0,
                   "text": text}
        elif item["type"] == "message":
            yield {"type": "response.output_item.added", "sequence_number": next(n), "output_index": i,
                   "item": {**item, "status": "in_progress", "content": []}}
            part = item["content"][0]
            yield {"type": "response.content_part.added", "sequence_number": next(n), **at, "content_index": 0,
                   "part": {**part, "text": ""}}
            yield {"type": "response.output_text.delta", "sequence_number": next(n), **at, "content_index": 0,
                   "delta": part["text"], "logprobs": part.get("logprobs", [])}
            yield {"type": "response.output_text.done", "sequence_number": next(n), **at, "content_index": 0,
                   "text": part["text"], "logprobs": part.get("logprobs", [])}
            yield {"type": "response.content_part.done", "sequence_number": next(n), **at, "content_index": 0,
                   "part": part}
        else:
            yield {"type": "response.output_item.added", "sequence_number": next(n), "output_index": i,
                   "item": {**item, "status": "in_progress", "arguments": ""}}
            yield {"type": "response.function_call_arguments.delta", "sequence_number": next(n), **at,
                   "delta": item["arguments"]}
            yield {"type": "response.function_call_arguments.done", "sequence_number": next(n), **at,
                   "name": item["name"], "arguments": item["arguments"]}
        yield {"type": "response.output_item.done", "sequence_number": next(n), "output_index": i, "item": item}
    yield {"type": "response.completed" if resp["status"] == "completed" else "response.incomplete",
           "sequence_number": next(n), "response": resp}


async def streamed_events(chunks, body: dict, done=None):
    """The Responses API's stream events as a chat-completions stream arrives (its chunks as dicts):
    each text delta as it comes, function calls (whole in the chat stream's last delta) and the
    completed Response at the end; `done(resp, reply)` then gets the Response and the chat reply."""
    n = iter(range(1 << 30))
    text, thought, calls, finish, usage, model, logprobs = [], [], [], None, None, body.get("model"), []
    msg_id, rs_id = f"msg_{uuid.uuid4().hex[:24]}", f"rs_{uuid.uuid4().hex[:24]}"
    head = {**response({"choices": [{"message": {}, "finish_reason": None}], "model": model}, body),
            "status": "in_progress", "usage": None, "completed_at": None}
    yield {"type": "response.created", "sequence_number": next(n), "response": head}
    yield {"type": "response.in_progress", "sequence_number": next(n), "response": head}
    rs_at = {"output_index": 0, "item_id": rs_id, "content_index": 0}
    at = {"output_index": 0, "item_id": msg_id, "content_index": 0}  # (1 after a reasoning item)
    async for c in chunks:
        model, usage = c.get("model", model), c.get("usage") or usage
        for choice in c.get("choices") or []:
            delta = choice.get("delta") or {}
            lp = (choice.get("logprobs") or {}).get("content") or []
            logprobs += lp
            if delta.get("reasoning_content") and not text:  # (a thinking model's reasoning comes first)
                if not thought:
                    yield {"type": "response.output_item.added", "sequence_number": next(n), "output_index": 0,
                           "item": {"type": "reasoning", "id": rs_id, "summary": [], "content": []}}
                thought.append(delta["reasoning_content"])
                yield {"type": "response.reasoning_text.delta", "sequence_number": next(n), **rs_at,
                       "delta": delta["reasoning_content"]}
            if delta.get("content"):
                if not text:
                    if thought:  # the reasoning is over
                        at["output_index"] = 1
                        said = "".join(thought)
                        yield {"type": "response.reasoning_text.done", "sequence_number": next(n), **rs_at,
                               "text": said}
                        yield {"type": "response.output_item.done", "sequence_number": next(n), "output_index": 0,
                               "item": {"type": "reasoning", "id": rs_id, "summary": [],
                                        "content": [{"type": "reasoning_text", "text": said}]}}
                    yield {"type": "response.output_item.added", "sequence_number": next(n),
                           "output_index": at["output_index"],
                           "item": {"type": "message", "id": msg_id, "status": "in_progress", "role": "assistant",
                                    "content": []}}
                    yield {"type": "response.content_part.added", "sequence_number": next(n), **at,
                           "part": {"type": "output_text", "text": "", "annotations": []}}
                text.append(delta["content"])
                yield {"type": "response.output_text.delta", "sequence_number": next(n), **at,
                       "delta": delta["content"], "logprobs": _logprobs(lp)}
            calls += [{"id": t["id"], "type": "function", "function": t["function"]} for t in delta.get("tool_calls") or []]
            finish = choice.get("finish_reason") or finish
    reply = {"model": model, "usage": usage, "choices": [{"finish_reason": finish, "message": {
        "role": "assistant", "content": "".join(text) or None, **({"tool_calls": calls} if calls else {}),
        **({"reasoning_content": "".join(thought)} if thought else {})},
        "logprobs": {"content": logprobs} if logprobs else None}]}
    resp = {**response(reply, body), "id": head["id"], "created_at": head["created_at"]}
    for item in resp["output"]:  # (the ids the stream gave them)
        item["id"] = {"reasoning": rs_id, "message": msg_id}.get(item["type"], item["id"])
    for i, item in enumerate(resp["output"]):
        if item["type"] == "reasoning":
            if text:  # (done when the message began)
                continue
            yield {"type": "response.reasoning_text.done", "sequence_number": next(n), **rs_at,
                   "text": item["content"][0]["text"]}
        elif item["type"] == "message":
            part = item["content"][0]
            yield {"type": "response.output_text.done", "sequence_number": next(n), **at, "text": part["text"],
                   "logprobs": part.get("logprobs", [])}
            yield {"type": "response.content_part.done", "sequence_number": next(n), **at, "part": part}
        else:
            yield {"type": "response.output_item.added", "sequence_number": next(n), "output_index": i,
                   "item": {**item, "status": "in_progress", "arguments": ""}}
            ids = {"output_index": i, "item_id": item["id"]}
            yield {"type": "response.function_call_arguments.delta", "sequence_number": next(n), **ids,
                   "delta": item["arguments"]}
            yield {"type": "response.function_call_arguments.done", "sequence_number": next(n), **ids,
                   "name": item["name"], "arguments": item["arguments"]}
        yield {"type": "response.output_item.done", "sequence_number": next(n), "output_index": i, "item": item}
    if done is not None:
        done(resp, reply)
    yield {"type": "response.completed" if resp["status"] == "completed" else "response.incomplete",
           "sequence_number": next(n), "response": resp}
