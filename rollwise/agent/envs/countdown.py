"""countdown: reach a target with given numbers (each at most once); an `evaluate` tool; the final
expression is verified."""
from __future__ import annotations

import random
from collections import Counter

from rollwise.agent.env import ToolEnv
from rollwise.agent.envs.arith import evaluate, fmt, numbers_used
from rollwise.agent.tools import Tool


def check(expression: str, numbers: list[int]) -> str | None:
    """None if the expression only uses the given numbers (each at most once), else why not."""
    try:
        used = Counter(numbers_used(expression))
    except SyntaxError:
        return "not an arithmetic expression"
    extra = used - Counter(numbers)
    return None if not extra else f"uses numbers not available: {sorted(extra.elements())}"


class CountdownEnv(ToolEnv):
    name = "countdown"
    system_prompt = ("You play countdown: combine the given numbers with + - * / (each number at most once) "
                     "to reach the target. Check candidates with the evaluate tool.")
    answer_hint = "When you are done, reply with the expression alone."

    def make_tools(self, task):
        def evaluate_expression(expression: str) -> str:
            """Evaluate an expression over the given numbers and say whether it reaches the target."""
            why = check(expression, task["numbers"])
            if why:
                raise ValueError(why)
            v = evaluate(expression)
            return f"{fmt(v)} ({'reaches' if abs(v - task['target']) < 1e-9 else 'does not reach'} {task['target']})"
        return [Tool(evaluate_expression, name="evaluate", pure=True)]

    def prompt(self, task):
        return f"Numbers: {task['numbers']}. Target: {task['target']}."

    def score(self, task, answer):
        expr = answer.strip().splitlines()[0].split("=")[0].strip() if answer.strip() else ""
        if not expr or check(expr, task["numbers"]):
            return 0.0
        try:
            return float(abs(evaluate(expr) - task["target"]) < 1e-9)
        except ValueError:
            return 0.0

    def sample_tasks(self, n: int, seed: int) -> list[dict]:
        rng = random.Random(seed)
        out = []
        while len(out) < n:
            nums = [rng.randint(1, 25) for _ in range(4)]
            k = rng.randint(2, 4)
            pick = rng.sample(nums, k)
            expr = str(pick[0])
            for x in pick[1:]:
                op = rng.choice("+-*")
                expr = f"({expr} {op} {x})" if op != "*" else f"{expr} * {x}"
            target = evaluate(expr)
            if target <= 0 or target > 1000 or not float(target).is_integer():
                continue
            out.append({"id": f"countdown-{seed}-{len(out)}", "numbers": nums, "target": int(target),
                        "solution": expr})
        return out

    def expert(self, task):
        return [self.call_text("evaluate", expression=task["solution"]), task["solution"]]
