"""A workspace: a directory an episode keeps across its tool calls (a small repository to read, edit
and test, as SWE agents work), with tools over it: `bash` (a shell command line, run in the code
sandbox with its limits and no network) and `edit_file` (replace one exact occurrence of a text in
a file: the str_replace edit of SWE agents). Removed by `close()`, when its owner is dropped, or at
exit.

    ws = Workspace({"calc.py": "...", "test_calc.py": "..."})
    result = await ws.bash("python test_calc.py")
    ws.edit("calc.py", "return a - b", "return a + b")
"""
from __future__ import annotations

import shutil
import tempfile
import weakref
from pathlib import Path

from rollwise.agent.sandbox import RunResult, Sandbox
from rollwise.agent.tools import Tool


class Workspace:
    def __init__(self, files: dict[str, str], sandbox: Sandbox | None = None) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="rollwise-workspace-"))
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.path), True)
        self.sandbox = sandbox or Sandbox()
        for name, text in files.items():
            target = self.file(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")

    def file(self, name: str) -> Path:
        """A path inside the workspace; a ValueError for one that leaves it (`..`, absolute, or a link
        out of it)."""
        path = (self.path / name).resolve()
        if not path.is_relative_to(self.path.resolve()):
            raise ValueError(f"{name!r} is outside the workspace")
        return path

    async def bash(self, command: str) -> RunResult:
        """The command's result, with the workspace's own (random) path shown as relative paths, so
        the same work reads the same in every episode."""
        r = await self.sandbox.shell(command, cwd=self.path)
        for here in {f"{self.path}/", f"{self.path.resolve()}/"}:
            r.stdout, r.stderr = r.stdout.replace(here, ""), r.stderr.replace(here, "")
        return r

    def edit(self, path: str, old: str, new: str) -> str:
        target = self.file(path)
        if not target.is_file():
            raise ValueError(f"no file {path!r} in the workspace")
        text = target.read_text(encoding="utf-8")
        n = text.count(old) if old else 0
        if n != 1:
            raise ValueError(f"old text occurs {n} times in {path!r}; give text that occurs exactly once")
        target.write_text(text.replace(old, new, 1), encoding="utf-8")
        return f"edited {path}"

    def tools(self) -> list[Tool]:
        async def bash(command: str) -> str:
            """Run a shell command line in the repository (its output, then any error)."""
            return (await self.bash(command)).observation()

        def edit_file(path: str, old: str, new: str) -> str:
            """Replace the one occurrence of `old` in the file at `path` with `new`."""
            return self.edit(path, old, new)
        return [Tool(bash, timeout=None), Tool(edit_file)]  # (bash: the sandbox's deadline, as Sandbox.tool)

    def close(self) -> None:
        self._cleanup()
