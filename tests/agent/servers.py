"""A FastAPI app served on 127.0.0.1 from a thread, for the tests' stand-in servers (a judge, a retriever)."""
from __future__ import annotations

import threading
import time

import uvicorn

from rollwise.serve.process import free_port


class AppServer:
    """`with AppServer(app) as srv:` serves `app` on a free port until the block ends."""

    def __init__(self, app) -> None:
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join()
