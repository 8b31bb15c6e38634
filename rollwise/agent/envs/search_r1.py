"""search_r1: Search-R1's protocol (Jin et al., 2025) over a dataset of questions, the `inline` env
set up as Search-R1 runs it. The model reasons, writes `<search> query </search>` and reads the hits
inside its own message, between `<information>` and `</information>` (Search-R1's layout, "Doc
1(Title: ...) ..."), as often as it likes, then answers `<answer> ... </answer>`; the reward is exact
match against the task's answers (SQuAD's normalisation). Search-R1's and verl's data files
(`nq_hotpotqa_train/train.parquet`, made by Search-R1's scripts) train as they are:

    env = "search_r1"
    train_tasks_file = "nq_hotpotqa_train/train.parquet"
    [env_options.search]
    url = "http://127.0.0.1:8000/retrieve"   # Search-R1's retrieval server, or `rollwise retrieve CORPUS`

As in Search-R1, a turn cut off at `max_tokens` without an action gets a reminder of the two
actions, and a message ended without an answer scores 0. A task is a conversation (Search-R1's
`prompt`, its instructions included) or a `question` (or `prompt_key`'s text), which gets this env's
instructions (`instructions`, with `{question}`); its answers are `answer_key`'s field, Search-R1's
`reward_model.ground_truth.target` or FlashRAG's `golden_answers`. Rewards are the dataset env's
(`em` by default; `f1`, `auto`, a user's function, which gets the whole message, as verl passes it).
"""
from __future__ import annotations

from rollwise.agent.envs.inline import InlineEnv

INSTRUCTIONS = ("Answer the question below. Reason inside <think> and </think> each time you get new information. "
                "When you lack some knowledge, search for it by writing <search> query </search>; the results "
                "come back between <information> and </information>. You may search as often as you need. "
                "Once you know the answer, write it alone between <answer> and </answer>, as in "
                "<answer> Beijing </answer>.\nQuestion: {question}")
REMINDER = ("\nThat was neither a search nor an answer. To search, I write the query between <search> and "
            "</search>; to answer, I write the answer between <answer> and </answer>.\n")
SEARCH = {"tool": "search", "start": "<search>", "end": "</search>",
          "result": "\n\n<information>{result}</information>\n\n"}


class SearchR1Env(InlineEnv):
    name = "search_r1"

    def __init__(self, *, search: dict | None = None, reward: str = "em", instructions: str = INSTRUCTIONS,
                 **kw) -> None:
        if search is None:
            raise ValueError("search_r1 needs search = { corpus = ... } (a JSON-lines file), { url = ... } (a "
                             "retrieval server) or { task_docs = ... } (each task's own documents)")
        if "tools" in kw or "actions" in kw:
            raise ValueError("search_r1 has one tool, its search (search = { ... }); "
                             "for other actions use env = 'inline', for chat-template tool calls env = 'dataset'")
        super().__init__(actions=[SEARCH], answer_end="</answer>", reminder=REMINDER, instructions=instructions,
                         search=search, reward=reward, **kw)

    def answer_of(self, task: dict, required: bool = True, raw: bool = False):
        if self.answer_key == "answer" and "answer" not in task and "golden_answers" in task:
            return task["golden_answers"]  # FlashRAG's and Search-R1's raw question files
        return super().answer_of(task, required, raw)
