"""frozenlake: a text grid world (S start, G goal, H holes, F ice) with a `move` tool; reward 1 on
reaching the goal, 0 on falling into a hole.

`view` (env option): "position" (default), each move answers with the new row and column; "local",
also what lies one step each way and where the goal is from there, so a good move can be read off
the observation (a partially observed walk, as agents see their surroundings), and a walk's states
repeat across a group's episodes with what to do in them in view."""
from __future__ import annotations

import random
from collections import deque
from typing import Literal

from rollwise.agent.env import ToolEnv
from rollwise.agent.tools import Tool

MOVES = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0)}
VIEWS = ("position", "local")
CELLS = {"F": "ice", "H": "hole", "G": "goal", "S": "ice"}


def find(grid: list[str], ch: str) -> tuple[int, int]:
    """Where `ch` (S or G) is."""
    return next((r, c) for r, row in enumerate(grid) for c, x in enumerate(row) if x == ch)


def surroundings(grid: list[str], r: int, c: int) -> str:
    """What lies one step each way from (r, c), and which way the goal is."""
    n = len(grid)
    near = ", ".join(f"{d} {CELLS[grid[r + dr][c + dc]] if 0 <= r + dr < n and 0 <= c + dc < n else 'edge'}"
                     for d, (dr, dc) in MOVES.items())
    gr, gc = find(grid, "G")
    goal = " and ".join(w for w, yes in (("up", gr < r), ("down", gr > r), ("left", gc < c), ("right", gc > c)) if yes)
    return f"Next to you: {near}. The goal is {goal}."


def shortest_path(grid: list[str]) -> list[str] | None:
    n = len(grid)
    start = find(grid, "S")
    prev = {start: None}
    q = deque([start])
    while q:
        r, c = q.popleft()
        if grid[r][c] == "G":
            path, cur = [], (r, c)
            while prev[cur] is not None:
                cur, d = prev[cur]
                path.append(d)
            return path[::-1]
        for d, (dr, dc) in MOVES.items():
            nr, nc = r + dr, c + dc
            if 0 <= nr < n and 0 <= nc < n and grid[nr][nc] != "H" and (nr, nc) not in prev:
                prev[(nr, nc)] = ((r, c), d)
                q.append((nr, nc))
    return None


class FrozenLakeEnv(ToolEnv):
    name = "frozenlake"
    system_prompt = "You walk on a frozen lake. Reach G from S without stepping into a hole H, using move."
    answer_hint = "Call move once per turn."

    def __init__(self, view: str = "position", **options) -> None:
        if view not in VIEWS:
            raise ValueError(f"unknown view {view!r}; valid: {list(VIEWS)}")
        options.setdefault("max_turns", 32)
        super().__init__(**options)
        self.view = view
        self._pos: list[tuple[int, int]] = []

    def make_tools(self, task):
        grid, n = task["grid"], len(task["grid"])
        pos = self._pos = [find(grid, "S")]
        where = (lambda r, c: f" {surroundings(grid, r, c)}") if self.view == "local" else (lambda r, c: "")

        def move(direction: Literal["left", "right", "up", "down"]) -> str:
            """Move one cell; walking off the grid keeps you in place."""
            if direction not in MOVES:
                raise ValueError(f"direction must be one of {list(MOVES)}")
            dr, dc = MOVES[direction]
            r, c = pos[0][0] + dr, pos[0][1] + dc
            if not (0 <= r < n and 0 <= c < n):
                return f"You hit the edge and stay at row {pos[0][0]}, column {pos[0][1]}.{where(*pos[0])}"
            pos[0] = (r, c)
            if grid[r][c] == "H":
                self.end(0.0)
                return f"You fell into the hole at row {r}, column {c}."
            if grid[r][c] == "G":
                self.end(1.0)
                return "You reached the goal!"
            return f"You are at row {r}, column {c}.{where(r, c)}"
        return [Tool(move)]

    def state_key(self) -> str:
        """The walker's cell (GiGPO's anchor: the same cell is the same state, whatever text led to it,
        an edge bump's or the start's)."""
        return "row {}, column {}".format(*self._pos[0])

    def prompt(self, task):
        grid = task["grid"]
        text = "Grid (row 0 at the top):\n" + "\n".join(grid)
        return text + "\n" + surroundings(grid, *find(grid, "S")) if self.view == "local" else text

    def score(self, task, answer):
        return 0.0  # only reaching the goal (through move) earns a reward

    def sample_tasks(self, n: int, seed: int) -> list[dict]:
        rng = random.Random(seed)
        out = []
        while len(out) < n:
            size = rng.randint(4, 5)
            cells = [["F"] * size for _ in range(size)]
            free = [(r, c) for r in range(size) for c in range(size)]
            (sr, sc), (gr, gc) = rng.sample(free, 2)
            cells[sr][sc], cells[gr][gc] = "S", "G"
            for r, c in free:
                if cells[r][c] == "F" and rng.random() < 0.2:
                    cells[r][c] = "H"
            grid = ["".join(row) for row in cells]
            if shortest_path(grid):
                out.append({"id": f"frozenlake-{seed}-{len(out)}", "grid": grid})
        return out

    def expert(self, task):
        return [self.call_text("move", direction=d) for d in shortest_path(task["grid"])]
