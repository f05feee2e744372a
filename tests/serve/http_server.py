"""A real HTTP server (uvicorn, on a free loopback port, in a thread) for an in-process app:
for tests about the wire itself (slow bodies, closed connections) without a Ray cluster."""
from __future__ import annotations

import contextlib
import threading
import time

import uvicorn

from serve_testing import free_port


@contextlib.contextmanager
def serving(app):
    """Yields the base URL while uvicorn serves `app`; stops it after."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
