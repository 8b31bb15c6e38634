"""phonebook: questions about a company's staff (a phone extension, an office room); a `lookup` tool
over that task's directory. Every task draws a fresh directory, so answers cannot be memorised:
they have to be looked up. Exact-answer reward."""
from __future__ import annotations

import json
import random

from rollwise.agent.env import ToolEnv, last_number
from rollwise.agent.tools import Tool

FIRST = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jo", "Kai", "Lea", "Mona", "Nils",
         "Omar", "Pia", "Quinn", "Rosa", "Sam", "Tara"]
LAST = ["Smith", "Lopez", "Khan", "Meyer", "Rossi", "Novak", "Silva", "Berg", "Costa", "Weber", "Sato", "Moreau",
        "Jansen", "Olsen", "Park", "Reyes"]
FIELDS = {"extension": "phone extension", "room": "office room number"}


class PhonebookEnv(ToolEnv):
    name = "phonebook"
    system_prompt = "You answer questions about the staff of a company. Use the lookup tool to find their details."

    def make_tools(self, task):
        directory = task["directory"]

        def lookup(name: str) -> str:
            """Find a staff member by full name; returns their details as JSON."""
            entry = directory.get(" ".join(str(name).split()))
            if entry is None:
                return f"error: no staff member named {name!r}"
            return json.dumps(entry)
        return [Tool(lookup, pure=True)]

    def prompt(self, task):
        return f"What is the {FIELDS[task['field']]} of {task['name']}?"

    def score(self, task, answer):
        got = last_number(answer)
        return float(got is not None and got == task["answer"])

    def sample_tasks(self, n: int, seed: int) -> list[dict]:
        rng = random.Random(seed)
        out = []
        for i in range(n):
            people = rng.sample([f"{f} {s}" for f in FIRST for s in LAST], 4)
            directory = {p: {"extension": rng.randint(100, 999), "room": rng.randint(1, 60)} for p in people}
            name, field = people[0], rng.choice(sorted(FIELDS))
            out.append({"id": f"phonebook-{seed}-{i}", "name": name, "field": field, "directory": directory,
                        "answer": directory[name][field]})
        return out

    def expert(self, task):
        return [self.call_text("lookup", name=task["name"]), f"The {FIELDS[task['field']]} is {task['answer']}."]
