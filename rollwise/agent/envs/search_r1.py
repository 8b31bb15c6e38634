"""search_r1: Search-R1's protocol (Jin et al., 2025) over a dataset of questions. The model reasons,
writes `<search> query </search>` and reads the hits inside its own message, between `<information>`
and `</information>`, as often as it likes, then answers `<answer> ... </answer>`; the reward is
exact match against the task's answers (SQuAD's normalisation). Search-R1's and verl's data files
(`nq_hotpotqa_train/train.parquet`, made by Search-R1's scripts) train as they are:

    env = "search_r1"
    train_tasks_file = "nq_hotpotqa_train/train.parquet"
    [env_options.search]
    url = "http://127.0.0.1:8000/retrieve"   # Search-R1's retrieval server, or `rollwise retrieve CORPUS`

Each turn generates until `</search>` or `</answer>` (stop strings; the turn's tokens are kept as
generated). A search's results, laid out as Search-R1 shows them, are written into the message
(`Continue`: not trained on, no chat-template turn) and the next turn goes on writing it. A turn
that ends on its length without an action gets a reminder of the two actions and goes on; one that
ends its message (end-of-turn token) without an answer scores 0. A task is a conversation (Search-R1's
`prompt`, its instructions included) or a `question` (or `prompt_key`'s text), which gets this env's
instructions (`instructions`, with `{question}`); its answers are `answer_key`'s field, Search-R1's
`reward_model.ground_truth.target` or FlashRAG's `golden_answers`. Rewards are the dataset env's
(`em` by default; `f1`, `auto`, a user's function, which gets the whole message, as verl passes it).
"""
from __future__ import annotations

import dataclasses
import re

from rollwise.agent.env import Continue
from rollwise.agent.envs.dataset import DatasetEnv
from rollwise.agent.search import make_search

ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.S)
INSTRUCTIONS = ("Answer the question below. Reason inside <think> and </think> each time you get new information. "
                "When you lack some knowledge, search for it by writing <search> query </search>; the results "
                "come back between <information> and </information>. You may search as often as you need. "
                "Once you know the answer, write it alone between <answer> and </answer>, as in "
                "<answer> Beijing </answer>.\nQuestion: {question}")
REMINDER = ("\nThat was neither a search nor an answer. To search, I write the query between <search> and "
            "</search>; to answer, I write the answer between <answer> and </answer>.\n")


class SearchR1Env(DatasetEnv):
    name = "search_r1"

    def __init__(self, *, search: dict | None = None, reward: str = "em", instructions: str = INSTRUCTIONS,
                 **kw) -> None:
        if search is None:
            raise ValueError("search_r1 needs search = { corpus = ... } (a JSON-lines file) or { url = ... } "
                             "(a retrieval server)")
        if "tools" in kw:
            raise ValueError("search_r1 has one tool, its search (search = { corpus = ... } or { url = ... }); "
                             "for chat-template tool calls use env = 'dataset' with tools = ['search']")
        super().__init__(reward=reward, **kw)
        if "{question}" not in instructions:
            raise ValueError("search_r1's instructions must have a {question} field")
        self.instructions = instructions
        self.search_tool = make_search(search)
        if self.search_tool.timeout is not None:  # (None: a retrieval server's client keeps its own deadline)
            self.search_tool.timeout = min(self.search_tool.timeout, self.tool_timeout)
        self.search_tool.latency = self.tool_latency
        self.response = ""  # the episode's assistant message so far: its turns and the information between
        self.finish_reason: str | None = None

    async def reset(self, task: dict) -> list[dict]:
        self.task, self._ended, self.tools, self.response = task, None, [], ""
        conversation = self._conversation(task)
        if conversation is not None:  # Search-R1's prompt: its own instructions, no system message
            return list(conversation)
        question = self._lookup(task, self.prompt_key)
        question = question if question is not None else self._field(task, "question")
        return [{"role": "user", "content": self.instructions.format(question=str(question).strip())}]

    def answer_of(self, task: dict, required: bool = True, raw: bool = False):
        if self.answer_key == "answer" and "answer" not in task and "golden_answers" in task:
            return task["golden_answers"]  # FlashRAG's and Search-R1's raw question files
        return super().answer_of(task, required, raw)

    def turn_params(self, params):
        """Each turn stops at the end of a search or an answer, whichever the model writes first."""
        stops = [s for s in ("</search>", "</answer>") if s not in params.stop]
        return dataclasses.replace(params, stop=[*params.stop, *stops], include_stop_str_in_output=True)

    def observe(self, request, out) -> None:
        self.finish_reason = out.finish_reason

    async def step(self, action: str):
        self.response += action
        m = ACTION.search(action)
        if m is not None and m.group(1) == "answer":
            return [], await self.score(self.task, self.response), True, {"answer": m.group(2).strip()}
        if m is not None:
            result = await self.search_tool.call({"query": m.group(2).strip()})
            info = Continue(f"\n\n<information>{result.content.strip()}</information>\n\n")
        elif self.finish_reason == "length":  # cut off mid-thought: remind it of the two actions
            info = Continue(REMINDER)
        else:  # the message ended without an answer
            return [], 0.0, True, {"answer": None}
        self.response += info
        return info, 0.0, False, {"search": m is not None}
