"""The operator's health endpoint: liveness at the URL's path and Prometheus metrics at /metrics,
on one port (the chart's `health` container port), served from the operator's event loop so that
a stuck loop fails the liveness probe."""

from __future__ import annotations

import urllib.parse
from typing import Any, Callable

import aiohttp.web

from .metrics import StatusBook, render

METRICS_PATH = "/metrics"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def endpoint(url: str) -> tuple[str, int, str]:
    """(host, port, liveness path) of a --liveness URL such as http://0.0.0.0:8080/healthz."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or parts.port is None:
        raise ValueError(f"--liveness {url!r}: use http://HOST:PORT/PATH, or 'off'")
    path = parts.path or "/healthz"
    if path == METRICS_PATH:
        raise ValueError(f"--liveness {url!r}: {METRICS_PATH} serves the metrics; pick another path")
    return parts.hostname or "0.0.0.0", parts.port, path


def app(path: str, probe: Callable[[], dict[str, Any]], book: StatusBook) -> aiohttp.web.Application:
    async def health(_request: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.json_response(probe())

    async def metrics(_request: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.Response(body=render(book).encode(), headers={"Content-Type": CONTENT_TYPE})

    application = aiohttp.web.Application()
    application.add_routes([aiohttp.web.get(path, health), aiohttp.web.get(METRICS_PATH, metrics)])
    return application


async def serve(url: str, probe: Callable[[], dict[str, Any]], book: StatusBook) -> aiohttp.web.AppRunner:
    host, port, path = endpoint(url)
    runner = aiohttp.web.AppRunner(app(path, probe, book), handle_signals=False, shutdown_timeout=1.0,
                                   access_log=None)  # probes and scrapes every few seconds: no log line each
    await runner.setup()
    await aiohttp.web.TCPSite(runner, host, port).start()
    return runner
