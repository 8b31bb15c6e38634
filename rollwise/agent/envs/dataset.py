"""dataset: RL on a prompt set and a verifier without writing an environment class. Tasks come from
files (`train_tasks_file`, `eval_tasks_file`), each with a `prompt` (or chat `messages`) and what
the reward reads; the reward is a built-in rule or a user's function; tools are optional.

    env = "dataset"
    env_options = { reward = "number", tools = ["python", "my_tools.py:search"] }
    train_tasks_file = "gsm8k-train.jsonl"        # {"prompt": "...", "answer": 72}

Rewards: `exact` (the answer equals the task's `answer`, case and surrounding space ignored),
`number` (its last number equals it), `contains` (it appears in the answer), or `module:function` /
`file.py:function` called as `function(task, answer_text) -> float`. Tools: `python` (the code
sandbox) or a user's typed function (or `Tool`) by the same naming. A task's `solution` (a string,
or a list of assistant messages) is its expert transcript, for an SFT warm start. `prompt_key` and
`answer_key` name other fields (`question`, `ground_truth`).
"""
from __future__ import annotations

from rollwise.agent.env import ToolEnv, number_reward
from rollwise.agent.plugins import load_object
from rollwise.agent.sandbox import Sandbox
from rollwise.agent.tools import Tool


def _exact(want, answer: str) -> float:
    return float(answer.strip().lower() == str(want).strip().lower())


def _number(want, answer: str) -> float:
    return number_reward(answer, want)


def _contains(want, answer: str) -> float:
    return float(str(want).lower() in answer.lower())


REWARDS = {"exact": _exact, "number": _number, "contains": _contains}


class DatasetEnv(ToolEnv):
    name = "dataset"

    def __init__(self, *, reward: str = "exact", tools: list[str] = (), prompt_key: str = "prompt",
                 answer_key: str = "answer", system_prompt: str | None = None, answer_hint: str | None = None,
                 **kw) -> None:
        super().__init__(**kw)
        self.prompt_key, self.answer_key = prompt_key, answer_key
        if reward in REWARDS:
            rule = REWARDS[reward]
            self.reward = lambda task, answer: rule(self._field(task, answer_key), answer)
        elif ":" in reward:
            self.reward = load_object(reward, "reward function")
        else:
            raise ValueError(f"unknown reward {reward!r}; valid: {sorted(REWARDS)}, or a user's function as "
                             "'package.module:name' or 'path/to/file.py:name'")
        self._tools = [self._make_tool(spec) for spec in tools]
        if system_prompt is not None:
            self.system_prompt = system_prompt
        if answer_hint is not None:
            self.answer_hint = answer_hint

    @staticmethod
    def _make_tool(spec: str) -> Tool:
        if spec == "python":
            return Sandbox().tool("python")
        if ":" not in spec:
            raise ValueError(f"unknown tool {spec!r}; valid: 'python', or a user's function as "
                             "'package.module:name' or 'path/to/file.py:name'")
        obj = load_object(spec, "tool", accept=lambda o: callable(o) or isinstance(o, Tool))
        return obj if isinstance(obj, Tool) else Tool(obj)

    def make_tools(self, task):
        return list(self._tools)

    async def reset(self, task: dict) -> list[dict]:
        if "messages" not in task:
            return await super().reset(task)
        await super().reset({**task, self.prompt_key: ""})  # tools and state; the task's own conversation instead
        self.task = task
        msgs = list(task["messages"])
        return msgs if msgs and msgs[0].get("role") == "system" else [{"role": "system", "content": self.system_prompt}, *msgs]

    @staticmethod
    def _field(task: dict, key: str):
        if key not in task:
            raise ValueError(f"task {task.get('id')!r} has no {key!r} (fields: {sorted(task)})")
        return task[key]

    def prompt(self, task):
        return self._field(task, self.prompt_key)

    def score(self, task, answer):
        return float(self.reward(task, answer))

    def expert(self, task) -> list[str]:
        solution = task.get("solution")
        if solution is None:
            raise ValueError(f"task {task.get('id')!r} has no 'solution' to warm-start from (set sft_steps = 0)")
        return [solution] if isinstance(solution, str) else list(solution)
