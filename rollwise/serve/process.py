"""Start `rollwise serve` as a real subprocess on 127.0.0.1 and wait until it answers /health
(`wait_for_http`, for any server a test or benchmark starts)."""
from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
from typing import IO, Callable

import httpx

from rollwise.omp import passive_env, spin_env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exit_reason(code: int | None) -> str:
    """A process's exit code in words: the signal that killed it (SIGKILL: most often the OOM killer)."""
    if code is not None and code < 0:
        import signal
        name = signal.Signals(-code).name
        return name + (": out of memory?" if -code == signal.SIGKILL else "")
    return f"exit code {code}"


def log_tail(log: IO[bytes], chars: int = 2000) -> str:
    """The last `chars` bytes written to `log` (a binary file a process writes its output to)."""
    log.flush()
    log.seek(0, 2)
    log.seek(max(0, log.tell() - chars))
    return log.read().decode(errors="replace")


def wait_for_http(url: str, proc: subprocess.Popen | None = None, timeout: float = 120.0,
                  ok: Callable[[httpx.Response], bool] = lambda r: True, log: IO[bytes] | None = None,
                  interval: float = 0.1) -> None:
    """Return once `url` answers a GET with a response `ok` accepts (any, by default), asking every
    `interval` seconds; a RuntimeError if `proc` (the server's process) exits first, with the tail of
    `log` (the file its stderr goes to) or of its stderr if piped, and a TimeoutError after `timeout`
    seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log_tail(log) if log is not None else \
                proc.stderr.read().decode(errors="replace")[-2000:] if proc.stderr else ""
            raise RuntimeError(f"server exited with {proc.returncode}: {tail}")
        try:
            if ok(httpx.get(url, timeout=1.0)):
                return
        except httpx.HTTPError:
            pass
        time.sleep(interval)
    raise TimeoutError(f"{url} did not answer in {timeout}s")


class ServerProcess:
    """`rollwise serve MODEL_DIR *args` on a free port; a context manager that stops it on exit. The
    server's idle OpenMP threads sleep (`rollwise.omp.passive_env`: it shares the cores with its
    caller) unless `spin_count` is given (libgomp's bounded spin, `rollwise.omp.spin_env`); `env`:
    more variables for it. Its stderr goes to a temporary file (`stderr_tail()`), never to a pipe: a
    pipe nobody reads blocks a server that logs more than the pipe holds (64 KiB on Linux),
    tracebacks of failed requests say."""

    def __init__(self, model_dir: str | None, *args: str, port: int | None = None, threads: int | None = None,
                 startup_timeout: float = 120.0, spin_count: int | None = None, env: dict | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**(passive_env() if spin_count is None else spin_env(spin_count)), **(env or {})}
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        model = [] if model_dir is None else [model_dir]  # (None: the args name it, e.g. SGLang's --model-path)
        cmd = [sys.executable, "-m", "rollwise.cli", "serve", *model, "--port", str(self.port), *args]
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=self.log)
        try:
            wait_for_http(self.url + "/health", self.proc, startup_timeout, ok=lambda r: r.status_code == 200,
                          log=self.log)
        except BaseException:
            self.stop()
            raise

    def stderr_tail(self, chars: int = 2000) -> str:
        return log_tail(self.log, chars)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
