"""The engine in its own process, under a real `serve` process: what crosses the pipe (tokens,
logprobs, usage, aborts), and what happens when either side goes away."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from tests.engine_helpers import tiny_models  # noqa: E402
from tests.server_helpers import free_port, serve_argv, serving, wait_until_healthy  # noqa: E402

PROMPT = "the cat and the dog"
CONTEXT = 1024  # room for a request that runs long enough to be cut
LONG = 1000
# Every round drafts, whatever the machine's load: the adaptive policy may stop drafting on a busy
# machine, and these tests are about what crosses the pipe (the policy's own tests are elsewhere).
FIXED = ("--spec-policy", "fixed")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny_models(tmp_path_factory.mktemp("engine-process"))


class Serve:
    """A `serve` process in its own session, as a pod's container runs it."""

    def __init__(self, models, log: Path, wait: bool = True):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = log
        argv = [sys.executable, "-m", "specdecode_worker", "serve", *serve_argv(models, self.port, *FIXED)]
        argv[argv.index("--log-level") + 1] = "info"
        argv[argv.index("--context-length") + 1] = str(CONTEXT)
        self.proc = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
        if wait:
            wait_until_healthy(self.base, self.proc, 120, [log])

    def engine_pid(self) -> int:
        """The engine process: the front end's one child that is not multiprocessing's resource tracker."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        engines = [int(c) for c in children if "resource_tracker" not in _cmdline(int(c))]
        assert len(engines) == 1, f"expected one engine process, found {children}"
        return engines[0]

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def _wait(condition, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _metric(base: str, name: str) -> float:
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.fixture
def serve(models, tmp_path):
    started = []

    def start(wait: bool = True) -> Serve:
        started.append(Serve(models, tmp_path / f"serve-{len(started)}.log", wait))
        return started[-1]

    yield start
    for s in started:
        s.close()


def test_a_request_across_the_pipe_is_the_same_as_in_one_process(models, serve):
    """Tokens, logprobs, echo and usage counters come back whole: the same as an engine in the
    front end's own process, which ``SPECDECODE_ENGINE_PROCESS=0`` keeps."""
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 2, "echo": True}
    with serving(serve_argv(models, free_port(), *FIXED), engine_in_process=True) as (base, _state):
        same_process = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
    server = serve()
    apart = httpx.post(f"{server.base}/v1/completions", json=body, timeout=60).json()
    assert apart["choices"][0]["text"] == same_process["choices"][0]["text"]
    ours, theirs = apart["choices"][0]["logprobs"], same_process["choices"][0]["logprobs"]
    assert ours["tokens"] == theirs["tokens"] and ours["text_offset"] == theirs["text_offset"]
    assert ours["token_logprobs"][1:] == pytest.approx(theirs["token_logprobs"][1:], abs=1e-4)  # prompt's included
    for mine, reference in zip(ours["top_logprobs"][1:], theirs["top_logprobs"][1:]):
        assert mine == pytest.approx(reference, abs=1e-4)
    assert apart["usage"]["completion_tokens"] == 12
    details = apart["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"] > 0  # drafts counted


def test_health_shows_the_engine_processs_phases_in_order_while_it_starts(serve):
    from specdecode_worker.engine.phases import Phase

    server = serve(wait=False)
    seen = []
    deadline = time.time() + 120
    while time.time() < deadline and server.proc.poll() is None:
        try:
            r = httpx.get(f"{server.base}/health", timeout=30)
        except httpx.TransportError:  # not listening yet
            time.sleep(0.05)
            continue
        if r.status_code == 200:
            break
        assert r.status_code == 503 and r.json()["status"] == "initialising", r.text
        seen.append(Phase[r.json()["phase"]])
    assert r.status_code == 200, server.log.read_text()[-2000:]
    assert seen and seen == sorted(seen)  # answered while it started, each phase after the one before


def test_a_client_that_goes_away_frees_its_kv_in_the_engine_process(serve):
    server = serve()
    body = {"prompt": PROMPT, "max_tokens": LONG, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.base}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):  # one chunk, then hang up
                assert _metric(server.base, "specdecode_running_requests") == 1
                assert _metric(server.base, "specdecode_kv_pool_used_tokens") > 0
                break
    _wait(lambda: _metric(server.base, "specdecode_running_requests") == 0, 30, "the request to end")
    assert _metric(server.base, "specdecode_kv_pool_used_tokens") == 0
    assert _metric(server.base, "specdecode_generation_tokens_total") < LONG  # cut, not run to its end


def test_sigterm_drains_the_open_request_then_stops_both_processes(serve):
    """SIGTERM to the whole process group, as a terminal's ^C or a pod's stop reaches it: the
    engine process ignores it, the open request finishes, and both processes exit."""
    server = serve()
    engine = server.engine_pid()
    body = {"prompt": PROMPT, "max_tokens": LONG, "temperature": 0, "stream": True, "ignore_eos": True}
    chunks = []
    with httpx.stream("POST", f"{server.base}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and not chunks:
                os.killpg(server.proc.pid, signal.SIGTERM)
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == LONG
    assert server.proc.wait(60) == -signal.SIGTERM  # uvicorn re-raises the signal it drained on
    assert not _alive(engine)


def test_an_engine_process_that_dies_fails_the_open_request_and_the_server_exits_1(serve):
    server = serve()
    engine = server.engine_pid()
    body = {"prompt": PROMPT, "max_tokens": LONG, "temperature": 0, "stream": True, "ignore_eos": True}
    events = []
    with httpx.stream("POST", f"{server.base}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and not events:
                os.kill(engine, signal.SIGKILL)
            if line.startswith("data: "):
                events.append(line[6:])
    errors = [json.loads(e)["error"] for e in events if e.startswith('{"error"')]
    assert errors and "the engine process exited (exit code -9)" in errors[0]["message"]
    assert events[-1] == "[DONE]"
    assert server.proc.wait(30) == 1  # Kubernetes restarts the container
    assert "the engine process exited (exit code -9) while serving" in server.log.read_text()


def test_a_request_open_when_the_engine_process_dies_gets_503(serve):
    server = serve()
    engine = server.engine_pid()
    body = {"prompt": PROMPT, "max_tokens": LONG, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(httpx.post, f"{server.base}/v1/completions", json=body, timeout=60)
        _wait(lambda: _metric(server.base, "specdecode_running_requests") == 1, 30, "the request to run")
        os.kill(engine, signal.SIGKILL)
        r = answer.result()
    assert r.status_code == 503 and "the engine process exited (exit code -9)" in r.json()["error"]["message"]
    assert server.proc.wait(30) == 1


def test_a_killed_front_end_leaves_no_engine_process(serve):
    server = serve()
    engine = server.engine_pid()
    os.kill(server.proc.pid, signal.SIGKILL)  # the front end alone: the engine sees its pipe close
    server.proc.wait(10)
    _wait(lambda: not _alive(engine), 30, "the engine process to exit")
