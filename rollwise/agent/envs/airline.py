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
"""
from __future__ import annotations

import json
import random
import re
import shutil
import sqlite3
import uuid
from collections import OrderedDict
from pathlib import Path

from rollwise.agent.env import ToolEnv
from rollwise.agent.envs.sql import db_dir
from rollwise.agent.tools import Tool, ToolError

AIRPORTS = ["JFK", "LAX", "ORD", "SFO", "SEA", "BOS", "MIA", "DEN"]
FIRST = ["mia", "noah", "ava", "liam", "zoe", "omar", "ivy", "raj", "lena", "kai"]
LAST = ["li", "garcia", "smith", "khan", "rossi", "sato", "berg", "silva"]
CABINS = ("basic_economy", "economy", "business")
DATES = ("2024-05-15", "2024-05-16", "2024-05-17")
TODAY = "2024-05-15"
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


def build_db(task: dict) -> Path:
    """The task's starting database (built once per process from its seed; episodes change copies)."""
    path = db_dir() / f"{task['id']}.sqlite"
    if path.exists():
        return path
    rng = random.Random(task["db_seed"])
    tmp = path.with_suffix(f".{uuid.uuid4().hex}.tmp")
    con = sqlite3.connect(tmp)
    con.executescript(
        "CREATE TABLE users (id TEXT PRIMARY KEY, name TEXT, credit INTEGER);"
        "CREATE TABLE flights (number TEXT, date TEXT, origin TEXT, destination TEXT, status TEXT, "
        + ", ".join(f"price_{c} INTEGER, seats_{c} INTEGER" for c in CABINS) + ", PRIMARY KEY (number, date));"
        "CREATE TABLE reservations (id TEXT PRIMARY KEY, user_id TEXT, flight TEXT, date TEXT, cabin TEXT, "
        "passengers INTEGER, paid INTEGER, status TEXT);")
    names = rng.sample([(f, s) for f in FIRST for s in LAST], 6)
    users = [(f"{f}_{s}_{rng.randint(1000, 9999)}", f"{f.title()} {s.title()}", rng.randrange(100, 2001, 10))
             for f, s in names]
    con.executemany("INSERT INTO users VALUES (?, ?, ?)", users)
    routes = rng.sample([(a, b) for a in AIRPORTS for b in AIRPORTS if a != b], 5)
    flights = []
    for origin, dest in routes:
        for date in DATES:
            for _ in range(2):
                basic = rng.randrange(60, 200, 5)
                fares = [basic, basic + rng.randrange(30, 120, 5), 0]
                fares[2] = fares[1] * rng.randint(2, 3)
                departed = date == TODAY and rng.random() < 0.5
                flights.append((f"HAT{rng.randint(100, 999)}", date, origin, dest,
                                "departed" if departed else "scheduled",
                                *[x for c in range(3) for x in (fares[c], rng.randint(0, 6))]))
    con.executemany(f"INSERT OR IGNORE INTO flights VALUES ({', '.join('?' * 11)})", flights)
    rows = con.execute("SELECT number, date FROM flights").fetchall()
    for i in range(8):
        number, date = rng.choice(rows)
        cabin, n = rng.choice(CABINS), rng.randint(1, 3)
        fare = con.execute(f"SELECT price_{cabin} FROM flights WHERE number = ? AND date = ?",
                           (number, date)).fetchone()
        con.execute("INSERT INTO reservations VALUES (?, ?, ?, ?, ?, ?, ?, 'active')",
                    (f"R{rng.randint(10000, 99999)}{i}", rng.choice(users)[0], number, date, cabin, n, fare[0] * n))
    con.commit()
    con.close()
    tmp.replace(path)
    return path


# the tools' work, on a database file -----------------------------------------------------------------
def _row(con, sql: str, args: tuple, what: str) -> sqlite3.Row:
    row = con.execute(sql, args).fetchone()
    if row is None:
        raise ToolError(f"{what} not found")
    return row


def get_user(path: Path, user_id: str) -> dict:
    with _connect(path) as con:
        u = _row(con, "SELECT * FROM users WHERE id = ?", (user_id,), f"user {user_id!r}")
        res = [r[0] for r in con.execute("SELECT id FROM reservations WHERE user_id = ? ORDER BY id", (user_id,))]
        return {"user_id": u["id"], "name": u["name"], "travel_credit": u["credit"], "reservations": res}


def search_flights(path: Path, origin: str, destination: str, date: str) -> list[dict]:
    with _connect(path) as con:
        rows = con.execute("SELECT * FROM flights WHERE origin = ? AND destination = ? AND date = ? ORDER BY number",
                           (origin, destination, date)).fetchall()
        return [{"flight": r["number"], "date": r["date"], "status": r["status"],
                 **{c: {"price": r[f"price_{c}"], "seats": r[f"seats_{c}"]} for c in CABINS}} for r in rows]


def get_reservation(path: Path, reservation_id: str) -> dict:
    with _connect(path) as con:
        r = _row(con, "SELECT * FROM reservations WHERE id = ?", (reservation_id,), f"reservation {reservation_id!r}")
        f = _row(con, "SELECT status FROM flights WHERE number = ? AND date = ?", (r["flight"], r["date"]), "flight")
        return {"reservation_id": r["id"], "user_id": r["user_id"], "flight": r["flight"], "date": r["date"],
                "flight_status": f["status"], "cabin": r["cabin"], "passengers": r["passengers"], "paid": r["paid"],
                "status": r["status"]}


def _cabin(cabin: str) -> str:
    if cabin not in CABINS:
        raise ToolError(f"cabin must be one of {list(CABINS)}, got {cabin!r}")
    return cabin


def book_reservation(path: Path, user_id: str, flight: str, date: str, cabin: str, passengers: int) -> dict:
    cabin = _cabin(cabin)
    if not 1 <= passengers <= 5:
        raise ToolError("passengers must be 1 to 5")
    with _connect(path) as con:
        u = _row(con, "SELECT * FROM users WHERE id = ?", (user_id,), f"user {user_id!r}")
        f = _row(con, "SELECT * FROM flights WHERE number = ? AND date = ?", (flight, date),
                 f"flight {flight} on {date}")
        cost = f[f"price_{cabin}"] * passengers
        if f[f"seats_{cabin}"] < passengers:
            raise ToolError(f"only {f[f'seats_{cabin}']} {cabin} seats left")
        if u["credit"] < cost:
            raise ToolError(f"the travel credit ({u['credit']}) does not cover {cost}")
        rid = f"R{int(con.execute('SELECT COUNT(*) FROM reservations').fetchone()[0]) + 90000}"
        con.execute("INSERT INTO reservations VALUES (?, ?, ?, ?, ?, ?, ?, 'active')",
                    (rid, user_id, flight, date, cabin, passengers, cost))
        con.execute(f"UPDATE flights SET seats_{cabin} = seats_{cabin} - ? WHERE number = ? AND date = ?",
                    (passengers, flight, date))
        con.execute("UPDATE users SET credit = credit - ? WHERE id = ?", (cost, user_id))
        return {"reservation_id": rid, "paid": cost}


def cancel_reservation(path: Path, reservation_id: str) -> dict:
    with _connect(path) as con:
        r = _row(con, "SELECT * FROM reservations WHERE id = ?", (reservation_id,), f"reservation {reservation_id!r}")
        if r["status"] != "active":
            raise ToolError(f"reservation {reservation_id} is already {r['status']}")
        con.execute("UPDATE reservations SET status = 'cancelled' WHERE id = ?", (reservation_id,))
        con.execute(f"UPDATE flights SET seats_{r['cabin']} = seats_{r['cabin']} + ? WHERE number = ? AND date = ?",
                    (r["passengers"], r["flight"], r["date"]))
        con.execute("UPDATE users SET credit = credit + ? WHERE id = ?", (r["paid"], r["user_id"]))
        return {"reservation_id": reservation_id, "refunded": r["paid"]}


def change_cabin(path: Path, reservation_id: str, cabin: str) -> dict:
    cabin = _cabin(cabin)
    with _connect(path) as con:
        r = _row(con, "SELECT * FROM reservations WHERE id = ?", (reservation_id,), f"reservation {reservation_id!r}")
        f = _row(con, "SELECT * FROM flights WHERE number = ? AND date = ?", (r["flight"], r["date"]), "flight")
        u = _row(con, "SELECT * FROM users WHERE id = ?", (r["user_id"],), "user")
        if r["status"] != "active" or cabin == r["cabin"]:
            raise ToolError(f"reservation {reservation_id} is {r['status']} in {r['cabin']}")
        n, diff = r["passengers"], (f[f"price_{cabin}"] - f[f"price_{r['cabin']}"]) * r["passengers"]
        if f[f"seats_{cabin}"] < n:
            raise ToolError(f"only {f[f'seats_{cabin}']} {cabin} seats left")
        if u["credit"] < diff:
            raise ToolError(f"the travel credit ({u['credit']}) does not cover {diff}")
        old = r["cabin"]
        con.execute(f"UPDATE flights SET seats_{cabin} = seats_{cabin} - ?, seats_{old} = seats_{old} + ? "
                    "WHERE number = ? AND date = ?", (n, n, r["flight"], r["date"]))
        con.execute("UPDATE reservations SET cabin = ?, paid = paid + ? WHERE id = ?", (cabin, diff, reservation_id))
        con.execute("UPDATE users SET credit = credit - ? WHERE id = ?", (diff, u["id"]))
        return {"reservation_id": reservation_id, "cabin": cabin, "charged": diff}


ACTIONS = {f.__name__: f for f in (get_user, search_flights, get_reservation, book_reservation, cancel_reservation,
                                   change_cabin)}
WRITES = ("book_reservation", "cancel_reservation", "change_cabin")


class _connect:
    """One connection per call (tools run in worker threads), committed on success, with a step budget."""

    def __init__(self, path: Path) -> None:
        self.con = sqlite3.connect(path)
        self.con.row_factory = sqlite3.Row
        steps = [0]

        def budget() -> int:  # non-zero interrupts: ~1M sqlite VM steps at most
            steps[0] += 1
            return int(steps[0] > 1000)
        self.con.set_progress_handler(budget, 1000)

    def __enter__(self):
        return self.con

    def __exit__(self, kind, *_):
        try:
            if kind is None:
                self.con.commit()
        finally:
            self.con.close()


def state(path: Path) -> list:
    """What the reward compares: every user's credit, every reservation, every flight's seats."""
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return [con.execute(q).fetchall() for q in (
            "SELECT id, credit FROM users ORDER BY id", "SELECT * FROM reservations ORDER BY id",
            "SELECT number, date, " + ", ".join(f"seats_{c}" for c in CABINS) + " FROM flights ORDER BY number, date")]
    finally:
        con.close()


def _copy(task: dict) -> Path:
    path = db_dir() / f"{task['id']}.{uuid.uuid4().hex}.sqlite"
    shutil.copyfile(build_db(task), path)
    return path


class AirlineEnv(ToolEnv):
    name = "airline"
    system_prompt = POLICY
    answer_hint = "When you are done, reply to the customer without a tool call."

    def __init__(self, *, kinds: list[str] | tuple[str, ...] = KINDS, **kw) -> None:
        super().__init__(**kw)
        if isinstance(kinds, str) or not kinds or any(k not in ALL_KINDS for k in kinds):
            raise ValueError(f"kinds must be a non-empty list of {list(ALL_KINDS)}, got {kinds!r}")
        self.kinds = tuple(kinds)
        self.db: Path | None = None

    def make_tools(self, task):
        self._drop()
        self.db = path = _copy(task)
        tools = []
        for name, fn in ACTIONS.items():
            tools.append(Tool(_bound(fn, path), name=name, description=DESCRIPTIONS[name],
                              parameters=PARAMETERS[name]))
        return tools

    def prompt(self, task):
        return task["request"]

    def score(self, task, answer):
        if state(self.db) != gold_state(task):
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
        return calls + [task["reply"]]


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
        path = _copy(task)
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
            want = f"cancel reservation {r['id']} and, with its refund, {booking}; if either cannot be done, change nothing"
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
