"""Start `rollwise serve` as a real subprocess on 127.0.0.1 and wait until it answers /health."""
from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx

from rollwise.omp import passive_env, spin_env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`rollwise serve MODEL_DIR *args` on a free port; a context manager that stops it on exit. The
    server's idle OpenMP threads sleep (`rollwise.omp.passive_env`: it shares the cores with its
    caller) unless `spin_count` is given (libgomp's bounded spin, `rollwise.omp.spin_env`)."""

    def __init__(self, model_dir: str, *args: str, port: int | None = None, threads: int | None = None,
                 startup_timeout: float = 120.0, spin_count: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = passive_env() if spin_count is None else spin_env(spin_count)
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        cmd = [sys.executable, "-m", "rollwise.cli", "serve", model_dir, "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server on port {self.port} did not become healthy in {startup_timeout}s")

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
