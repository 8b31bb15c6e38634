"""bugfix: a small SWE-style task. Each episode gets a workspace holding a module of a few functions,
one of them with a one-line bug, and its tests (`python test_<module>.py`); tools `bash` (in the
code sandbox) and `edit_file`. The reward comes at the end: the tests, restored to their original
text, must pass in the workspace as the episode left it."""
from __future__ import annotations

import random

from rollwise.agent.env import FEEDBACK_CHARS, ToolEnv
from rollwise.agent.sandbox import Sandbox
from rollwise.agent.workspace import Workspace

# name: (correct source, (buggy line, correct line), test body)
FUNCTIONS = {
    "mean": ("def mean(xs):\n    return sum(xs) / len(xs)\n",
             ("    return sum(xs) / (len(xs) + 1)", "    return sum(xs) / len(xs)"),
             "assert mean([1, 2, 3]) == 2\n    assert mean([4]) == 4"),
    "clamp": ("def clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n",
              ("    return min(lo, max(x, hi))", "    return max(lo, min(x, hi))"),
              "assert clamp(5, 0, 3) == 3\n    assert clamp(-1, 0, 3) == 0\n    assert clamp(2, 0, 3) == 2"),
    "is_leap": ("def is_leap(year):\n    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)\n",
                ("    return year % 4 == 0 and year % 100 != 0",
                 "    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)"),
                "assert is_leap(2000) and is_leap(2024)\n    assert not is_leap(1900) and not is_leap(2023)"),
    "count_vowels": ("def count_vowels(s):\n    return sum(c in 'aeiouAEIOU' for c in s)\n",
                     ("    return sum(c in 'aeiou' for c in s)", "    return sum(c in 'aeiouAEIOU' for c in s)"),
                     "assert count_vowels('Apple') == 2\n    assert count_vowels('xyz') == 0"),
    "factorial": ("def factorial(n):\n    out = 1\n    for i in range(2, n + 1):\n        out *= i\n    return out\n",
                  ("    for i in range(2, n):", "    for i in range(2, n + 1):"),
                  "assert factorial(5) == 120\n    assert factorial(1) == 1 and factorial(0) == 1"),
    "reverse_words": ("def reverse_words(s):\n    return ' '.join(reversed(s.split()))\n",
                      ("    return ' '.join(sorted(s.split()))", "    return ' '.join(reversed(s.split()))"),
                      "assert reverse_words('a b c') == 'c b a'\n    assert reverse_words('hello world') == 'world hello'"),
    "last_index": ("def last_index(xs, x):\n    for i in range(len(xs) - 1, -1, -1):\n        if xs[i] == x:\n"
                   "            return i\n    return -1\n",
                   ("    for i in range(len(xs) - 1, 0, -1):", "    for i in range(len(xs) - 1, -1, -1):"),
                   "assert last_index([1, 2, 1], 1) == 2\n    assert last_index([3], 3) == 0\n"
                   "    assert last_index([1, 2], 5) == -1"),
    "running_total": ("def running_total(xs):\n    out, total = [], 0\n    for x in xs:\n        total += x\n"
                      "        out.append(total)\n    return out\n",
                      ("        out.append(total - x)", "        out.append(total)"),
                      "assert running_total([1, 2, 3]) == [1, 3, 6]\n    assert running_total([]) == []"),
    "gcd": ("def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a\n",
            ("    return b", "    return a"), "assert gcd(12, 18) == 6\n    assert gcd(7, 3) == 1"),
    "dedupe": ("def dedupe(xs):\n    return list(dict.fromkeys(xs))\n",
               ("    return list(set(xs))", "    return list(dict.fromkeys(xs))"),
               "assert dedupe([3, 1, 3, 2]) == [3, 1, 2]\n    assert dedupe([]) == []"),
}
MODULES = ["utils", "helpers", "tools", "mathx", "textkit", "core", "lib", "common"]
RUNNER = ('\n\nif __name__ == "__main__":\n    for name, test in sorted(globals().items()):\n'
          '        if name.startswith("test_"):\n            test()\n    print("all tests passed")\n')


def repo(task: dict) -> dict[str, str]:
    """The task's files: the module (its buggy function broken) and its tests."""
    module, names, buggy = task["module"], task["functions"], task["buggy"]
    parts = []
    for name in names:
        source, (bad, good), _ = FUNCTIONS[name]
        parts.append(source.replace(good, bad, 1) if name == buggy else source)
    tests = f"from {module} import *\n" + "".join(f"\n\ndef test_{n}():\n    {FUNCTIONS[n][2]}" for n in names) + RUNNER
    return {f"{module}.py": "\n\n".join(parts), f"test_{module}.py": tests}


class BugfixEnv(ToolEnv):
    name = "bugfix"
    system_prompt = ("You fix bugs in a Python repository. Use bash to run commands (tests, cat, grep) and "
                     "edit_file to change a file.")
    answer_hint = "When the tests pass, reply with a one-line summary of the fix, without a tool call."

    def __init__(self, *, sandbox: Sandbox | None = None, **kw) -> None:
        super().__init__(**kw)
        self.sandbox = sandbox or Sandbox(timeout_s=min(5.0, self.tool_timeout / 2), memory_mb=512)
        self.workspace: Workspace | None = None
        self._failed: str | None = None  # the tests' output at the last answer, when they failed

    def make_tools(self, task):
        if self.workspace is not None:
            self.workspace.close()
        self.workspace = Workspace(repo(task), self.sandbox)
        return self.workspace.tools()

    def prompt(self, task):
        return (f"Running `python test_{task['module']}.py` fails. Fix the bug in {task['module']}.py so that "
                "the tests pass; do not change the tests.")

    async def score(self, task, answer):
        ws, test = self.workspace, f"test_{task['module']}.py"
        ws.file(test).write_text(repo(task)[test], encoding="utf-8")  # the tests as given, whatever was done to them
        result = await ws.bash(f"python {test}")
        passed = result.ok and "all tests passed" in result.stdout
        self._failed = None if passed else result.observation()[-FEEDBACK_CHARS:]
        return float(passed)

    def feedback(self, task, answer) -> str | None:
        """The tests' failing output at the last answer (for a user giving feedback with details)."""
        return f"The tests still fail:\n{self._failed}" if self._failed else None

    async def close(self) -> None:
        """The episode has ended: its workspace goes (kept until then: a user may ask for more work)."""
        await super().close()
        if self.workspace is not None:
            self.workspace.close()
            self.workspace = None

    def sample_tasks(self, n: int, seed: int) -> list[dict]:
        rng = random.Random(seed)
        out = []
        for i in range(n):
            names = rng.sample(sorted(FUNCTIONS), rng.randint(2, 4))
            out.append({"id": f"bugfix-{seed}-{i}", "module": rng.choice(MODULES), "functions": names,
                        "buggy": rng.choice(names)})
        return out

    def expert(self, task):
        bad, good = FUNCTIONS[task["buggy"]][1]
        run = self.call_text("bash", command=f"python test_{task['module']}.py")
        edit = self.call_text("edit_file", path=f"{task['module']}.py", old=bad, new=good)
        return [run, edit, run, f"Fixed {task['buggy']} in {task['module']}.py."]
