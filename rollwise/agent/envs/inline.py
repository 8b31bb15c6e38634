"""inline: tools called inside the model's own message, the protocol of Search-R1 (`<search> q
</search>` -> `<information> ... </information>`), ReTool (`<code> ... </code>` -> `<interpreter> ...
</interpreter>`) and ToRL / SimpleTIR (a ```python block, then ```output -> the program's output),
rather than chat-template tool calls. Tasks, rewards and tools are the dataset env's (`python`,
`search` over a corpus, a retrieval server or each task's own documents, a user's function):

    env = "inline"
    train_tasks_file = "math.parquet"
    [env_options]
    reward = "math"
    instructions = "Solve it; run Python between <code> and </code> when it helps. {question}"
    actions = [{ tool = "python", start = "<code>", end = "</code>", result = "<interpreter>{result}</interpreter>" }]

Each turn generates until an action's `end` (or `answer_end`): stop strings, the turn's tokens kept
as generated. The text since the action's `start` goes to its tool (its one parameter; a fenced
code block is unwrapped), and the tool's result, in the action's `result` template, is written into
the message (`Continue`: not trained on, no chat-template turn); the next turn goes on writing it.
The episode ends when the model ends its message, scored on the whole message (the built-in rules
read its `\\boxed{}` or last `<answer>` block), or, with `answer_end` (Search-R1's `</answer>`), when
it writes that: then a message ended without it scores 0. A turn cut off at `max_tokens` goes on
(after `reminder`, if set). A task is a conversation (its own instructions) or a question (the
task's `prompt_key` or `question` field) put into `instructions` at `{question}`.
"""
from __future__ import annotations

import dataclasses

from rollwise.agent.env import Continue
from rollwise.agent.envs.dataset import DatasetEnv
from rollwise.agent.search import TaskDocsSearch
from rollwise.agent.tools import Tool


@dataclasses.dataclass(frozen=True, slots=True)
class Action:
    tool: Tool | TaskDocsSearch  # (a search over each task's own documents: its tool made at reset)
    start: str
    end: str
    result: str  # with {result}
    param: str  # the tool's parameter that takes the text


class InlineEnv(DatasetEnv):
    name = "inline"

    def __init__(self, *, actions: list[dict], answer_end: str | None = None, reminder: str = "",
                 instructions: str = "{question}", search: dict | None = None, **kw) -> None:
        if "tools" in kw or "mcp" in kw or "user" in kw:
            raise ValueError("an inline env's tools are its actions' (actions = [{ tool, start, end, result }]), "
                             "not tools or MCP servers; its message ends the episode (no user)")
        super().__init__(tools=[], **kw)
        if "{question}" not in instructions:
            raise ValueError(f"{self.name}'s instructions must have a {{question}} field")
        if not actions:
            raise ValueError("actions must list at least one { tool, start, end, result }")
        uses_search = any(isinstance(a, dict) and a.get("tool") == "search" for a in actions)
        if uses_search != (search is not None):
            raise ValueError("a search action needs search = { corpus = ... }, { url = ... } or { task_docs = ... } "
                             "(and search options need a search action)")
        self._search = search
        self.actions = [self._action(a) for a in actions]
        ends = [a.end for a in self.actions] + ([answer_end] if answer_end else [])
        if len(set(ends)) < len(ends):
            raise ValueError(f"the actions' ends and answer_end must differ, got {ends}")
        self.answer_end, self.reminder, self.instructions, self.stops = answer_end, reminder, instructions, ends
        self.response = ""  # the episode's assistant message so far: its turns and the results between
        self.finish_reason: str | None = None

    def _action(self, spec: dict) -> Action:
        spec = dict(spec)
        missing = [k for k in ("tool", "start", "end") if not spec.get(k)]
        if missing:
            raise ValueError(f"an action needs tool, start and end (and result, with {{result}}); {spec} lacks "
                             f"{missing}")
        result = spec.pop("result", "{result}")
        tool, start, end = self._make_tool(spec.pop("tool")), spec.pop("start"), spec.pop("end")
        if spec:
            raise ValueError(f"unknown action keys {sorted(spec)}; valid: tool, start, end, result")
        if "{result}" not in result:
            raise ValueError(f"an action's result must have a {{result}} field, got {result!r}")
        if isinstance(tool, TaskDocsSearch):
            return Action(tool, start, end, result, "query")
        params = tool.parameters.get("properties", {})
        required = tool.parameters.get("required", list(params))
        if len(required) != 1:
            raise ValueError(f"tool {tool.name!r} takes {sorted(params)}: an inline action's tool takes one text")
        return Action(self._limited(tool), start, end, result, required[0])

    def _limited(self, tool: Tool) -> Tool:
        """The tool under the env's deadline and simulated latency."""
        if tool.timeout is not None:  # (None: a tool that keeps its own deadline: the sandbox, a server's client)
            tool.timeout = min(tool.timeout, self.tool_timeout)
        tool.latency = tool.latency or self.tool_latency
        return tool

    async def reset(self, task: dict) -> list[dict]:
        self.task, self._ended, self.tools, self.response = task, None, [], ""
        self._tool = {a.end: self._limited(a.tool.tool_for(task)) if isinstance(a.tool, TaskDocsSearch) else a.tool
                      for a in self.actions}  # each action's tool for this task
        conversation = self._conversation(task)
        if conversation is not None:  # the file's prompt, its instructions included
            return list(conversation)
        question = self._lookup(task, self.prompt_key)
        question = question if question is not None else self._field(task, "question")
        return [{"role": "user", "content": self.instructions.replace("{question}", str(question).strip())}]

    def turn_params(self, params):
        """Each turn stops at the end of an action (or of the answer), whichever comes first."""
        stops = [s for s in self.stops if s not in params.stop]
        return dataclasses.replace(params, stop=[*params.stop, *stops], include_stop_str_in_output=True)

    def observe(self, request, out) -> None:
        self.finish_reason = out.finish_reason

    async def step(self, text: str):
        self.response += text
        at, end = min(((i, s) for s in self.stops if (i := text.find(s)) >= 0), default=(-1, None))
        if end is not None and end == self.answer_end:
            return [], await self.score(self.task, self.response), True, {"answered": 1}
        if end is not None:  # (info: counts, summed per episode into the step's env_ metrics)
            action = next(a for a in self.actions if a.end == end)
            begin = text.rfind(action.start, 0, at)
            if begin < 0:
                ok, result = False, f"error: {action.end} without {action.start} before it"
            else:
                got = await self._tool[end].call({action.param: unfence(text[begin + len(action.start):at])})
                ok, result = got.ok, got.content.strip()
            written = Continue(action.result.replace("{result}", result))
            info = {"calls": 1, "call_errors": int(not ok)}
        elif self.finish_reason == "length":  # cut off mid-thought: it goes on (reminded of the actions)
            written, info = Continue(self.reminder), {"cut_off": 1}
        elif self.answer_end:  # the message ended without its answer
            return [], 0.0, True, {"answered": 0}
        else:  # the message ended: its answer is in it
            return [], await self.score(self.task, self.response), True, {}
        self.response += written
        return written, 0.0, False, info


def unfence(text: str) -> str:
    """An action's text: stripped, and a fenced code block's content (```python ... ```) unwrapped."""
    text = text.strip()
    if text.startswith("```"):
        text = text.split("\n", 1)[1] if "\n" in text else ""
    if text.endswith("```"):
        text = text[:-3]
    return text.strip()
