"""The code sandbox: real subprocesses under real limits; the `code` environment's tool through it."""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time

import pytest

from rollwise.agent.envs import make_env
from rollwise.agent.sandbox import Sandbox


def run(code: str, **kw):
    stdin = kw.pop("stdin", "")
    return asyncio.run(Sandbox(**kw).run(code, stdin=stdin))


def test_output_errors_and_stdin():
    r = run("import sys\nprint(sum(range(10)))\nprint('warn', file=sys.stderr)\nprint(input()[::-1])", stdin="abc")
    assert r.ok and r.stdout == "45\ncba\n" and r.stderr == "warn\n" and r.exit_code == 0
    r = run("def f():\n    return 1 / 0\nf()")
    assert not r.ok and r.exit_code == 1 and "ZeroDivisionError" in r.stderr
    assert 'File "main.py", line 2' in r.stderr and "sandbox_child" not in r.stderr  # the program's frames only
    assert "exit code 1" in r.observation()
    r = run("def f(:\n  pass")
    assert r.exit_code == 1 and "SyntaxError" in r.stderr
    assert run("import sys; sys.exit(3)").exit_code == 3
    assert run("pass").observation() == "(no output)"


def test_deadline_kills_the_program_and_what_it_started(tmp_path):
    marker = tmp_path / "alive"
    child = f"import time; time.sleep(3); open({str(marker)!r}, 'w')"
    code = f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {child!r}])\n" \
           "print('started', flush=True)\ntime.sleep(30)"
    t0 = time.perf_counter()
    r = run(code, timeout_s=1.0)
    assert r.timed_out and r.exit_code is None and not r.ok and r.stdout == "started\n"
    assert time.perf_counter() - t0 < 10 and "timed out" in r.observation()
    time.sleep(3.5)
    assert not marker.exists()  # the background child died with it


def test_a_program_that_exits_leaves_nothing_running(tmp_path):
    marker = tmp_path / "alive"
    child = f"import time; time.sleep(2); open({str(marker)!r}, 'w')"
    code = f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', {child!r}])\nprint('bye')"
    t0 = time.perf_counter()
    r = run(code)
    assert r.ok and r.stdout == "bye\n" and time.perf_counter() - t0 < 1.9  # not held by the child's pipes
    time.sleep(2.5)
    assert not marker.exists()


def test_cpu_memory_file_and_output_limits():
    r = run("while True: pass", timeout_s=20.0, cpu_s=1)
    assert not r.ok and not r.timed_out and "CPU time limit" in r.observation() and r.seconds < 10
    r = run("x = bytearray(1 << 30)\nprint('allocated')", memory_mb=256)
    assert r.exit_code == 1 and "MemoryError" in r.stderr and not r.stdout
    r = run("open('big', 'wb').write(b'0' * (2 << 20))", file_mb=1)
    assert r.exit_code != 0 and ("File too large" in r.stderr or "file size limit" in r.observation())
    r = run("for i in range(10 ** 6): print('y' * 50)", max_output=1000)
    assert r.ok and len(r.stdout) == 1000 and r.truncated and "truncated" in r.observation()


def test_the_run_as_a_whole_is_bounded_where_cgroups_allow():
    """Where this process may make cgroups (root here, and on CI), the program and all it starts hold
    at most max_processes and memory_mb together: a fork loop stops at the bound, children that
    each fit the per-process limit are killed together past it, and a child that left the process
    group (setsid) dies with the run without holding its output back. Elsewhere the run says so."""
    from rollwise.agent.cgroups import RunGroup
    group = RunGroup.make(8, 64)
    here = group is not None
    swap_bounded = here and group.swap_bounded  # (else the kernel swaps the run out past its bound)
    if group is not None:
        group.close()
    forks = "import os, time\nn = 0\ntry:\n    for i in range(300):\n        if os.fork() == 0:\n" \
            "            time.sleep(20)\n            os._exit(0)\n        n += 1\nexcept OSError:\n    pass\nprint(n)"
    r = run(forks, max_processes=16)
    assert r.bounded == here and r.ok
    assert (int(r.stdout) < 16) if here else int(r.stdout) == 300
    kids = "import os, time\nkids = []\nfor i in range(3):\n    pid = os.fork()\n    if pid == 0:\n" \
           "        x = bytearray(150 << 20)\n        x[::4096] = b'1' * len(x[::4096])\n        time.sleep(1)\n" \
           "        os._exit(0)\n    kids.append(pid)\nprint(sorted(os.waitpid(k, 0)[1] for k in kids))"
    r = run(kids, memory_mb=256)  # each child fits 256 MB; three of them at once (each holds 1 s) do not
    killed = here and swap_bounded
    assert r.ok and r.out_of_memory == killed and ("memory limit exceeded" in r.observation()) == killed
    assert (r.stdout != "[0, 0, 0]\n") == killed
    if here:
        t0 = time.perf_counter()
        r = asyncio.run(Sandbox().shell("setsid sleep 61.37 & sleep 0.3; echo left"))
        assert r.stdout == "left\n" and time.perf_counter() - t0 < 1.0
        assert not [p for p in os.listdir("/proc") if p.isdigit() and b"sleep\x0061.37" in _cmdline(p)]


def _cmdline(pid: str) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def test_clean_environment_and_private_directory(monkeypatch):
    monkeypatch.setenv("ROLLWISE_API_KEY", "secret")
    r = run("import os\nprint(os.getcwd())\nprint('ROLLWISE_API_KEY' in os.environ)\nopen('f.txt', 'w').write('x')")
    cwd, leaked = r.stdout.split()
    assert leaked == "False" and os.path.basename(cwd).startswith("rollwise-sandbox-")
    assert not os.path.exists(cwd)  # removed with what the program wrote


def test_no_network():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    try:
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
        r = run(code)
        if r.network_isolated:
            assert r.exit_code == 1 and "connected" not in r.stdout and "Error" in r.stderr
        else:  # the kernel allows no namespace here: "deny" refuses to run rather than run connected
            assert r.stdout == "connected\n"
            assert run(code, network="deny").exit_code == 125
        assert run(code, network="allow").stdout == "connected\n"
    finally:
        server.close()


def test_cancelled_caller_kills_the_program(tmp_path):
    marker = tmp_path / "done"
    sandbox = Sandbox(timeout_s=30)

    async def go():
        task = asyncio.ensure_future(sandbox.run(f"import time\ntime.sleep(2)\nopen({str(marker)!r}, 'w')"))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    asyncio.run(go())
    time.sleep(2.5)
    assert not marker.exists()


def test_runs_at_once_are_bounded():
    sandbox = Sandbox(max_concurrent=2)
    code = "import time\nprint(time.time())\ntime.sleep(0.4)\nprint(time.time())"

    async def go():
        return await asyncio.gather(*(sandbox.run(code) for _ in range(6)))
    spans = sorted(tuple(map(float, r.stdout.split())) for r in asyncio.run(go()))
    at_once = max(sum(1 for a, b in spans if a <= t < b) for t, _ in spans)
    assert at_once == 2


def test_bad_settings_are_value_errors():
    with pytest.raises(ValueError, match="valid"):
        Sandbox(network="maybe")
    with pytest.raises(ValueError):
        Sandbox(timeout_s=0)


def test_code_env_tool_runs_the_model_program():
    env = make_env("code")
    task = env.sample_tasks(1, seed=3)[0]

    async def go():
        await env.reset(task)
        bad = await env.step('<tool_call>{"name": "python", "arguments": {"code": "print(1/0)"}}</tool_call>')
        good = await env.step(env.expert(task)[0])
        final = await env.step(env.expert(task)[1])
        return bad, good, final
    (bad_obs, _, bad_done, _), (obs, _, done, _), (_, reward, end, _) = asyncio.run(go())
    assert not bad_done and "ZeroDivisionError" in bad_obs[0]["content"]
    assert not done and obs[0]["content"].strip() == str(task["answer"])
    assert end and reward == 1.0


def test_waiting_for_a_free_slot_is_not_a_timeout():
    """Eight calls queued behind one slot wait 2.1 s in all, past the sandbox's 1.5 s deadline and
    the env's 1 s tool timeout: none times out, since each run's deadline starts with the run."""
    env = make_env("code", tool_timeout=1.0, sandbox=Sandbox(timeout_s=1.5, max_concurrent=1))
    asyncio.run(env.reset(env.sample_tasks(1, seed=0)[0]))
    tool = env._by_name["python"]
    assert tool.timeout is None  # not capped by the env's tool timeout

    async def go():
        return await asyncio.gather(*(tool.call({"code": "import time\ntime.sleep(0.3)\nprint('ok')"}) for _ in range(8)))
    t0 = time.perf_counter()
    results = asyncio.run(go())
    assert [r.content for r in results] == ["ok"] * 8 and time.perf_counter() - t0 > 2.0


def test_installed_packages_import_without_site():
    """The program's interpreter starts without `site` (several times faster); the installed packages
    are still on its path."""
    r = run("import sys, numpy\nprint(sys.flags.no_site, numpy.__name__)")
    assert r.ok and r.stdout == "1 numpy\n", r.observation()


def test_groups_a_dead_process_left_are_swept_and_what_ran_in_them_killed():
    """A process killed mid-run (SIGKILL, the OOM killer) cannot close its runs' groups: a program
    that sleeps would run on for good. The next process's first group sweeps them: what runs in a
    group of a dead process of this pid namespace is killed and the group removed; a live
    process's groups and another namespace's are left alone."""
    from rollwise.agent import cgroups
    group = cgroups.RunGroup.make(8, 64)
    if group is None:  # (no cgroups here: nothing is left behind either)
        assert cgroups._USABLE == []
        return
    parents = [d.parent for d in group.dirs]
    group.close()
    dead = subprocess.Popen(["true"])
    dead.wait()
    ns = cgroups._namespace()
    stale = [p / f"{cgroups.PREFIX}{ns}-{dead.pid}-test" for p in parents]
    kept = [p / f"{cgroups.PREFIX}{ns}-{os.getpid()}-test" for p in parents] + \
        [p / f"{cgroups.PREFIX}1-{dead.pid}-test" for p in parents]
    for d in stale + kept:
        d.mkdir()
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        for d in stale:
            (d / "cgroup.procs").write_text(str(sleeper.pid))
        cgroups.sweep(parents)  # (another test process's first group may sweep them first: same end)
        assert sleeper.wait(timeout=5) == -signal.SIGKILL
        assert not any(d.exists() for d in stale) and all(d.exists() for d in kept)
    finally:
        sleeper.kill()
        for d in stale + kept:
            cgroups._remove(d)
