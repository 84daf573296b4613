"""Run a real uvicorn server on 127.0.0.1 in a background thread."""
from __future__ import annotations

import contextlib
import socket
import threading
import time

import uvicorn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(app, timeout: float = 60.0):
    """Yields the base URL (http://127.0.0.1:PORT) while the app is served."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                            lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout)


@contextlib.contextmanager
def engine_http_client(engine, model_name: str, timeout: float = 120.0):
    """Serves `engine` (an in-process Engine) under `model_name` and yields an
    httpx.Client on it, with the engine at `.engine` for leak checks."""
    import httpx

    from kvserve.engine.client.async_engine import AsyncEngine
    from kvserve.server.entrypoints.app import build_app

    app = build_app(AsyncEngine(engine), [model_name])
    with running_server(app) as url, httpx.Client(base_url=url, timeout=timeout) as http:
        http.engine = engine
        yield http
