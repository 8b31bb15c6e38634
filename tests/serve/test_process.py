"""`ServerProcess` (rollwise.serve.process): a real `rollwise serve` subprocess whose stderr cannot block it."""
from __future__ import annotations

import socket

import httpx
import pytest

from rollwise.serve.process import ServerProcess


def test_a_server_that_logs_more_than_a_pipe_holds_keeps_serving(model_dir):
    # every malformed request is a warning line on the server's stderr; ~100 KB of them fill a pipe nobody
    # reads (64 KiB), and a server writing to it blocks in its event loop
    with ServerProcess(model_dir) as s:
        for _ in range(2500):
            with socket.create_connection(("127.0.0.1", s.port), timeout=10) as c:
                c.sendall(b"\x00 not http at all\r\n\r\n")
                c.recv(256)
        r = httpx.post(s.url + "/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_tokens": 3}},
                       timeout=30)
        assert r.status_code == 200 and len(r.json()["token_ids"]) == 3
        tail = s.stderr_tail()
        assert "Invalid HTTP request" in tail
        assert s.log.tell() > 70_000  # more than the pipe held


def test_a_server_that_fails_to_start_says_why(model_dir):
    with pytest.raises(RuntimeError, match="invalid int value"):
        ServerProcess(model_dir, "--max-model-len", "lots")
