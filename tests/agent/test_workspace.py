"""Workspaces and the bugfix env: files kept across sandboxed commands, edits confined to the
workspace, the reward from the original tests."""
from __future__ import annotations

import asyncio
import gc
import json

import pytest

from rollwise.agent.envs import make_env
from rollwise.agent.envs.bugfix import repo
from rollwise.agent.workspace import Workspace


def test_files_persist_across_commands_and_paths_read_relative():
    ws = Workspace({"pkg/a.py": "X = 1\n"})

    async def go():
        first = await ws.bash("echo 'import pkg.a as a; print(a.X + 1)' > b.py && mkdir -p out && ls")
        second = await ws.bash("python b.py; python -c 'import sys; print(sys.argv)' x; cat missing.txt")
        third = await ws.bash("python -c \"open('b.py').read(); raise SystemExit(open('nope'))\"")
        return first, second, third
    first, second, third = asyncio.run(go())
    assert first.ok and first.stdout.split() == ["b.py", "out", "pkg"]
    assert second.stdout.splitlines() == ["2", "['-c', 'x']"] and "missing.txt" in second.stderr
    assert str(ws.path) not in third.stderr and "nope" in third.stderr  # the workspace's path is not shown
    assert not list(ws.path.rglob("__pycache__"))  # no bytecode left to go stale after an edit
    path = ws.path
    ws.close()
    assert not path.exists()


def test_edits_stay_inside_and_must_be_unambiguous(tmp_path):
    ws = Workspace({"m.py": "a = 1\nb = 1\n"})
    assert ws.edit("m.py", "a = 1", "a = 2") == "edited m.py" and ws.file("m.py").read_text() == "a = 2\nb = 1\n"
    with pytest.raises(ValueError, match="occurs 2 times"):
        ws.edit("m.py", "= ", "== ")
    with pytest.raises(ValueError, match="occurs 0 times"):
        ws.edit("m.py", "c = 3", "c = 4")
    with pytest.raises(ValueError, match="no file"):
        ws.edit("n.py", "a", "b")
    (tmp_path / "outside.txt").write_text("secret")
    (ws.path / "link").symlink_to(tmp_path / "outside.txt")
    for bad in ("../x.py", str(tmp_path / "outside.txt"), "link"):
        with pytest.raises(ValueError, match="outside the workspace"):
            ws.edit(bad, "secret", "changed")
    assert (tmp_path / "outside.txt").read_text() == "secret"
    path = ws.path
    del ws
    gc.collect()
    assert not path.exists()  # removed when dropped


def test_bugfix_reward_needs_the_bug_fixed_under_the_original_tests():
    env = make_env("bugfix")
    task = env.sample_tasks(1, seed=7)[0]
    module, test = f"{task['module']}.py", f"test_{task['module']}.py"

    def call(name, **args):
        return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"

    async def episode(actions):
        e = make_env("bugfix")
        await e.reset(task)
        out = [await e.step(a) for a in actions]
        path = e.workspace.path
        kept = path.exists()
        await e.close()
        return out, (path, kept, e.feedback(task, ""))
    # gutting the tests does not count: they are restored before the reward runs them
    steps, (path, kept, said) = asyncio.run(episode([
        call("bash", command=f"echo 'print(\"all tests passed\")' > {test}"), "Fixed."]))
    assert steps[-1][1:3] == (0.0, True) and kept and not path.exists()  # scored (kept), removed at the end
    assert said.startswith("The tests still fail:") and "Error" in said  # what a user giving details says
    steps, _ = asyncio.run(episode([call("edit_file", path=test, old="x", new="y"), call("cat", path=module)]))
    assert "occurs" in steps[0][0][0]["content"] and "unknown tool 'cat'" in steps[1][0][0]["content"]
    steps, (_, _, said) = asyncio.run(episode(env.expert(task)))
    assert said is None
    assert "all tests passed" in steps[2][0][0]["content"] and steps[-1][1:3] == (1.0, True)
    files = repo(task)
    assert set(files) == {module, test} and files[module].count("\ndef ") + 1 == len(task["functions"])
