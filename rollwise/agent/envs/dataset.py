"""dataset: RL on a prompt set and a verifier without writing an environment class. Tasks come from
files (`train_tasks_file`, `eval_tasks_file`), each with a `prompt` (or chat `messages`) and what
the reward reads; the reward is a built-in rule or a user's function; tools are optional.

    env = "dataset"
    env_options = { reward = "number", tools = ["python", "my_tools.py:search"] }
    train_tasks_file = "gsm8k-train.jsonl"        # {"prompt": "...", "answer": 72}

Rewards (the built-in rules score a reply's last `<answer>...</answer>` block if it has one, else the
reply without its `<think>...</think>`: `final_answer`): `exact` (the answer equals the task's
`answer`, case and surrounding space ignored),
`em` (SQuAD's exact match: equal to the answer, or to one of a list of them, after normalising case,
punctuation and articles; Search-R1's reward), `f1` (SQuAD's token F1 against the best of them),
`number` (its last number equals it), `contains` (it appears in the answer), `math` (its final
expression, a `\\boxed{}` one first, equals the answer as mathematics: math-verify in worker processes
under a deadline, `math_timeout_s`; rollwise.agent.math_reward), `auto` (by each task's
`data_source`, as verl picks for the sources it knows: `number` for GSM8K, `math` for MATH, DAPO,
NuminaMath and AIME, `em` for Search-R1's QA sets), `unit_tests` (the
answer's last fenced code block, then the task's `tests`, run to the end in the code sandbox),
`judge` (an LLM grades it against the task and its reference answer, if any: `judge = { url, model,
... }`, `rollwise.agent.judge`), `model` (a learned reward model's score of the answer in its
conversation: `reward_model = { path, ... }`, `rollwise.agent.reward_model`), or `module:function` /
`file.py:function` called as `function(task, answer_text) -> float` (a coroutine function is
awaited; a plain one runs in a worker thread, so a slow verifier holds up no other episode); a
function with verl's parameters, `compute_score(data_source, solution_str, ground_truth,
extra_info=None)`, is called as verl calls it.
Tools: `python` (the code sandbox), `search` (BM25 over a
corpus, or a Search-R1 retrieval server: `search = { corpus = "wiki.jsonl", top_k = 3 }` or `{ url =
"http://host:8000/retrieve" }`, or each task's own documents: `{ task_docs = "docs" }`, rollwise.agent.search)
or a user's typed function (or `Tool`) by the same naming. A task's `solution` (a string, or a list of assistant
messages) is its expert transcript, for an SFT warm start. `prompt_key` and `answer_key` name other
fields (`question`, `ground_truth`, or a nested one as `extra_info.answer`).

verl's data files (and Search-R1's, made by its scripts) are read as they are, Parquet included: the
prompt may be a conversation (a list of messages), and a task without an `answer` is scored against
`reward_model.ground_truth`; a ground truth `{"target": [...]}` (Search-R1's) is its list of answers.
"""
from __future__ import annotations

import asyncio
import inspect
import re
import secrets

from rollwise.agent.env import FEEDBACK_CHARS, ToolEnv, exact_match, f1_score, maybe_await, number_reward
from rollwise.agent.judge import Judge, JudgeConfig
from rollwise.agent.math_reward import MathVerifier, check_installed
from rollwise.agent.plugins import FORM, load_object
from rollwise.agent.reward_model import RewardModel, RewardModelConfig
from rollwise.agent.sandbox import Sandbox
from rollwise.agent.search import TaskDocsSearch, make_search
from rollwise.agent.tools import Tool


def _exact(want, answer: str) -> float:
    return float(answer.strip().lower() == str(want).strip().lower())


def _number(want, answer: str) -> float:
    return number_reward(answer, want)


def _contains(want, answer: str) -> float:
    return float(str(want).lower() in answer.lower())


_FENCE = re.compile(r"```[\w+-]*\n(.*?)```", re.S)
_THINK = re.compile(r"<think>.*?(?:</think>|$)", re.S)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


def final_answer(text: str) -> str:
    """What a built-in rule scores in a reply: its last `<answer>...</answer>` block's content, if it
    has one (Search-R1's and verl's convention for tagged answers), else the reply without its
    `<think>...</think>` reasoning (Qwen3's and R1's)."""
    answers = _ANSWER.findall(text)
    return answers[-1].strip() if answers else _THINK.sub("", text).strip()


def program_in(answer: str) -> str:
    """The answer's last fenced code block (```python ... ```), or the whole answer if it has none."""
    blocks = _FENCE.findall(answer)
    return blocks[-1] if blocks else answer


def _em(want, answer: str) -> float:
    return exact_match(answer, want)


def _f1(want, answer: str) -> float:
    return f1_score(answer, want)


# and unit_tests, which runs the sandbox
REWARDS = {"exact": _exact, "number": _number, "contains": _contains, "em": _em, "f1": _f1}
# a user's reward function with these parameters is verl's compute_score
VERL_ARGS = {"data_source", "solution_str", "ground_truth"}
# reward = "auto": the rule for each task's data_source, the sources verl's default_compute_score knows
SOURCE_REWARDS = {"openai/gsm8k": "number", "lighteval/MATH": "math", "DigitalLearningGmbH/MATH-lighteval": "math",
                  "HuggingFaceH4/MATH-500": "math", "math_dapo": "math", "math": "math", "hiyouga/geometry3k": "math",
                  **{s: "em" for s in ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique",
                                       "bamboogle")}}
SOURCE_PREFIXES = {"searchR1_": "em", "numina_": "math", "aime": "math"}


def reward_for_source(source) -> str:
    """The built-in rule for a task's `data_source`; a ValueError names the known ones."""
    if source in SOURCE_REWARDS:
        return SOURCE_REWARDS[source]
    for prefix, rule in SOURCE_PREFIXES.items():
        if isinstance(source, str) and source.startswith(prefix):
            return rule
    raise ValueError(f"reward = 'auto' has no rule for data_source {source!r}; known: {sorted(SOURCE_REWARDS)} "
                     f"and names starting {sorted(SOURCE_PREFIXES)}; name a reward instead")


def _parameters(fn) -> list[str]:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin without a signature
        return []


class DatasetEnv(ToolEnv):
    name = "dataset"

    def __init__(self, *, reward: str = "exact", tools: list[str] = (), prompt_key: str = "prompt",
                 answer_key: str = "answer", system_prompt: str | None = None, answer_hint: str | None = None,
                 sandbox_timeout_s: float = 5.0, tool_timeout: float = 10.0, judge: dict | None = None,
                 search: dict | None = None, math_timeout_s: float = 5.0, reward_model: dict | None = None,
                 **kw) -> None:
        super().__init__(tool_timeout=tool_timeout, **kw)  # (for a user's tools; the sandbox keeps its own)
        self.prompt_key, self.answer_key = prompt_key, answer_key
        self.math_timeout_s = math_timeout_s
        self.sandbox = Sandbox(timeout_s=sandbox_timeout_s)
        self._runs: dict[str, str | None] = {}  # unit_tests: an answer's failing run's output (None: it passed)
        self._threaded = False  # a user's plain function runs in a worker thread
        if (reward == "judge") != (judge is not None):
            raise ValueError("reward = 'judge' needs judge = { url = ..., ... } (and judge options need it)")
        self.judge = JudgeConfig.from_dict(judge) if judge is not None else None
        if (reward == "model") != (reward_model is not None):
            raise ValueError("reward = 'model' needs reward_model = { path = ..., ... } (and reward_model options "
                             "need it)")
        self.reward_model = RewardModelConfig.from_dict(reward_model) if reward_model is not None else None
        if reward == "unit_tests":
            self.reward = self._unit_tests
        elif reward == "judge":
            self.reward = self._judge
        elif reward == "model":
            self.reward = self._reward_model
        elif reward == "math":
            check_installed()
            self.reward = self._math
        elif reward == "auto":
            self.reward = self._auto
        elif reward in REWARDS:
            rule = REWARDS[reward]
            self.reward = lambda task, answer: rule(self.answer_of(task), final_answer(answer))
        elif ":" in reward:
            fn = load_object(reward, "reward function")
            self.reward = self._verl_reward(fn) if VERL_ARGS <= set(_parameters(fn)) else fn
            self._threaded = not inspect.iscoroutinefunction(self.reward)
        else:
            valid = sorted([*REWARDS, "auto", "judge", "math", "model", "unit_tests"])
            raise ValueError(f"unknown reward {reward!r}; valid: {valid}, or a user's function as {FORM}")
        if ("search" in tools) != (search is not None):
            raise ValueError("tools = ['search'] needs search = { corpus = ... } or { url = ... } (and search options "
                             "need it)")
        self._search = search
        self._tools = [self._make_tool(spec) for spec in tools]
        if system_prompt is not None:
            self.system_prompt = system_prompt
        if answer_hint is not None:
            self.answer_hint = answer_hint

    async def _unit_tests(self, task: dict, answer: str) -> float:
        """1.0 when the answer's program, followed by the task's `tests` (asserts), runs to the end
        in the sandbox: exit code 0 and a line the tests print last, unknown to the program, so one
        that exits early (`sys.exit(0)`) does not pass (nor one that prints more than the sandbox's
        `max_output` keeps)."""
        done = f"tests passed {secrets.token_hex(8)}"
        result = await self.sandbox.run(f"{program_in(answer)}\n\n{self._field(task, 'tests')}\nprint({done!r})\n")
        passed = result.ok and done in result.stdout.splitlines()
        self._runs[answer] = None if passed else result.observation().replace(done, "")[-FEEDBACK_CHARS:].strip()
        return float(passed)

    def feedback(self, task: dict, answer: str) -> str | None:
        """For `unit_tests`: the failing run's output (its traceback: the assert that failed), as a
        user giving execution feedback tells it (`user = { kind = "feedback", details = true }`)."""
        said = self._runs.get(answer)
        return f"The tests failed:\n{said}" if said else None

    async def _math(self, task: dict, answer: str) -> float:
        """math-verify's equivalence of the answer's final expression and the task's, in a worker
        process under a deadline (rollwise.agent.math_reward)."""
        return await MathVerifier.shared(self.math_timeout_s).score(self.answer_of(task), final_answer(answer))

    async def _auto(self, task: dict, answer: str) -> float:
        """The rule for the task's `data_source` (reward_for_source): verl's choice for its sources."""
        rule = reward_for_source(task.get("data_source"))
        if rule == "math":
            check_installed()
            return await self._math(task, answer)
        return REWARDS[rule](self.answer_of(task), final_answer(answer))

    async def _judge(self, task: dict, answer: str) -> float:
        """The judge's grade of the answer: the task's question (its prompt, or its last user
        message) and its reference answer (`answer_key`, if the task has one)."""
        conversation = self._conversation(task)
        if conversation is not None:
            question = next((m.get("content") or "" for m in reversed(conversation) if m.get("role") == "user"), "")
        else:
            question = self._field(task, self.prompt_key)
        return await Judge.shared(self.judge).grade(question, answer, self.answer_of(task, required=False))

    async def _reward_model(self, task: dict, answer: str) -> float:
        """A reward model's score of the answer (without its `<think>`) after the task's conversation
        (its messages, or its prompt as a user message); rollwise.agent.reward_model."""
        conversation = self._conversation(task)
        question = ([m for m in conversation if m.get("role") != "system"] if conversation is not None
                    else [{"role": "user", "content": self._field(task, self.prompt_key)}])
        reply = {"role": "assistant", "content": _THINK.sub("", answer).strip()}
        return await (await RewardModel.shared(self.reward_model)).score([*question, reply])

    def _make_tool(self, spec: str) -> Tool | TaskDocsSearch:
        if spec == "python":
            return self.sandbox.tool("python")
        if spec == "search":
            return make_search(self._search)
        if ":" not in spec:
            raise ValueError(f"unknown tool {spec!r}; valid: 'python', 'search', or a user's function as {FORM}")
        obj = load_object(spec, "tool", accept=lambda o: callable(o) or isinstance(o, Tool))
        return obj if isinstance(obj, Tool) else Tool(obj)

    def make_tools(self, task):
        return [t.tool_for(task) if isinstance(t, TaskDocsSearch) else t for t in self._tools]

    async def reset(self, task: dict) -> list[dict]:
        conversation = self._conversation(task)
        if conversation is None:
            return await super().reset(task)
        await self.set_up(task)  # tools and state; the task's own conversation for messages
        msgs = list(conversation)
        if not (msgs and msgs[0].get("role") == "system"):
            msgs = [{"role": "system", "content": self.system_prompt}, *msgs]
        return await self.begin_dialogue(msgs)

    def _conversation(self, task: dict) -> list[dict] | None:
        """The task's own messages: `messages`, or a prompt given as a list of them (verl's layout)."""
        if "messages" in task:
            return task["messages"]
        prompt = task.get(self.prompt_key)
        return prompt if isinstance(prompt, list) else None

    def answer_of(self, task: dict, required: bool = True, raw: bool = False):
        """What the reward compares with: `answer_key`'s field or, for a task in verl's layout without
        an `answer`, `reward_model.ground_truth`; Search-R1's `{"target": [...]}` is its answers
        (unless `raw`: as the file has it)."""
        key = self.answer_key
        if key == "answer" and "answer" not in task and "ground_truth" in (task.get("reward_model") or {}):
            key = "reward_model.ground_truth"
        want = self._field(task, key) if required else self._lookup(task, key)
        if isinstance(want, dict) and "target" in want and not raw:
            return want["target"]
        return want

    def _verl_reward(self, fn):
        """verl's `compute_score(data_source, solution_str, ground_truth, extra_info=None)` as a reward
        of (task, answer): the task's `data_source`, the answer, its ground truth as the file has it
        and its `extra_info`; a dict it returns gives its "score" (verl's convention)."""
        extra = "extra_info" in _parameters(fn)

        def call(task, answer):
            kw = {"data_source": task.get("data_source"), "solution_str": answer,
                  "ground_truth": self.answer_of(task, raw=True)}
            return fn(**kw, extra_info=task.get("extra_info")) if extra else fn(**kw)

        def score(value):
            return value["score"] if isinstance(value, dict) else value
        if inspect.iscoroutinefunction(fn):
            async def reward(task, answer):
                return score(await call(task, answer))
        else:
            def reward(task, answer):
                return score(call(task, answer))
        return reward

    @staticmethod
    def _lookup(task: dict, key: str):
        """`task[key]`, or for a dotted key the nested field (`reward_model.ground_truth`); None if absent."""
        if key in task:
            return task[key]
        node = task
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node

    @classmethod
    def _field(cls, task: dict, key: str):
        value = cls._lookup(task, key)
        if value is None:
            raise ValueError(f"task {task.get('id')!r} has no {key!r} (fields: {sorted(task)})")
        return value

    def prompt(self, task):
        if self.user_opens and self._lookup(task, self.prompt_key) is None:
            return ""  # (the user writes the first message: tau-bench's tasks are the user's instruction alone)
        return self._field(task, self.prompt_key)

    async def score(self, task, answer):
        """The reward; a user's function may be a coroutine, and a plain one runs in a worker
        thread, so a slow verifier (a judge model, a test suite) holds up no other episode."""
        if self._threaded:
            return float(await asyncio.to_thread(self.reward, task, answer))
        return float(await maybe_await(self.reward(task, answer)))

    def expert(self, task) -> list[str]:
        solution = task.get("solution")
        if solution is None:
            raise ValueError(f"task {task.get('id')!r} has no 'solution' to warm-start from (set sft_steps = 0)")
        return [solution] if isinstance(solution, str) else list(solution)
