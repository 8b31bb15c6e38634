"""The demo's phonebook task as an ordinary agent on the OpenAI API: it keeps its own message list,
calls `client.chat.completions.create` with its tools, runs the tool calls itself and returns a
reward. rollwise trains it unchanged (`env = "agent"`, examples/train-phonebook-agent.toml);
outside training the same `run` works against any OpenAI-compatible server:

    client = openai.AsyncOpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-")
    print(await PhonebookAgent().run(client, task))

Its prompts and tool schemas are the built-in `phonebook` env's, so with the same replies both
give the same token ids (tests/agent/test_agent_env.py). With `memory = "notes"` it manages its own
context, as agents with long tasks do: instead of the whole history, each request sends the question
and notes of what the tools returned so far, so every turn after a tool call starts a new context
(rollwise trains each context's tokens with the episode's advantage). With `api = "responses"` it
speaks OpenAI's Responses API (`client.responses.create`, the OpenAI Agents SDK's) instead, and with
`api = "messages"` Anthropic's Messages API (`client.messages.create` on an anthropic client: the
env's `client = "anthropic"`).
"""
from __future__ import annotations

import json
import re

from rollwise.agent.envs.phonebook import FIELDS, PhonebookEnv

SYSTEM = "You answer questions about the staff of a company. Use the lookup tool to find their details."
HINT = "When you are done, reply with the answer alone, without a tool call."
TOOLS = [
    {"type": "function", "function": {
        "name": "lookup", "description": "Find a staff member by full name; returns their details as JSON.",
        "parameters": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}},
    {"type": "function", "function": {
        "name": "finish", "description": "Give the final answer and end the episode.",
        "parameters": {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}}},
]


class PhonebookAgent:
    def __init__(self, max_turns: int = 8, memory: str = "history", api: str = "chat") -> None:
        if memory not in ("history", "notes"):
            raise ValueError(f"memory {memory!r}: valid are 'history' and 'notes'")
        if api not in ("chat", "responses", "messages"):
            raise ValueError(f"api {api!r}: valid are 'chat', 'responses' and 'messages'")
        self.max_turns, self.memory, self.api = max_turns, memory, api

    async def run(self, client, task: dict) -> float:
        if self.api != "chat":
            return await (self.run_responses if self.api == "responses" else self.run_messages)(client, task)
        question = f"What is the {FIELDS[task['field']]} of {task['name']}?"
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{question}\n{HINT}"}]
        notes: list[str] = []
        for _ in range(self.max_turns):
            if self.memory == "notes" and notes:  # a fresh context: the question and what was found
                found = "\n".join(notes)
                messages = [messages[0], {"role": "user", "content": f"{question}\nFound so far:\n{found}\n{HINT}"}]
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
            message = reply.choices[0].message
            messages.append(message)
            if not message.tool_calls:
                return score(task, message.content or "")
            for call in message.tool_calls:
                args = json.loads(call.function.arguments)
                if call.function.name == "finish":
                    return score(task, str(args.get("answer", "")))
                result = lookup(task, args)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
                notes.append(f"lookup({args.get('name', '')!r}): {result}")
        return 0.0

    async def run_responses(self, client, task: dict) -> float:
        """The same agent on the Responses API (its whole history each time)."""
        tools = [{"type": "function", **t["function"]} for t in TOOLS]
        items: list = [{"role": "user", "content": f"What is the {FIELDS[task['field']]} of {task['name']}?\n{HINT}"}]
        for _ in range(self.max_turns):
            response = await client.responses.create(model="policy", instructions=SYSTEM, input=items, tools=tools)
            items += response.output
            calls = [item for item in response.output if item.type == "function_call"]
            if not calls:
                return score(task, response.output_text)
            for call in calls:
                args = json.loads(call.arguments)
                if call.name == "finish":
                    return score(task, str(args.get("answer", "")))
                items.append({"type": "function_call_output", "call_id": call.call_id, "output": lookup(task, args)})
        return 0.0

    async def run_messages(self, client, task: dict) -> float:
        """The same agent on Anthropic's Messages API (an anthropic client; its whole history each time)."""
        tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
                  "input_schema": t["function"]["parameters"]} for t in TOOLS]
        question = f"What is the {FIELDS[task['field']]} of {task['name']}?"
        messages: list = [{"role": "user", "content": f"{question}\n{HINT}"}]
        for _ in range(self.max_turns):
            reply = await client.messages.create(model="policy", system=SYSTEM, messages=messages, tools=tools,
                                                 max_tokens=1024)
            messages.append({"role": "assistant", "content": reply.content})
            calls = [block for block in reply.content if block.type == "tool_use"]
            if not calls:
                return score(task, "".join(block.text for block in reply.content if block.type == "text"))
            results = []
            for call in calls:
                if call.name == "finish":
                    return score(task, str(call.input.get("answer", "")))
                results.append({"type": "tool_result", "tool_use_id": call.id, "content": lookup(task, call.input)})
            messages.append({"role": "user", "content": results})
        return 0.0

    # training tasks and the SFT warm start's transcripts: the built-in env's
    def sample_tasks(self, n: int, seed: int) -> list[dict]:
        return PhonebookEnv().sample_tasks(n, seed)

    def expert(self, task: dict) -> list[str]:
        return PhonebookEnv().expert(task)


def lookup(task: dict, args: dict) -> str:
    name = " ".join(str(args.get("name", "")).split())
    entry = task["directory"].get(name)
    return json.dumps(entry) if entry is not None else f"error: no staff member named {name!r}"


def score(task: dict, answer: str) -> float:
    nums = re.findall(r"-?\d+(?:\.\d+)?", answer.replace(",", ""))
    return float(bool(nums) and float(nums[-1]) == task["answer"])
