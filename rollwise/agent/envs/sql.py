"""sql: a small sqlite database generated per task (customers, products, orders); a `sql_query`
tool on a read-only connection with a row cap and a step budget; questions with exact answers."""
from __future__ import annotations

import atexit
import json
import random
import shutil
import sqlite3
import tempfile
from pathlib import Path

from rollwise.agent.env import ToolEnv, last_number
from rollwise.agent.tools import Tool

CITIES = ["Paris", "Lima", "Oslo", "Cairo", "Kyoto", "Quito", "Perth"]
FIRST = ["Ada", "Bo", "Cy", "Di", "Ed", "Flo", "Gil", "Hal", "Ivy", "Jo", "Kai", "Lu"]
LAST = ["Stone", "Rivers", "Hill", "Park", "Lake", "Wood"]
PRODUCTS = ["lamp", "desk", "chair", "mug", "kettle", "clock", "rug", "vase", "shelf", "sofa"]
MAX_ROWS = 50
MAX_STEPS = 200_000  # sqlite VM steps per query before it is interrupted
_DIR: Path | None = None


def db_dir() -> Path:
    """This process's folder for the envs' sqlite files (sql's, airline's), removed at exit."""
    global _DIR
    if _DIR is None:
        _DIR = Path(tempfile.mkdtemp(prefix="rollwise-db-"))
        atexit.register(shutil.rmtree, _DIR, True)
    return _DIR


def build_db(task: dict) -> Path:
    """The task's database file (built once per process, from the task's seed)."""
    path = db_dir() / f"{task['id']}.sqlite"
    if path.exists():
        return path
    rng = random.Random(task["db_seed"])
    tmp = path.with_suffix(".tmp")
    con = sqlite3.connect(tmp)
    con.executescript("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT, city TEXT);"
                      "CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT, price REAL);"
                      "CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER, product_id INTEGER, "
                      "quantity INTEGER);")
    names = rng.sample([f"{f} {l}" for f in FIRST for l in LAST], 12)
    con.executemany("INSERT INTO customers VALUES (?, ?, ?)", [(i + 1, n, rng.choice(CITIES)) for i, n in enumerate(names)])
    prods = rng.sample(PRODUCTS, 8)
    prices = rng.sample(range(5, 500), 8)
    con.executemany("INSERT INTO products VALUES (?, ?, ?)", [(i + 1, p, float(prices[i])) for i, p in enumerate(prods)])
    con.executemany("INSERT INTO orders VALUES (?, ?, ?, ?)",
                    [(i + 1, rng.randint(1, 12), rng.randint(1, 8), rng.randint(1, 5)) for i in range(40)])
    con.commit()
    con.close()
    tmp.replace(path)
    return path


_ALLOWED = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}


def _authorize(action, *_):  # reads only: no ATTACH (a new, writable file), no PRAGMA, no writes
    return sqlite3.SQLITE_OK if action in _ALLOWED else sqlite3.SQLITE_DENY


def run_query(path: Path, query: str) -> list[tuple]:
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)  # read-only file, and reads-only statements
    con.set_authorizer(_authorize)
    try:
        steps = [0]

        def budget() -> int:
            steps[0] += 1000
            return 1 if steps[0] > MAX_STEPS else 0  # non-zero interrupts the query
        con.set_progress_handler(budget, 1000)
        return con.execute(query).fetchmany(MAX_ROWS)
    finally:
        con.close()


QUESTIONS = [  # (question, SQL) templates; the SQL's single value is the answer
    ("How many orders did {name} place?",
     "SELECT COUNT(*) FROM orders o JOIN customers c ON o.customer_id = c.id WHERE c.name = '{name}'"),
    ("How many customers live in {city}?", "SELECT COUNT(*) FROM customers WHERE city = '{city}'"),
    ("What is the name of the most expensive product?", "SELECT name FROM products ORDER BY price DESC LIMIT 1"),
    ("How many units of {product} were ordered in total?",
     "SELECT COALESCE(SUM(o.quantity), 0) FROM orders o JOIN products p ON o.product_id = p.id "
     "WHERE p.name = '{product}'"),
    ("Which city has the most customers? (ties: alphabetical first)",
     "SELECT city FROM customers GROUP BY city ORDER BY COUNT(*) DESC, city LIMIT 1"),
]


class SqlEnv(ToolEnv):
    name = "sql"
    system_prompt = ("You answer questions about a shop's sqlite database (tables customers(id, name, city), "
                     "products(id, name, price), orders(id, customer_id, product_id, quantity)) with sql_query.")

    def make_tools(self, task):
        path = build_db(task)

        def sql_query(query: str) -> str:
            """Run one read-only SQL query; returns up to 50 rows as JSON."""
            return json.dumps(run_query(path, query))
        return [Tool(sql_query, pure=True)]  # (a read-only database per task)

    def prompt(self, task):
        return task["question"]

    def score(self, task, answer):
        want = task["answer"]
        if isinstance(want, (int, float)):
            got = last_number(answer)
            return float(got is not None and abs(got - want) < 1e-6)
        return float(str(want).lower() in answer.lower())

    def sample_tasks(self, n: int, seed: int) -> list[dict]:
        rng = random.Random(seed)
        out = []
        for i in range(n):
            task = {"id": f"sql-{seed}-{i}", "db_seed": rng.randrange(2**31)}
            con = sqlite3.connect(f"file:{build_db(task)}?mode=ro", uri=True)
            names = [r[0] for r in con.execute("SELECT name FROM customers")]
            prods = [r[0] for r in con.execute("SELECT name FROM products")]
            q, sql = QUESTIONS[rng.randrange(len(QUESTIONS))]
            v = {"name": rng.choice(names), "city": rng.choice(CITIES), "product": rng.choice(prods)}
            task |= {"question": q.format(**v), "sql": sql.format(**v)}
            task["answer"] = con.execute(task["sql"]).fetchone()[0]
            con.close()
            out.append(task)
        return out

    def expert(self, task):
        ans = task["answer"]
        return [self.call_text("sql_query", query=task["sql"]),
                f"The answer is {int(ans) if isinstance(ans, float) and ans.is_integer() else ans}."]
