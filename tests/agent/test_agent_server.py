"""Agent programs that stay up (`serve = true`, rollwise.agent.agent_server): every episode a JSON
line to one long-lived process, the same token ids as the in-process agent, a program that dies or
reports an error failing only its episodes, cancelled episodes told so, processes killed at the end."""
from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import pytest

from rollwise.agent.agent_server import AgentServer
from rollwise.agent.envs import make_env
from rollwise.agent.episode import collect, run_attempts, run_episode
from rollwise.agent.generator import ScriptedGenerator, expert_policy
from rollwise.engine.tokenizer import Tokenizer
from rollwise.types import SamplingParams

EXAMPLES = Path(__file__).parents[2] / "examples"
P = SamplingParams(temperature=1.0, max_tokens=64)


def phonebook():
    return make_env("phonebook")


def _gone(pid: int) -> bool:
    for _ in range(100):
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.02)
    return False


def test_one_long_lived_program_runs_every_episode_with_the_in_process_agents_token_ids(model_dir):
    tok = Tokenizer(model_dir)
    tasks = phonebook().sample_tasks(4, seed=12)
    gen = ScriptedGenerator(tok, expert_policy(phonebook, tasks), delay=0.01)
    command = [sys.executable, str(EXAMPLES / "phonebook_agent_cli.py"), "--serve"]
    servers = []

    async def go(make, served=False):
        out = [t for g in [g async for g in collect(gen, make, tasks, P, group_size=3)] for t in g]
        if served:
            servers.append(AgentServer.shared(command))  # (this loop's: the one the episodes used)
        return out
    served = asyncio.run(go(lambda: make_env("agent", command=command, serve=True), served=True))
    inproc = asyncio.run(go(lambda: make_env("agent", agent=f"{EXAMPLES / 'phonebook_agent.py'}:PhonebookAgent")))
    key = lambda t: t.trajectory_id  # noqa: E731
    assert len(served) == 12
    for a, b in zip(sorted(served, key=key), sorted(inproc, key=key)):
        assert a.status == "done" and a.reward == b.reward == 1.0, a.error
        assert a.token_ids == b.token_ids and a.num_turns == b.num_turns == 2
    server = servers[0]
    assert server.stats == {"started": 1, "episodes": 12, "exits": 0}  # one process for all twelve
    assert _gone(server.slots[0].proc.pid)  # the loop ended: the program went with it


SERVER = """
import json, os, sys, time
open(sys.argv[1], "a").write(f"start {os.getpid()}\\n")
print("not a protocol line", flush=True)
for line in sys.stdin:
    msg = json.loads(line)
    open(sys.argv[1], "a").write(json.dumps(msg.get("task", msg)) + "\\n")
    if msg.get("cancel"):
        continue
    kind = msg["task"]["kind"]
    if kind == "die":
        print("dying", file=sys.stderr, flush=True)
        sys.exit(4)
    if kind == "hang":
        continue
    out = {"id": msg["id"], "error": "no such user"} if kind == "error" else {"id": msg["id"], "reward": 0.5}
    print(json.dumps(out), flush=True)
"""


def test_a_program_that_errs_dies_or_hangs_fails_only_those_episodes(model_dir, tmp_path):
    tok = Tokenizer(model_dir)
    log = tmp_path / "log"
    (tmp_path / "server.py").write_text(SERVER)
    command = [sys.executable, str(tmp_path / "server.py"), str(log)]
    make = lambda: make_env("agent", command=command, serve=True)  # noqa: E731
    gen = ScriptedGenerator(tok, lambda req: "x")

    async def go():
        async def one(kind, deadline=5.0):
            return await run_episode(gen, make(), {"kind": kind}, P, deadline_s=deadline)
        # the agent never asks the model: the env says so, after the reward came back
        ok, err = await asyncio.gather(one("ok"), one("error"))
        hung = await one("hang", deadline=0.5)
        died = await one("die")
        again = await one("ok")  # a new process
        retried = await run_attempts(gen, make, {"kind": "die"}, P, retries=1)
        return ok, err, hung, died, again, retried, AgentServer.shared(command)
    ok, err, hung, died, again, retried, server = asyncio.run(go())
    assert ok.status == "error" and "ended without asking the model anything (returned 0.5)" in ok.error
    assert err.status == "error" and "reported an error: no such user" in err.error
    assert hung.status == "timeout"
    assert died.status == "error" and "exited with status 4: dying" in died.error
    assert again.status == "error" and "returned 0.5" in again.error
    assert retried.status == "error" and len(retried.retried) == 1 and "exited with status 4" in retried.error
    lines = log.read_text().splitlines()
    starts = [x for x in lines if x.startswith("start ")]
    assert len(starts) == 3 == server.stats["started"]  # first, after the first death, after the second
    hang_msgs = [json.loads(x) for x in lines if not x.startswith("start ")]
    assert any(m.get("cancel") for m in hang_msgs)  # the hung episode's cancel line reached the program
    assert _gone(int(starts[-1].split()[1]))


def test_serve_options_are_checked():
    with pytest.raises(ValueError, match="serve = true.*set command"):
        make_env("agent", agent=f"{EXAMPLES / 'phonebook_agent.py'}:PhonebookAgent", serve=True)
    with pytest.raises(ValueError, match="processes must be >= 1"):
        make_env("agent", command=[sys.executable, "-c", "pass"], serve=True, processes=0)
