"""code: integer questions that call for a program (counting primes, digit sums of big powers,
Fibonacci numbers modulo m, inclusion-exclusion counts, coin change); a `python` tool that runs the
model's program in the sandbox (`rollwise.agent.sandbox`: a subprocess with a deadline, resource
limits and no network); exact-answer reward. The answers come from reference functions here, and
the scripted expert writes its own programs: a test checks that the two agree."""
from __future__ import annotations

import functools
import random

from rollwise.agent.env import ToolEnv, number_reward
from rollwise.agent.sandbox import Sandbox

COINS = [1, 2, 5, 10, 20, 25, 50]


def primes_below(n: int) -> int:
    composite = [False] * n
    count = 0
    for p in range(2, n):
        if not composite[p]:
            count += 1
            for q in range(p * p, n, p):
                composite[q] = True
    return count


def fibonacci_mod(k: int, m: int) -> int:
    a, b = 0, 1
    for _ in range(k):
        a, b = b, (a + b) % m
    return a


def count_divisible(n: int, a: int, b: int, c: int) -> int:
    return sum(1 for x in range(1, n + 1) if (x % a == 0 or x % b == 0) and x % c != 0)


def coin_ways(n: int, coins: list[int]) -> int:
    @functools.cache
    def ways(rest: int, i: int) -> int:  # a different route from the expert's table
        if rest == 0:
            return 1
        if i == len(coins) or rest < 0:
            return 0
        return ways(rest - coins[i], i) + ways(rest, i + 1)
    return ways(n, 0)


# family: (question, the expert's program, reference answer, parameters drawn from a Random)
FAMILIES = {
    "primes": ("How many prime numbers are there below {n}?",
               "n = {n}\nsieve = bytearray([1]) * n\nsieve[:2] = b'\\x00\\x00'\n"
               "for i in range(2, int(n ** 0.5) + 1):\n    if sieve[i]:\n"
               "        sieve[i * i::i] = bytearray(len(range(i * i, n, i)))\nprint(sum(sieve))",
               lambda p: primes_below(p["n"]), lambda r: {"n": r.randint(500, 20000)}),
    "digits": ("What is the sum of the digits of {a} to the power {b}?",
               "print(sum(int(d) for d in str({a} ** {b})))",
               lambda p: sum(map(int, str(pow(p["a"], p["b"])))), lambda r: {"a": r.randint(2, 99), "b": r.randint(20, 300)}),
    "fibonacci": ("What is F({k}) modulo {m}, where F(1) = F(2) = 1 and F(n) = F(n - 1) + F(n - 2)?",
                  "a, b = 0, 1\nfor _ in range({k}):\n    a, b = b, a + b\nprint(a % {m})",
                  lambda p: fibonacci_mod(p["k"], p["m"]), lambda r: {"k": r.randint(50, 3000), "m": r.randint(1000, 10**9)}),
    "divisible": ("How many integers from 1 to {n} are divisible by {a} or by {b} but not by {c}?",
                  "print(len([x for x in range(1, {n} + 1) if (x % {a} == 0 or x % {b} == 0) and x % {c}]))",
                  lambda p: count_divisible(p["n"], p["a"], p["b"], p["c"]),
                  lambda r: {"n": r.randint(1000, 50000), "a": r.randint(2, 15), "b": r.randint(2, 15), "c": r.randint(2, 40)}),
    "coins": ("In how many ways can {n} cents be paid with coins of {coins} cents (any number of each, order ignored)?",
              "ways = [1] + [0] * {n}\nfor c in {coins}:\n    for v in range(c, {n} + 1):\n        ways[v] += ways[v - c]\n"
              "print(ways[{n}])",
              lambda p: coin_ways(p["n"], p["coins"]),
              lambda r: {"n": r.randint(20, 120), "coins": sorted(r.sample(COINS, r.randint(2, 4)))}),
}


class CodeEnv(ToolEnv):
    name = "code"
    system_prompt = ("You answer questions that need computing. Write a Python program with the python tool, "
                     "print the result, then give the number.")

    def __init__(self, *, sandbox: Sandbox | None = None, tool_timeout: float = 10.0, **kw) -> None:
        super().__init__(tool_timeout=tool_timeout, **kw)
        self.sandbox = sandbox or Sandbox(timeout_s=min(5.0, tool_timeout / 2), memory_mb=512)

    def make_tools(self, task):
        return [self.sandbox.tool("python")]

    def prompt(self, task):
        return task["question"]

    def score(self, task, answer):
        return number_reward(answer, task["answer"])

    def sample_tasks(self, n: int, seed: int) -> list[dict]:
        rng = random.Random(seed)
        out = []
        for i in range(n):
            family = rng.choice(sorted(FAMILIES))
            question, _, answer, draw = FAMILIES[family]
            params = draw(rng)
            out.append({"id": f"code-{seed}-{i}", "family": family, "params": params,
                        "question": question.format(**params), "answer": answer(params)})
        return out

    def expert(self, task):
        program = FAMILIES[task["family"]][1].format(**task["params"])
        return [self.call_text("python", code=program), f"The answer is {task['answer']}."]
