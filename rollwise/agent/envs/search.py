"""search: two-hop questions over a small encyclopedia drawn fresh for each task ("Which city is the
company founded by Ana Smith based in?"), answered through a `search` tool: BM25 over the task's
documents (rollwise.agent.search, the tool Search-R1 trains with). The person's page names the
company, only the company's page names its city, and the other pages share names and words with
them, so it takes two searches, the second built from the first's result (a guess among the
sixteen cities is right one time in sixteen). Exact-match reward (SQuAD's normalisation, as Search-R1's)."""
from __future__ import annotations

import random

from rollwise.agent.env import ToolEnv, exact_match
from rollwise.agent.envs.phonebook import FIRST, LAST
from rollwise.agent.search import SearchIndex, search_tool

BRAND = ["Kestrel", "Juniper", "Cobalt", "Harbor", "Lumen", "Granite", "Sable", "Vesper", "Orchid", "Falcon",
         "Willow", "Quartz", "Ember", "Tundra", "Aurora", "Maple"]
KIND = ["Labs", "Works", "Systems", "Foods", "Motors", "Media", "Textiles", "Robotics"]
CITIES = ["Port Avel", "Dunmore", "Silverton", "Calder Bay", "Ostrava Nova", "Redfield", "Lakemont", "Brisa",
          "Northgate", "Elmsworth", "Saltmarsh", "Vintry", "Copperhill", "Marlow Cross", "Thessly", "Gullhaven"]
ROLES = ["an engineer", "a chemist", "a designer", "a former teacher", "an economist", "a pilot"]
TRADES = ["a software", "a food", "an engineering", "a shipping", "a clothing", "a robotics"]
PEOPLE = 4  # people (each founded one company) and companies (each in its own city) per task


class SearchEnv(ToolEnv):
    name = "search"
    system_prompt = "You answer questions with the search tool, which finds documents about people and companies."
    answer_hint = "When you know the answer, reply with the city's name alone."

    def __init__(self, *, top_k: int = 3, **kw) -> None:
        super().__init__(**kw)
        self.top_k = top_k

    def make_tools(self, task):
        return [search_tool(SearchIndex.from_docs(task["docs"]), self.top_k)]

    def prompt(self, task):
        return f"Which city is the company founded by {task['person']} based in?"

    def score(self, task, answer):
        return exact_match(answer, task["answer"])

    def sample_tasks(self, n: int, seed: int) -> list[dict]:
        rng = random.Random(seed)
        out = []
        for i in range(n):
            people = rng.sample([f"{f} {s}" for f in FIRST for s in LAST], PEOPLE)
            companies = rng.sample([f"{b} {k}" for b in BRAND for k in KIND], PEOPLE)
            cities = rng.sample(CITIES, PEOPLE)
            docs = [{"id": f"p{j}", "title": p, "text": f"{p} is {rng.choice(ROLES)} who founded {c} in "
                     f"{rng.randint(1950, 2020)}."} for j, (p, c) in enumerate(zip(people, companies))]
            docs += [{"id": f"c{j}", "title": c, "text": f"{c} is {rng.choice(TRADES)} company based in {city}."}
                     for j, (c, city) in enumerate(zip(companies, cities))]
            rng.shuffle(docs)
            out.append({"id": f"search-{seed}-{i}", "person": people[0], "company": companies[0], "docs": docs,
                        "answer": cities[0]})
        return out

    def expert(self, task):
        return [self.call_text("search", query=q) for q in (task["person"], task["company"])] + [task["answer"]]
