"""One `rollwise serve` subprocess per test module, and a client for it."""
from __future__ import annotations

import httpx
import pytest

from rollwise.serve.process import ServerProcess


@pytest.fixture(scope="module")
def server(model_dir):
    with ServerProcess(model_dir, "--max-num-seqs", "16", "--max-model-len", "512") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c
