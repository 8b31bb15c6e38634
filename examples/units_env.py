"""A user's environment, outside the package, for `rollwise train` (examples/train-units.toml):
length conversions answered with a `convert` tool, tasks read from examples/units-train.jsonl and
examples/units-eval.jsonl. `env = "examples/units_env.py:UnitsEnv"` names it; any `Env` class, or a
function returning one, works the same way (`package.module:Name` for an installed module).

    rollwise train examples/train-units.toml --set model=DIR
"""
from __future__ import annotations

import json

from rollwise.agent.env import ToolEnv, last_number
from rollwise.agent.tools import Tool

METERS = {"m": 1.0, "km": 1000.0, "mile": 1609.344, "ft": 0.3048, "yard": 0.9144}


def convert(value: float, from_unit: str, to_unit: str) -> str:
    """Convert a length between units: m, km, mile, ft, yard."""
    for unit in (from_unit, to_unit):
        if unit not in METERS:
            raise ValueError(f"unknown unit {unit!r}; known: {sorted(METERS)}")
    return f"{value * METERS[from_unit] / METERS[to_unit]:.6g}"


class UnitsEnv(ToolEnv):
    name = "units"
    system_prompt = "You convert lengths between units with the convert tool."

    def make_tools(self, task: dict) -> list[Tool]:
        return [Tool(convert)]

    def prompt(self, task: dict) -> str:
        return task["question"]

    def score(self, task: dict, answer: str) -> float:  # within 0.1%
        got = last_number(answer)
        return float(got is not None and abs(got - task["answer"]) <= 1e-3 * abs(task["answer"]))

    def expert(self, task: dict) -> list[str]:  # optional: a scripted solution, for an SFT warm start
        args = {"value": task["value"], "from_unit": task["from"], "to_unit": task["to"]}
        call = json.dumps({"name": "convert", "arguments": args})
        return [f"<tool_call>\n{call}\n</tool_call>", f"The answer is {convert(**args)}."]
