"""airline: tau-bench's kind of task. A customer asks an airline agent to book a flight, cancel a
reservation, change a cabin or say what travel credit is left (or, with `kinds`, to cancel one
reservation and book another flight with its refund: both or neither); the agent serves them with
tools that read and write a booking database (sqlite, a copy of the task's per episode) under a
written policy.

As in tau-bench, the tools check only what the database itself needs (the flight exists, the seats
are there, the credit covers the charge); the policy (which flight to book, what may not be cancelled
or changed) is the agent's to follow. The reward is tau-bench's: the episode's database at the end
must equal the one the task's gold actions leave (so an action against the policy, or a missing
one, scores 0), and a question's answer must hold the number asked for. Each task names its user's
goal as an `instruction` too, so a simulated user (`user = { url = ... }`) can play the customer.
`confirm = true` adds tau-bench's rule that a write waits for the customer's explicit yes: a write
made before the customer has answered one of the agent's replies scores 0, and unless another user
is given, a scripted customer plays the part (yes to a question, the end at any other reply).
"""
from __future__ import annotations

import json
import random
import re
import sqlite3
from collections import OrderedDict
from pathlib import Path

from rollwise.agent.env import ToolEnv
from rollwise.agent.envs.airline_db import ACTIONS, CABINS, TODAY, WRITES, build_db, copy_db, state
from rollwise.agent.tools import Tool
from rollwise.agent.users import UserReply

KINDS = ("book", "cancel", "change", "credit")  # drawn by default, alike
ALL_KINDS = KINDS + ("rebook",)  # rebook: cancel a reservation and book another flight with the refund, or neither
POLICY = (f"You are an airline's customer service agent. Today is {TODAY}. Policy:\n"
          "- Look up the user's details first.\n"
          "- Book the cheapest flight on the requested route and date that has enough seats in the requested "
          "cabin for every passenger, paid with the user's travel credit. If the credit does not cover the fare "
          "for every passenger, book nothing.\n"
          "- Basic economy reservations cannot be cancelled. A flight that has departed cannot be cancelled or "
          "changed.\n"
          "- Cancelling refunds the amount paid to the travel credit.\n"
          "- A cabin change costs the fare difference for every passenger, paid with the travel credit; change "
          "nothing if the credit does not cover it or the new cabin lacks the seats.\n"
          "- Refuse any request against this policy.")
CONFIRM = ("\n- Before any write (a booking, a cancellation, a cabin change), list what you will do and ask the "
           "customer to confirm; write only after they say yes.")


class AirlineEnv(ToolEnv):
    name = "airline"
    system_prompt = POLICY
    answer_hint = "When you are done, reply to the customer without a tool call."

    def __init__(self, *, kinds: list[str] | tuple[str, ...] = KINDS, confirm: bool = False, **kw) -> None:
        if confirm and kw.get("user") is None:  # (a user given in the options, a simulated one, plays it instead)
            kw["user"] = {"kind": f"{__name__}:ConfirmingCustomer"}
        super().__init__(**kw)
        if isinstance(kinds, str) or not kinds or any(k not in ALL_KINDS for k in kinds):
            raise ValueError(f"kinds must be a non-empty list of {list(ALL_KINDS)}, got {kinds!r}")
        if not isinstance(confirm, bool):
            raise ValueError(f"confirm must be true or false, got {confirm!r}")
        self.kinds, self.confirm = tuple(kinds), confirm
        if confirm:
            self.system_prompt = POLICY + CONFIRM
            self.answer_hint = "Ask me before you change anything; when you are done, reply to me without a tool call."
        self.db: Path | None = None
        self._unconfirmed = False  # a write made before the customer answered the agent (confirm)

    def make_tools(self, task):
        self._drop()
        self.db = path = copy_db(task)
        self._unconfirmed = False
        tools = []
        for name, fn in ACTIONS.items():
            call = _bound(fn, path)
            if self.confirm and name in WRITES:
                call = self._confirmed(call)
            tools.append(Tool(call, name=name, description=DESCRIPTIONS[name], parameters=PARAMETERS[name]))
        return tools

    def _confirmed(self, call):
        """A write counts against the policy unless the customer has answered one of the agent's replies."""
        def write(**args):
            said = [m["role"] for m in self._dialogue]  # (what the two sides said: no tool calls or results)
            if not ("assistant" in said and "user" in said[said.index("assistant"):]):
                self._unconfirmed = True
            return call(**args)
        return write

    def prompt(self, task):
        return task["request"]

    def score(self, task, answer):
        if self._unconfirmed or state(self.db) != gold_state(task):
            return 0.0
        return float(task["kind"] != "credit" or task["answer"] in _numbers(answer))  # (tau-bench's outputs check)

    async def close(self) -> None:
        await super().close()
        self._drop()

    def _drop(self) -> None:
        if self.db is not None:
            self.db.unlink(missing_ok=True)
            self.db = None

    def sample_tasks(self, n: int, seed: int) -> list[dict]:
        rng = random.Random(seed)
        return [make_task(f"airline-{seed}-{i}", rng.randrange(2**31), self.kinds[rng.randrange(len(self.kinds))],
                          rng) for i in range(n)]

    def expert(self, task):
        calls = [self.call_text(name, **args) for name, args in task["expert"]]
        if self.confirm and task["gold"]:  # the lookups, the question, the writes once the customer says yes
            looked = len(task["expert"]) - len(task["gold"])
            ask = "I will " + " and ".join(_said(name, args) for name, args in task["gold"]) + ". Shall I go ahead?"
            calls.insert(looked, ask)
        return calls + [task["reply"]]


class ConfirmingCustomer:
    """tau-bench's customer, scripted (`confirm = true`): says yes to an agent's reply that asks a
    question, at most `max_yes` times, and ends the conversation at any other reply."""

    YES = "Yes, please go ahead."

    def __init__(self, max_yes: int = 2) -> None:
        self.max_yes, self.said = max_yes, 0

    def reply(self, task, dialogue, score) -> UserReply:
        if "?" in dialogue[-1]["content"] and self.said < self.max_yes:
            self.said += 1
            return UserReply(self.YES)
        return UserReply(None)


def _said(name: str, args: dict) -> str:
    """A write in words, as the expert lists it for the customer to confirm."""
    if name == "book_reservation":
        return (f"book {args['passengers']} seat(s) in {args['cabin']} on {args['flight']} on {args['date']}, "
                "paid with your travel credit")
    if name == "cancel_reservation":
        return f"cancel reservation {args['reservation_id']} and refund it to your travel credit"
    return f"move reservation {args['reservation_id']} to {args['cabin']}"


def _numbers(text: str) -> list[float]:
    """Every number the text writes ("$1,600.00" is 1600)."""
    return [float(x) for x in re.findall(r"\d+(?:\.\d+)?", text.replace(",", ""))]


def _bound(fn, path: Path):
    return lambda **args: json.dumps(fn(path, **args))


def _params(**props: str) -> dict:
    return {"type": "object", "properties": {k: {"type": t} for k, t in props.items()}, "required": list(props)}


PARAMETERS = {"get_user": _params(user_id="string"),
              "search_flights": _params(origin="string", destination="string", date="string"),
              "get_reservation": _params(reservation_id="string"),
              "book_reservation": _params(user_id="string", flight="string", date="string", cabin="string",
                                          passengers="integer"),
              "cancel_reservation": _params(reservation_id="string"),
              "change_cabin": _params(reservation_id="string", cabin="string")}
DESCRIPTIONS = {"get_user": "A user's name, travel credit and reservation ids.",
                "search_flights": "Flights on a route (airport codes) on a date (YYYY-MM-DD): status, and each "
                                  "cabin's price per passenger and seats left.",
                "get_reservation": "A reservation's flight, its status, cabin, passengers and amount paid.",
                "book_reservation": "Book seats in a cabin (basic_economy, economy or business) of a flight for the "
                                    "user, paid with their travel credit.",
                "cancel_reservation": "Cancel a reservation: its amount paid goes back to the travel credit.",
                "change_cabin": "Move a reservation to another cabin; the fare difference for every passenger is "
                                "paid from (or refunded to) the travel credit."}
_GOLD: OrderedDict[str, list] = OrderedDict()  # task id -> its gold state, the last GOLD_KEPT tasks'
GOLD_KEPT = 4096


def gold_state(task: dict) -> list:
    """The database the task's gold actions leave (computed once per task while it is recent)."""
    if task["id"] not in _GOLD:
        path = copy_db(task)
        try:
            for name, args in task["gold"]:
                ACTIONS[name](path, **args)
            _GOLD[task["id"]] = state(path)
        finally:
            path.unlink(missing_ok=True)
        while len(_GOLD) > GOLD_KEPT:
            _GOLD.popitem(last=False)
    _GOLD.move_to_end(task["id"])
    return _GOLD[task["id"]]


def _booking(con, rng: random.Random, users: list, freed: sqlite3.Row | None = None) -> tuple:
    """A booking request: its user (drawn, or `freed`'s), its search, its gold call (None if the policy
    forbids it) and the customer's words. `freed`: a reservation cancelled first (its refund and seats count)."""
    f0 = rng.choice(con.execute("SELECT * FROM flights WHERE status = 'scheduled' ORDER BY number, date").fetchall())
    u = rng.choice(users) if freed is None else next(x for x in users if x["id"] == freed["user_id"])
    cabin, n = rng.choice(CABINS), rng.randint(1, 3)
    route = {"origin": f0["origin"], "destination": f0["destination"], "date": f0["date"]}

    def seats(f) -> int:
        back = freed is not None and (freed["flight"], freed["date"], freed["cabin"]) == (f["number"], f["date"], cabin)
        return f[f"seats_{cabin}"] + (freed["passengers"] if back else 0)
    fits = [f for f in con.execute("SELECT * FROM flights WHERE origin = ? AND destination = ? AND date = ? AND "
                                   "status = 'scheduled' ORDER BY number", tuple(route.values())) if seats(f) >= n]
    best = min(fits, key=lambda f: (f[f"price_{cabin}"], f["number"])) if fits else None
    credit = u["credit"] + (freed["paid"] if freed is not None else 0)
    call = None
    if best is not None and best[f"price_{cabin}"] * n <= credit:
        call = ("book_reservation", {"user_id": u["id"], "flight": best["number"], "date": best["date"],
                                     "cabin": cabin, "passengers": n})
    want = (f"book {n} passenger{'s' * (n > 1)} in {cabin.replace('_', ' ')} on the cheapest flight from "
            f"{route['origin']} to {route['destination']} on {route['date']}")
    return u, ("search_flights", route), call, want


def make_task(task_id: str, db_seed: int, kind: str, rng: random.Random) -> dict:
    """A task of `kind` on a fresh database: the request, the customer's instruction, the gold
    actions (the writes the policy allows), the expert's calls and reply."""
    task = {"id": task_id, "db_seed": db_seed, "kind": kind}
    path = build_db(task)
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    con.row_factory = sqlite3.Row
    users = con.execute("SELECT * FROM users ORDER BY id").fetchall()
    res = con.execute("SELECT * FROM reservations WHERE status = 'active' ORDER BY id").fetchall()
    gold, look = [], [("get_user", {"user_id": None})]
    if kind == "book":
        u, search, call, want = _booking(con, rng, users)
        look.append(search)
        gold += [call] if call else []
        reply = (f"Booked {call[1]['flight']} in {call[1]['cabin']} for {call[1]['passengers']}." if call else
                 "I cannot book that: no flight has the seats, or the travel credit does not cover the fare.")
    else:
        r = rng.choice(res)
        u = next(x for x in users if x["id"] == r["user_id"])
        f = con.execute("SELECT * FROM flights WHERE number = ? AND date = ?", (r["flight"], r["date"])).fetchone()
        look.append(("get_reservation", {"reservation_id": r["id"]}))
        if kind == "cancel":
            ok = r["cabin"] != "basic_economy" and f["status"] != "departed"
            gold += [("cancel_reservation", {"reservation_id": r["id"]})] if ok else []
            want = f"cancel reservation {r['id']}"
            reply = f"Cancelled {r['id']}; {r['paid']} is back on your travel credit." if ok else \
                "I cannot cancel that reservation under our policy."
        elif kind == "change":  # to business, or from it to economy
            cabin = "business" if r["cabin"] != "business" else "economy"
            diff = (f[f"price_{cabin}"] - f[f"price_{r['cabin']}"]) * r["passengers"]
            ok = f["status"] != "departed" and f[f"seats_{cabin}"] >= r["passengers"] and diff <= u["credit"]
            gold += [("change_cabin", {"reservation_id": r["id"], "cabin": cabin})] if ok else []
            want = f"move reservation {r['id']} to {cabin}"
            reply = f"Moved {r['id']} to {cabin}." if ok else "I cannot change that reservation under our policy."
        elif kind == "rebook":  # both writes or neither: the booking is paid with the refund too
            _, search, call, booking = _booking(con, rng, users, freed=r)
            look.append(search)
            ok = r["cabin"] != "basic_economy" and f["status"] != "departed" and call is not None
            gold += [("cancel_reservation", {"reservation_id": r["id"]}), call] if ok else []
            want = (f"cancel reservation {r['id']} and, with its refund, {booking}; if either cannot be done, "
                    "change nothing")
            reply = (f"Cancelled {r['id']} and booked {call[1]['flight']} in {call[1]['cabin']} for "
                     f"{call[1]['passengers']}." if ok else "I cannot do both under our policy, so I changed nothing.")
        else:
            look = look[:1]
            task["answer"] = u["credit"]
            want = "know how much travel credit is left on {my} account"
            reply = f"You have {u['credit']} in travel credit."
    con.close()
    look[0][1]["user_id"] = u["id"]
    task |= {"request": f"Hi, I am {u['name']} (user id {u['id']}). I would like to {want.format(my='my')}.",
             "instruction": f"You are {u['name']}, user id {u['id']}. You want to {want.format(my='your')}. "
                            "Accept what the agent says the policy allows.",
             "gold": [list(g) for g in gold], "expert": [list(c) for c in look + gold], "reply": reply}
    return task
