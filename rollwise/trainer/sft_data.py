"""SFT transcripts from a file (`TrainConfig.sft_file`): a teacher's conversations to warm-start on,
tokenized exactly as an RL episode's tokens are (rollwise/agent/episode.py), so the warm start and
the rollouts see the same layout.

A record (JSON lines, a JSON list or Parquet, as task files: `load_tasks`) is a conversation, under
`messages` (OpenAI's chat messages: verl's multi-turn SFT files) or `turns` (the agent-trajectory
corpus's), with its tool schemas under `tools` if any; or a `prompt` (text, or messages) and its
`response` (verl's single-turn SFT files). A message's content is text, or a list of text parts
(joined). The prompt is the messages before the first assistant message, rendered by the chat
template with the generation prompt. Each assistant message is its text, tool calls written as the
model writes them (`parser`: the env's), then EOS: the tokens trained on, as a scripted expert's
turn is. The messages between two assistant messages (tool results, the user) are the rendered
delta the episode loop appends, not trained on; those after the last one are dropped. A transcript
longer than `max_tokens` is cut there.
"""
from __future__ import annotations

import json

from rollwise.agent.envs import load_tasks
from rollwise.agent.episode import ChatRenderer, text_content
from rollwise.agent.parsing import make_parser
from rollwise.agent.parsing.base import ToolCall
from rollwise.types import Trajectory


def conversation(record: dict) -> list[dict]:
    """The record's messages, a `prompt` + `response` pair as two (or more) messages."""
    for key in ("messages", "turns"):
        if isinstance(record.get(key), list):
            return record[key]
    if "prompt" in record and "response" in record:
        prompt = record["prompt"]
        head = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        return head + [{"role": "assistant", "content": record["response"]}]
    raise ValueError(f"SFT record {record.get('id')!r} has no 'messages', 'turns' or 'prompt' + 'response' "
                     f"(fields: {sorted(record)})")


def _message(m: dict, record_id) -> dict:
    """The message with its content as text (a list of text parts joined), or ValueError."""
    text = text_content(m.get("content"))
    if text is None:
        raise ValueError(f"SFT record {record_id!r}: a {m.get('role')} message's content is neither text nor a list "
                         f"of text parts: {str(m.get('content'))[:200]}")
    return {**m, "content": text}


def assistant_text(message: dict, parser) -> str:
    """An assistant message as the model writes it: its text, then its `tool_calls` (OpenAI's) in the
    parser's format."""
    text = message.get("content") or ""
    calls = message.get("tool_calls") or []
    if not calls:
        return text
    written = parser.write([ToolCall(name=c["function"]["name"], arguments=_arguments(c["function"]))
                            for c in calls])
    return f"{text}\n{written}" if text else written


def _arguments(fn: dict) -> dict:
    args = fn.get("arguments", {})
    try:
        return json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError as e:
        raise ValueError(f"tool call {fn.get('name')!r}: its arguments are not JSON ({e}): {args[:200]!r}") from e


def transcripts(path: str, tokenizer, parser: str | object = "hermes", max_tokens: int | None = None) -> list:
    """The file's conversations as trajectories (token ids, loss mask 1 on the assistant's tokens)."""
    parser = make_parser(parser) if isinstance(parser, str) else parser
    renderer, eos = ChatRenderer(tokenizer), tokenizer.eos_token_id
    out = []
    for record in load_tasks(path):
        msgs = [_message(m, record.get("id")) for m in conversation(record)]
        roles = [m.get("role") for m in msgs]
        if "assistant" not in roles:
            raise ValueError(f"SFT record {record['id']!r} has no assistant message to train on")
        first = roles.index("assistant")
        ids = renderer.prompt_ids(msgs[:first], record.get("tools"))
        mask = [0] * len(ids)
        i = first
        while i < len(msgs):
            if roles[i] == "assistant":
                gen = tokenizer.encode(assistant_text(msgs[i], parser), add_special_tokens=False) + [eos]
                ids.extend(gen)
                mask.extend([1] * len(gen))
                i += 1
                continue
            j = next((k for k in range(i, len(msgs)) if roles[k] == "assistant"), len(msgs))
            if j == len(msgs):  # (after the last assistant message: nothing to learn from)
                break
            delta = renderer.delta_ids(msgs[i:j], ended_with_eos=True)
            ids.extend(delta)
            mask.extend([0] * len(delta))
            i = j
        if max_tokens:
            ids, mask = ids[:max_tokens], mask[:max_tokens]
        if any(mask):
            out.append(Trajectory(trajectory_id=str(record["id"]), group_id=str(record["id"]), task=dict(id=record["id"]),
                                  token_ids=ids, loss_mask=mask, logprobs=[0.0] * len(ids), reward=1.0))
    if not out:
        raise ValueError(f"{path}: no transcript with an assistant token to train on")
    return out
