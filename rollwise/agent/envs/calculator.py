"""calculator: multi-step arithmetic word problems; a `calculator` tool; exact-answer reward."""
from __future__ import annotations

import random

from rollwise.agent.env import ToolEnv, last_number
from rollwise.agent.envs.arith import evaluate, fmt
from rollwise.agent.tools import Tool

TEMPLATES = [
    ("{n1} has {a} marbles, buys {b} bags of {c} marbles each and gives away {d}. How many marbles now?",
     "{a} + {b} * {c} - {d}"),
    ("A shop had {a} apples, sold {d} in the morning and received {b} crates of {c}. How many apples now?",
     "{a} - {d} + {b} * {c}"),
    ("{n1} saves {c} coins a day for {b} days, then spends {d}, then finds {a}. How many coins?",
     "{c} * {b} - {d} + {a}"),
    ("A train has {b} cars with {c} seats each; {d} seats are broken and {a} extra chairs are added. "
     "How many seats are there?", "{b} * {c} - {d} + {a}"),
    ("{n1} shares {a} candies equally among {b} friends; each friend's share is then multiplied by {c}. "
     "How many candies does each friend have?", "({a} / {b}) * {c}"),
]
NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fay", "Gus", "Hana"]


class CalculatorEnv(ToolEnv):
    name = "calculator"
    system_prompt = "You solve arithmetic word problems. Use the calculator tool for every computation."

    def make_tools(self, task):
        def calculator(expression: str) -> str:
            """Evaluate an arithmetic expression with + - * / and parentheses."""
            return fmt(evaluate(expression))
        return [Tool(calculator, pure=True)]

    def prompt(self, task):
        return task["question"]

    def score(self, task, answer):
        got = last_number(answer)
        return float(got is not None and abs(got - task["answer"]) < 1e-6)

    def sample_tasks(self, n: int, seed: int) -> list[dict]:
        rng = random.Random(seed)
        out = []
        for i in range(n):
            q, e = TEMPLATES[rng.randrange(len(TEMPLATES))]
            b = rng.randint(2, 9)
            v = dict(a=rng.randint(10, 99), b=b, c=rng.randint(2, 12), d=rng.randint(1, 9), n1=rng.choice(NAMES))
            if "/" in e:
                v["a"] = b * rng.randint(2, 20)  # divides evenly
            expr = e.format(**v)
            out.append({"id": f"calculator-{seed}-{i}", "question": q.format(**v), "expression": expr,
                        "answer": evaluate(expr)})
        return out

    def expert(self, task):
        return [self.call_text("calculator", expression=task["expression"]), f"The answer is {fmt(task['answer'])}."]
