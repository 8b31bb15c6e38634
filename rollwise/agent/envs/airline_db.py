"""The airline env's world (rollwise/agent/envs/airline.py): a task's booking database (sqlite, built
from its seed once per process; episodes change copies) and the tools' work on a database file.
The tools check only what the database itself needs (the flight exists, the seats are there, the
credit covers the charge); the policy is the agent's to keep, and the env's reward to check.
"""
from __future__ import annotations

import random
import shutil
import sqlite3
import uuid
from pathlib import Path

from rollwise.agent.envs.sql import db_dir
from rollwise.agent.tools import ToolError

AIRPORTS = ["JFK", "LAX", "ORD", "SFO", "SEA", "BOS", "MIA", "DEN"]
FIRST = ["mia", "noah", "ava", "liam", "zoe", "omar", "ivy", "raj", "lena", "kai"]
LAST = ["li", "garcia", "smith", "khan", "rossi", "sato", "berg", "silva"]
CABINS = ("basic_economy", "economy", "business")
DATES = ("2024-05-15", "2024-05-16", "2024-05-17")
TODAY = "2024-05-15"


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


def copy_db(task: dict) -> Path:
    """A copy of the task's database for one episode (or one gold run): the caller deletes it."""
    path = db_dir() / f"{task['id']}.{uuid.uuid4().hex}.sqlite"
    shutil.copyfile(build_db(task), path)
    return path
