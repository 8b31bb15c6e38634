"""Anthropic's Messages API (`POST /v1/messages`, what the anthropic SDKs and agents built on them
call) as a chat-completions request, on `rollwise serve`, `rollwise route` and the agent gateway,
as the Responses API is (rollwise.agent.responses_api).

A request maps to chat messages: `system` (a string or text blocks) to the system message; a
user message's `text` blocks to its text and each `tool_result` block to a `tool` message (in the
order given, so results come before the user's words, as the API requires them first); an
assistant message's `text` to its content and each `tool_use` to a tool call (its `input` as JSON
arguments); `thinking` blocks sent back are left out (chat templates drop earlier reasoning).
`tools` are custom tools (`input_schema`); `tool_choice` `auto`, `any` (a call is required), `tool`
(that one) and `none`, `disable_parallel_tool_use` keeping a reply's first call; `stop_sequences`,
`max_tokens` (required), `temperature`, `top_p`, `top_k`. A last assistant message is a prefill:
the reply goes on writing it (`continue_final_message`).
The reply is a Message: a `thinking` block for a thinking model's reasoning (a reasoning parser's),
a `text` block, a `tool_use` block per call; `stop_reason` `end_turn`, `max_tokens`,
`stop_sequence` (with `stop_sequence`) or `tool_use`. `output_config.format` (a JSON schema) holds
the text to the schema, as structured outputs; `thinking` `{"type": "enabled", "budget_tokens": n}`
closes the reply's think block after n tokens (vLLM's thinking_token_budget, as vLLM maps it); the
API's other settings (metadata, service tier, cache control) change nothing here and are taken.
Streamed as the API's named events (message_start, content_block_start / _delta / _stop,
message_delta, message_stop). Errors have the API's body, `{"type": "error", "error": {"type",
"message"}}`. Images, documents and the API's server tools are refused (400): the model reads text
and calls the tools it is given.
"""
from __future__ import annotations

import json
import uuid

from rollwise.agent.episode import text_content
from rollwise.agent.gateway import GatewayError, check_stream

FIELDS = ("model", "max_tokens", "messages", "system", "tools", "tool_choice", "stop_sequences", "temperature",
          "top_p", "top_k", "stream", "output_config", "thinking")
IGNORED = ("metadata", "service_tier", "cache_control", "container", "diagnostics", "inference_geo",
           "speed", "user_profile_id", "workspace_id")  # the API's fields that change nothing here: taken, unused
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


def chat_body(body) -> dict:
    """The chat-completions body of a Messages request (without `stream`: the caller's business)."""
    if not isinstance(body, dict):
        raise GatewayError(400, "the body must be a JSON object")
    unknown = sorted(set(body) - set(FIELDS) - set(IGNORED))
    if unknown:
        raise GatewayError(400, f"unknown fields {unknown}; valid: {sorted(FIELDS + IGNORED)}")
    check_stream(body)
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise GatewayError(400, "max_tokens is required: a positive integer")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
        raise GatewayError(400, "messages must be a non-empty list of message objects")
    messages = [{"role": "system", "content": _text(body["system"], "system")}] if body.get("system") else []
    for m in msgs:
        _add(messages, m)
    out = {"model": body.get("model"), "messages": messages, "max_tokens": max_tokens}
    if msgs[-1].get("role") == "assistant":  # a prefill: the reply goes on writing it
        if not isinstance(messages[-1].get("content"), str) or messages[-1].get("tool_calls"):
            raise GatewayError(400, "a last assistant message (a prefill) must be text")
        out.update(continue_final_message=True, add_generation_prompt=False)
    for k in ("temperature", "top_p", "top_k"):
        if body.get(k) is not None:
            out[k] = body[k]
    thinking = body.get("thinking")  # {"type": "enabled", "budget_tokens": n}: vLLM's thinking_token_budget
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        budget = thinking.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise GatewayError(400, "thinking.budget_tokens must be a non-negative integer")
        out["thinking_token_budget"] = budget
    stops = body.get("stop_sequences")
    if stops:
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise GatewayError(400, "stop_sequences must be a list of non-empty strings")
        out["stop"] = stops
    if body.get("tools"):
        if not isinstance(body["tools"], list):
            raise GatewayError(400, "tools must be a list of tools")
        out["tools"] = [_tool(t) for t in body["tools"]]
    choice = body.get("tool_choice")
    if choice is not None:
        out["tool_choice"] = _tool_choice(choice)
        if choice.get("disable_parallel_tool_use"):  # (chat's parallel_tool_calls: false)
            out["parallel_tool_calls"] = False
    fmt = (body.get("output_config") or {}).get("format") if isinstance(body.get("output_config"), dict) else None
    if fmt is not None:  # structured output: {"type": "json_schema", "schema": ...}
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise GatewayError(400, "output_config.format must be {'type': 'json_schema', 'schema': {...}}")
        out["response_format"] = {"type": "json_schema", "json_schema": {"schema": fmt["schema"]}}
    return out


def _add(messages: list[dict], m: dict) -> None:
    role, content = m.get("role"), m.get("content")
    if role not in ("user", "assistant"):
        raise GatewayError(400, f"message role {role!r}: valid are 'user' and 'assistant' (the system "
                                "prompt is the top-level system field)")
    if isinstance(content, str):
        messages.append({"role": role, "content": content})
        return
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise GatewayError(400, "message content must be a string or a list of content blocks")
    text, calls = [], []
    for b in content:
        kind = b.get("type")
        if kind == "text":
            text.append(_str(b, "text"))
        elif kind == "tool_result" and role == "user":
            result = b.get("content", "")
            result = result if isinstance(result, str) else _text(result, "tool_result content")
            messages.append({"role": "tool", "tool_call_id": _str(b, "tool_use_id"),
                             "content": f"Error: {result}" if b.get("is_error") else result})
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(b.get("input", {}), dict):
                raise GatewayError(400, "a tool_use block's input must be an object")
            calls.append({"id": _str(b, "id"), "type": "function",
                          "function": {"name": _str(b, "name"), "arguments": json.dumps(b.get("input", {}))}})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # an earlier reply's reasoning, sent back: chat templates drop it from the history
        else:
            valid = "text, tool_result" if role == "user" else "text, tool_use, thinking"
            raise GatewayError(400, f"{role} content block type {kind!r} is not supported: valid are {valid}")
    if role == "assistant":
        messages.append({"role": "assistant", "content": "".join(text) or None,
                         **({"tool_calls": calls} if calls else {})})
    elif text:
        messages.append({"role": "user", "content": "".join(text)})


def _str(block: dict, key: str) -> str:
    v = block.get(key)
    if not isinstance(v, str):
        raise GatewayError(400, f"a {block.get('type')} block needs {key} as a string")
    return v


def _text(content, what: str) -> str:
    text = None if content is None else text_content(content)
    if text is None:
        raise GatewayError(400, f"{what} must be a string or a list of text blocks")
    return text


def _tool(t) -> dict:
    if not isinstance(t, dict) or t.get("type", "custom") != "custom" or not isinstance(t.get("name"), str):
        raise GatewayError(400, "only custom tools ({'name', 'description', 'input_schema'}): the model has "
                                "no server tools")
    fn = {"name": t["name"], **({} if t.get("description") is None else {"description": t["description"]}),
          "parameters": t.get("input_schema") or {"type": "object"}}  # (OpenAI's order: the template renders it)
    return {"type": "function", "function": fn}


def _tool_choice(choice):
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise GatewayError(400, "tool_choice of type 'tool' needs the tool's name")
        return {"type": "function", "function": {"name": choice["name"]}}
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    raise GatewayError(400, "tool_choice type must be 'auto', 'any', 'tool' or 'none'")


def message(reply: dict, body: dict) -> dict:
    """A chat-completions reply as a Message."""
    choice = reply["choices"][0]
    msg, content = choice["message"], []
    if msg.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""})
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for c in msg.get("tool_calls") or []:
        content.append({"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                        "input": _input(c["function"]["arguments"])})
    stop = choice.get("stop_reason")
    hit = isinstance(stop, str) and stop in (body.get("stop_sequences") or [])
    u = reply.get("usage") or {}
    return {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
            "model": reply.get("model") or body.get("model"), "content": content,
            "stop_reason": "stop_sequence" if hit else STOP_REASONS.get(choice["finish_reason"], "end_turn"),
            "stop_sequence": stop if hit else None,
            "usage": {"input_tokens": u.get("prompt_tokens", 0), "output_tokens": u.get("completion_tokens", 0),
                      "cache_read_input_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                      "cache_creation_input_tokens": 0}}


def _input(arguments: str) -> dict:
    try:
        got = json.loads(arguments)
    except ValueError:
        got = None
    return got if isinstance(got, dict) else {}


def events(msg: dict):
    """A whole Message as the API's stream events: (event name, data)."""
    yield "message_start", {"type": "message_start", "message": {
        **msg, "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {**msg["usage"], "output_tokens": 0}}}
    for i, block in enumerate(msg["content"]):
        yield from _block(i, block)
    yield "message_delta", {"type": "message_delta", "delta": {"stop_reason": msg["stop_reason"],
                                                               "stop_sequence": msg["stop_sequence"]},
                            "usage": {"output_tokens": msg["usage"]["output_tokens"]}}
    yield "message_stop", {"type": "message_stop"}


def _block(i: int, block: dict):
    """One content block's events, its text (or input) in one delta."""
    kind = block["type"]
    empty = {"text": {"type": "text", "text": ""}, "thinking": {"type": "thinking", "thinking": "", "signature": ""},
             "tool_use": {**block, "input": {}}}[kind]
    yield "content_block_start", {"type": "content_block_start", "index": i, "content_block": empty}
    if kind == "text":
        yield _delta(i, {"type": "text_delta", "text": block["text"]})
    elif kind == "thinking":
        yield _delta(i, {"type": "thinking_delta", "thinking": block["thinking"]})
        yield _delta(i, {"type": "signature_delta", "signature": ""})
    else:
        yield _delta(i, {"type": "input_json_delta", "partial_json": json.dumps(block["input"])})
    yield "content_block_stop", {"type": "content_block_stop", "index": i}


def _delta(i: int, delta: dict) -> tuple[str, dict]:
    return "content_block_delta", {"type": "content_block_delta", "index": i, "delta": delta}


async def streamed_events(chunks, body: dict, prompt_tokens: int = 0):
    """The API's stream events as a chat-completions stream arrives (its chunks as dicts): thinking
    and text deltas as they come, tool calls (whole in the chat stream's last delta) at the end."""
    head = message({"choices": [{"message": {}, "finish_reason": None}], "model": body.get("model"),
                    "usage": {"prompt_tokens": prompt_tokens}}, body)
    yield "message_start", {"type": "message_start", "message": {**head, "stop_reason": None}}
    index, open_kind, finish, stop, usage = -1, None, None, None, {}
    async for c in chunks:
        usage = c.get("usage") or usage
        for choice in c.get("choices") or []:
            delta = choice.get("delta") or {}
            for kind, piece in (("thinking", delta.get("reasoning_content")), ("text", delta.get("content"))):
                if not piece:
                    continue
                if open_kind != kind:  # a new block: close the one before
                    if open_kind is not None:
                        for e in _close(index, open_kind):
                            yield e
                    index, open_kind = index + 1, kind
                    yield "content_block_start", {"type": "content_block_start", "index": index, "content_block":
                                                  {"type": "text", "text": ""} if kind == "text" else
                                                  {"type": "thinking", "thinking": "", "signature": ""}}
                yield _delta(index, {"type": "text_delta", "text": piece} if kind == "text" else
                             {"type": "thinking_delta", "thinking": piece})
            for call in delta.get("tool_calls") or []:
                if open_kind is not None:
                    for e in _close(index, open_kind):
                        yield e
                    open_kind = None
                index += 1
                block = {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                         "input": _input(call["function"]["arguments"])}
                for e in _block(index, block):
                    yield e
            finish = choice.get("finish_reason") or finish
            stop = choice.get("stop_reason", stop)
    if open_kind is not None:
        for e in _close(index, open_kind):
            yield e
    hit = isinstance(stop, str) and stop in (body.get("stop_sequences") or [])
    yield "message_delta", {"type": "message_delta", "delta": {
        "stop_reason": "stop_sequence" if hit else STOP_REASONS.get(finish, "end_turn"),
        "stop_sequence": stop if hit else None}, "usage": {"input_tokens": usage.get("prompt_tokens", prompt_tokens),
                                                          "output_tokens": usage.get("completion_tokens", 0)}}
    yield "message_stop", {"type": "message_stop"}


def _close(index: int, kind: str):
    if kind == "thinking":
        yield _delta(index, {"type": "signature_delta", "signature": ""})
    yield "content_block_stop", {"type": "content_block_stop", "index": index}


def error_body(status: int, message: str) -> dict:
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            503: "overloaded_error"}.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def named_sse(events):
    """The events, (name, data) pairs from a generator or an async one, as the API's server-sent
    events (`event: NAME` before each data line); a failure mid-stream is an `error` event."""
    from starlette.responses import StreamingResponse

    async def body():
        try:
            if hasattr(events, "__aiter__"):
                async for name, data in events:
                    yield f"event: {name}\ndata: {json.dumps(data)}\n\n"
            else:
                for name, data in events:
                    yield f"event: {name}\ndata: {json.dumps(data)}\n\n"
        except (ValueError, RuntimeError) as e:
            status = 400 if isinstance(e, ValueError) else 503
            yield f"event: error\ndata: {json.dumps(error_body(status, str(e)))}\n\n"
    return StreamingResponse(body(), media_type="text/event-stream")


def models_page(openai_list: dict) -> dict:
    """An OpenAI model list (`/v1/models`) in the Messages API's shape, for a client that sent its
    `anthropic-version` header (the anthropic SDK's `models.list()`)."""
    data = [{"type": "model", "id": m["id"], "display_name": m["id"], "created_at": "1970-01-01T00:00:00Z"}
            for m in openai_list.get("data", [])]
    return {"data": data, "has_more": False, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}
