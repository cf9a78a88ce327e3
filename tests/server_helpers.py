"""Shared set-up for HTTP API tests: a free loopback port, ``serve`` arguments over tiny models, and a
real server on a thread that is yielded once healthy."""

from __future__ import annotations

import os
import socket
import threading
import time
from contextlib import contextmanager
from unittest import mock

import httpx
import pytest

from specdecode_worker.serving import serve_cli

CONTEXT = 128


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_argv(models, port, *extra):
    return ["--target", str(models["target"]), "--draft", str(models["draft"]), "--algorithm", "STANDALONE",
            "--device", "cpu", "--device-memory-gib", "1.1", "--mem-fraction-static", "0.95",
            "--context-length", str(CONTEXT), "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
            "--served-model-name", "target", *extra]


@contextmanager
def serving(argv, engine_in_process: bool = False):
    """A real server from `serve` arguments on a thread; yields (base URL, state) once healthy. The
    engine runs in its own process, as `serve` runs it, unless ``engine_in_process`` keeps it in
    this one (for a test that reaches into it)."""
    port = argv[argv.index("--port") + 1]
    with mock.patch.dict(os.environ, {"SPECDECODE_ENGINE_PROCESS": "0" if engine_in_process else "1"}):
        srv, state, _ = serve_cli.build(argv)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while not healthy(base):
            assert state.init_error is None and time.time() < deadline, f"never healthy: {state.init_error}"
            time.sleep(0.1)
        yield base, state
    finally:
        srv.should_exit = True
        thread.join(timeout=30)


def healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health").status_code == 200
    except httpx.TransportError:
        return False


def wait_until_healthy(base: str, proc, timeout: float, logs) -> None:
    """Poll a `serve` subprocess until /health answers; fail with its logs if it exits or times out."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if healthy(base):
            return
        time.sleep(0.5)
    pytest.fail("server never became healthy:\n" + "\n".join(log.read_text()[-2000:] for log in logs))
